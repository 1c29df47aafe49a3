"""One time step of the recurrent cells, from the gates' pre-activations.

A cell's gates are dense maps (or convolutions) of the input and of the hidden state.  Those
maps are parameters, so each frontend computes them with its own dense submodules (Linen's
``ii``/``hi``... ``Dense`` children, NNX's ``Linear`` attributes); the step functions here
take the resulting pre-activations and do the rest: the gate nonlinearities and the carry
update.  ``fused_dense`` is ``OptimizedLSTMCell``'s one matmul for several dense maps.

Gates are computed in ``dtype`` while the carry is kept in ``param_dtype``: where the two
mix, the operands are promoted explicitly (``_mixed``), which strict dtype promotion accepts
(Linen mixes them implicitly).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from varjax.functional.dtypes import promote_dtype
from varjax.ir.typing import PyTree

__all__ = ["lstm_step", "gru_step", "mgu_step", "simple_step", "fused_dense", "flip_sequences",
           "select_last_carry"]

Array = jax.Array
Activation = Callable[..., Any]


def _mixed(op: Callable[[Array, Array], Array], a: Array, b: Array) -> Array:
    """``op(a, b)`` in the dtype standard promotion gives, by an explicit cast."""
    a, b = promote_dtype(a, b, inexact=False)
    return op(a, b)


def lstm_step(c: Array, i: Array, f: Array, g: Array, o: Array, *, gate_fn: Activation = jax.nn.sigmoid,
              activation_fn: Activation = jnp.tanh) -> tuple[Array, Array]:
    """``(c', h')`` from the input, forget, cell and output pre-activations ``i, f, g, o``:
    ``c' = gate(f) c + gate(i) act(g)``, ``h' = gate(o) act(c')``."""
    i, f, g, o = gate_fn(i), gate_fn(f), activation_fn(g), gate_fn(o)
    new_c = _mixed(operator.add, _mixed(operator.mul, f, c), i * g)
    return new_c, _mixed(operator.mul, o, activation_fn(new_c))


def gru_step(h: Array, r: Array, z: Array, x_n: Array, h_n: Array, *, gate_fn: Activation = jax.nn.sigmoid,
             activation_fn: Activation = jnp.tanh) -> Array:
    """``h'`` from the reset and update pre-activations ``r, z`` and the candidate's input and
    hidden parts: ``n = act(x_n + gate(r) h_n)``, ``h' = (1 - gate(z)) n + gate(z) h``."""
    r, z = gate_fn(r), gate_fn(z)
    n = activation_fn(x_n + r * h_n)
    return _mixed(operator.add, (1.0 - z) * n, _mixed(operator.mul, z, h))


def mgu_step(h: Array, f: Array, x_n: Array, h_n: Array, *, reset_gate: bool = True,
             gate_fn: Activation = jax.nn.sigmoid, activation_fn: Activation = jnp.tanh) -> Array:
    """``h'`` of a minimal gated unit: ``n = act(x_n + gate(f) h_n)`` (``x_n + h_n`` without
    ``reset_gate``), ``h' = (1 - gate(f)) n + gate(f) h``."""
    f = gate_fn(f)
    if reset_gate:
        h_n = h_n * f
    n = activation_fn(x_n + h_n)
    return _mixed(operator.add, (1.0 - f) * n, _mixed(operator.mul, f, h))


def simple_step(h: Array, x_part: Array, h_part: Array, *, residual: bool = False,
                activation_fn: Activation = jnp.tanh) -> Array:
    """``h' = act(x_part + h_part)``, plus ``h`` inside the activation when ``residual``."""
    new_h = x_part + h_part
    if residual:
        new_h = _mixed(operator.add, new_h, h)
    return activation_fn(new_h)


def fused_dense(x: Array, params: Sequence[tuple[Array, Array | None]], *, dtype: Any = None) -> list[Array]:
    """``x @ kernel + bias`` for every ``(kernel, bias)`` in ``params``, as one matmul.

    Either every bias is given or none (an LSTM's input maps have none, its hidden maps all).
    """
    kernel = jnp.concatenate([k for k, _ in params], axis=-1)
    biases = [b for _, b in params if b is not None]
    bias = jnp.concatenate(biases, axis=-1) if biases else None
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=dtype)
    y = jnp.dot(x, kernel)
    if bias is not None:
        y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return jnp.split(y, np.cumsum([k.shape[-1] for k, _ in params[:-1]]), axis=-1)


def flip_sequences(inputs: Array, seq_lengths: Array | None, num_batch_dims: int, time_major: bool) -> Array:
    """Reverses each sequence along the time axis, keeping its padding at the end.

    Without ``seq_lengths`` this is a plain flip; with them, position ``t`` of a
    sequence of length ``n`` takes position ``n - 1 - t`` (mod the time length,
    which sends padding to padding).  ``RNN(reverse=True)`` runs over this.
    """
    time_axis = 0 if time_major else num_batch_dims
    if seq_lengths is None:
        return jnp.flip(inputs, axis=time_axis)
    steps = inputs.shape[time_axis]
    index_shape = [1] * inputs.ndim
    index_shape[time_axis] = steps
    lengths = jnp.expand_dims(seq_lengths, time_axis)
    lengths = lengths.reshape(lengths.shape + (1,) * (inputs.ndim - lengths.ndim))
    index = (jnp.arange(steps - 1, -1, -1).reshape(index_shape) + lengths) % steps
    return jnp.take_along_axis(inputs, index, axis=time_axis)


def select_last_carry(carries: PyTree, seq_lengths: Array) -> PyTree:
    """From per-step carries stacked on a leading time axis (``[time, batch, ...]``), each
    sequence's carry after its own last valid step ``seq_lengths - 1``."""
    batch = jnp.arange(seq_lengths.shape[0])
    return jax.tree.map(lambda c: c[seq_lengths - 1, batch], carries)
