"""Recurrent cells and the ``RNN`` that scans one over a sequence, as in Linen.

A cell is a module ``cell(carry, x) -> (new_carry, y)`` for one time step;
``initialize_carry`` builds the first carry from the input shape.  Parameter
names (``ii``, ``hf``, ...), shapes and outputs match ``flax.linen``.

``RNN`` runs the cell under the lifted ``nn.scan``, with Linen's fields and
defaults: ``variable_broadcast='params'`` (one set of cell parameters shared by
every step, created at init by a peeled first step), ``split_rngs={'params':
False}`` (every other stream is broadcast too: one dropout mask for all steps
unless the stream is split), ``variable_axes`` and ``variable_carry``.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from varjax.nn import initializers
from varjax.nn.activation import sigmoid, tanh
from varjax.nn.dtypes import promote_dtype
from varjax.nn.linear import Dense, default_kernel_init
from varjax.nn.module import Module, compact, nowrap
from varjax.transforms.loops import scan

__all__ = ["RNNCellBase", "LSTMCell", "GRUCell", "SimpleCell", "RNN"]

Array = jax.Array
Carry = Any


def _mixed(op: Callable[[Array, Array], Array], a: Array, b: Array) -> Array:
    """``op(a, b)`` in the dtype standard promotion gives, by an explicit cast.

    Gates are computed in ``dtype`` but the carry is kept in ``param_dtype``;
    Linen mixes them implicitly, which strict dtype promotion rejects.
    """
    a, b = promote_dtype(a, b, inexact=False)
    return op(a, b)


class RNNCellBase(Module):
    """A recurrent cell: ``__call__(carry, inputs) -> (new_carry, output)``.

    ``RNN`` needs two things beyond the step itself: ``initialize_carry`` to
    build the first carry and ``num_feature_axes`` to find the time axis
    (``inputs`` is ``[batch..., time, *features]``).
    """

    @nowrap
    def initialize_carry(self, rng: Array, input_shape: tuple[int, ...]) -> Carry:
        """The carry before the first step, for one step's input of ``input_shape``."""
        raise NotImplementedError

    @property
    def num_feature_axes(self) -> int:
        """How many trailing axes of one step's input are features (the rest are batch)."""
        raise NotImplementedError


class _VectorCell(RNNCellBase):
    """Shared by cells whose carry is ``[batch..., features]`` arrays drawn from
    ``carry_init`` (one per ``_carry_parts``)."""

    _carry_parts = 1

    @nowrap
    def initialize_carry(self, rng: Array, input_shape: tuple[int, ...]) -> Carry:
        shape = (*input_shape[:-1], self.features)
        if self._carry_parts == 1:
            return self.carry_init(rng, shape, self.param_dtype)
        return tuple(self.carry_init(k, shape, self.param_dtype)
                     for k in jax.random.split(rng, self._carry_parts))

    @property
    def num_feature_axes(self) -> int:
        return 1


class _GatedCell(_VectorCell):
    """The fields LSTM and GRU cells share (in Linen's order, so positional arguments port)."""

    features: int
    gate_fn: Callable[..., Any] = sigmoid
    activation_fn: Callable[..., Any] = tanh
    kernel_init: initializers.Initializer = default_kernel_init
    recurrent_kernel_init: initializers.Initializer = initializers.orthogonal()
    bias_init: initializers.Initializer = initializers.zeros_init()
    dtype: Any = None
    param_dtype: Any = jnp.float32
    carry_init: initializers.Initializer = initializers.zeros_init()


class LSTMCell(_GatedCell):
    r"""Long short-term memory cell; the carry is ``(c, h)``.

    .. math::
        i = \sigma(W_{ii} x + W_{hi} h + b_{hi}), \quad
        f = \sigma(W_{if} x + W_{hf} h + b_{hf}), \quad
        g = \tanh(W_{ig} x + W_{hg} h + b_{hg}), \quad
        o = \sigma(W_{io} x + W_{ho} h + b_{ho}) \\
        c' = f c + i g, \quad h' = o \tanh(c')

    Each ``W`` is a ``Dense`` submodule named by its subscript; only the
    hidden-state ones (``h*``) have biases.
    """

    _carry_parts = 2

    @compact
    def __call__(self, carry: tuple[Array, Array], inputs: Array) -> tuple[tuple[Array, Array], Array]:
        c, h = carry
        dense_h = functools.partial(Dense, features=h.shape[-1], use_bias=True,
                                    kernel_init=self.recurrent_kernel_init, bias_init=self.bias_init,
                                    dtype=self.dtype, param_dtype=self.param_dtype)
        dense_i = functools.partial(Dense, features=h.shape[-1], use_bias=False, kernel_init=self.kernel_init,
                                    dtype=self.dtype, param_dtype=self.param_dtype)
        i = self.gate_fn(dense_i(name="ii")(inputs) + dense_h(name="hi")(h))
        f = self.gate_fn(dense_i(name="if")(inputs) + dense_h(name="hf")(h))
        g = self.activation_fn(dense_i(name="ig")(inputs) + dense_h(name="hg")(h))
        o = self.gate_fn(dense_i(name="io")(inputs) + dense_h(name="ho")(h))
        new_c = _mixed(operator.add, _mixed(operator.mul, f, c), i * g)
        new_h = _mixed(operator.mul, o, self.activation_fn(new_c))
        return (new_c, new_h), new_h


class GRUCell(_GatedCell):
    r"""Gated recurrent unit; the carry is ``h``.

    .. math::
        r = \sigma(W_{ir} x + b_{ir} + W_{hr} h), \quad
        z = \sigma(W_{iz} x + b_{iz} + W_{hz} h) \\
        n = \tanh(W_{in} x + b_{in} + r (W_{hn} h + b_{hn})), \quad
        h' = (1 - z) n + z h
    """

    @compact
    def __call__(self, carry: Array, inputs: Array) -> tuple[Array, Array]:
        h = carry
        dense_h = functools.partial(Dense, features=h.shape[-1], use_bias=False,
                                    kernel_init=self.recurrent_kernel_init, bias_init=self.bias_init,
                                    dtype=self.dtype, param_dtype=self.param_dtype)
        dense_i = functools.partial(Dense, features=h.shape[-1], use_bias=True, kernel_init=self.kernel_init,
                                    bias_init=self.bias_init, dtype=self.dtype, param_dtype=self.param_dtype)
        r = self.gate_fn(dense_i(name="ir")(inputs) + dense_h(name="hr")(h))
        z = self.gate_fn(dense_i(name="iz")(inputs) + dense_h(name="hz")(h))
        n = self.activation_fn(dense_i(name="in")(inputs) + r * dense_h(name="hn", use_bias=True)(h))
        new_h = _mixed(operator.add, (1.0 - z) * n, _mixed(operator.mul, z, h))
        return new_h, new_h


class SimpleCell(_VectorCell):
    r"""Elman cell, :math:`h' = \mathrm{act}(W_i x + b_i + W_h h)`; the carry is ``h``.

    ``residual=True`` adds ``h`` before the activation (arXiv:1801.06105).
    """

    features: int
    activation_fn: Callable[..., Any] = tanh
    kernel_init: initializers.Initializer = default_kernel_init
    recurrent_kernel_init: initializers.Initializer = initializers.orthogonal()
    bias_init: initializers.Initializer = initializers.zeros_init()
    dtype: Any = None
    param_dtype: Any = jnp.float32
    carry_init: initializers.Initializer = initializers.zeros_init()
    residual: bool = False

    @compact
    def __call__(self, carry: Array, inputs: Array) -> tuple[Array, Array]:
        new_carry = (
            Dense(carry.shape[-1], use_bias=True, kernel_init=self.kernel_init, bias_init=self.bias_init,
                  dtype=self.dtype, param_dtype=self.param_dtype, name="i")(inputs)
            + Dense(carry.shape[-1], use_bias=False, kernel_init=self.recurrent_kernel_init,
                    dtype=self.dtype, param_dtype=self.param_dtype, name="h")(carry))
        if self.residual:
            new_carry = _mixed(operator.add, new_carry, carry)
        new_carry = self.activation_fn(new_carry)
        return new_carry, new_carry


class RNN(Module):
    """Applies ``cell`` over the time axis of a sequence.

    ``inputs`` is ``[batch..., time, *features]`` (``[time, batch..., *features]``
    with ``time_major``); the outputs keep that layout.  ``reverse`` runs from
    the last step to the first and returns outputs in processing order unless
    ``keep_order``.  ``seq_lengths`` (``[batch]``) marks padding at the end of
    each sequence: reversing keeps padding at the end, and with
    ``return_carry`` the carry is the one after each sequence's last valid
    step.  Outputs at padded positions are not zeroed.

    ``__call__``'s ``return_carry``, ``time_major``, ``reverse`` and
    ``keep_order`` override the fields for one call.  Without
    ``initial_carry`` the carry comes from ``cell.initialize_carry(init_key)``,
    with ``jax.random.key(0)`` when ``init_key`` is not given either.
    """

    cell: RNNCellBase
    time_major: bool = False
    return_carry: bool = False
    reverse: bool = False
    keep_order: bool = False
    unroll: int = 1
    variable_axes: Mapping[Any, int] = dataclasses.field(default_factory=dict)
    variable_broadcast: Any = "params"
    variable_carry: Any = False
    split_rngs: Mapping[Any, bool] = dataclasses.field(default_factory=lambda: {"params": False})

    def __call__(self, inputs: Array, *, initial_carry: Carry | None = None, init_key: Array | None = None,
                 seq_lengths: Array | None = None, return_carry: bool | None = None,
                 time_major: bool | None = None, reverse: bool | None = None,
                 keep_order: bool | None = None) -> Any:
        return_carry = self.return_carry if return_carry is None else return_carry
        time_major = self.time_major if time_major is None else time_major
        reverse = self.reverse if reverse is None else reverse
        keep_order = self.keep_order if keep_order is None else keep_order

        time_axis = 0 if time_major else inputs.ndim - self.cell.num_feature_axes - 1
        num_batch_dims = inputs.ndim - self.cell.num_feature_axes - 1
        if reverse:
            inputs = _flip_sequences(inputs, seq_lengths, num_batch_dims, time_major)
        if initial_carry is None:
            step_shape = inputs.shape[:time_axis] + inputs.shape[time_axis + 1:]
            initial_carry = self.cell.initialize_carry(
                jax.random.key(0) if init_key is None else init_key, step_shape)

        # With seq_lengths the carry after each sequence's own last step is
        # picked from the per-step carries afterwards, so they are kept too.
        keep_carries = seq_lengths is not None and return_carry

        def step(cell: RNNCellBase, carry: Carry, x: Array) -> tuple[Carry, Any]:
            carry, y = cell(carry, x)
            return carry, ((carry, y) if keep_carries else y)

        # The lifted scan, as in Linen: by default the cell's params are broadcast (created
        # by a peeled first step at init) and its RNG streams are not split.
        carry, ys = scan(step, variable_axes=self.variable_axes,
                         variable_broadcast=self.variable_broadcast,
                         variable_carry=self.variable_carry, split_rngs=self.split_rngs,
                         unroll=self.unroll)(self.cell, initial_carry,
                                             jnp.moveaxis(inputs, time_axis, 0))

        if keep_carries:
            carries, ys = ys
            batch = jnp.arange(seq_lengths.shape[0])
            carry = jax.tree.map(lambda c: c[seq_lengths - 1, batch], carries)
        outputs = jax.tree.map(lambda y: jnp.moveaxis(y, 0, time_axis), ys)
        if reverse and keep_order:
            outputs = jax.tree.map(lambda y: _flip_sequences(y, seq_lengths, num_batch_dims, time_major),
                                   outputs)
        return (carry, outputs) if return_carry else outputs


def _flip_sequences(inputs: Array, seq_lengths: Array | None, num_batch_dims: int, time_major: bool) -> Array:
    """Reverses each sequence along the time axis, keeping its padding at the end.

    Without ``seq_lengths`` this is a plain flip; with them, position ``t`` of a
    sequence of length ``n`` takes position ``n - 1 - t`` (mod the time length,
    which sends padding to padding).
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
