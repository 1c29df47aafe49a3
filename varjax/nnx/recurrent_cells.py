"""flax.nnx's recurrent cells: one time step ``cell(carry, x) -> (new_carry, y)``.

Each cell declares its gates as ``nnx.Linear`` attributes, created in flax.nnx's order with
its names (``LSTMCell``'s ``ii``, ``if_``... ``ho``; the fused cells' ``dense_i``/
``dense_h``), so ``nnx.Rngs(0)`` gives flax.nnx's parameters bit for bit, and hands the
gates' pre-activations to ``varjax.functional.recurrent`` (``lstm_step``, ``gru_step``,
``simple_step``), the step math ``varjax.nn``'s Linen cells call too.

``initialize_carry(input_shape, rngs)`` draws the carry from the ``carry`` stream (or a
stream given directly, or the one kept with the deprecated ``keep_rngs=True``), one draw
per carry part, as flax.nnx does; ``num_feature_axes`` tells ``RNN`` where the time axis is.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from varjax.functional import initializers
from varjax.functional import recurrent as F
from varjax.functional.activations import sigmoid, tanh
from varjax.ir.typing import Dtype, Initializer, Metadata, PRNGKey, PyTree, Shape
from varjax.nnx.call_options import first_from
from varjax.nnx.linear import NO_METADATA, Linear, default_kernel_init
from varjax.nnx.linear import promote_dtype as default_promote_dtype
from varjax.nnx.module import Module
from varjax.nnx.pytree import data
from varjax.trace.rngs import Rngs, RngStream

__all__ = ["RNNCellBase", "LSTMCell", "OptimizedLSTMCell", "GRUCell", "SimpleCell",
           "modified_orthogonal"]

Array = jax.Array
Carry = PyTree


def modified_orthogonal(key: PRNGKey, shape: Shape, dtype: Dtype = jnp.float32) -> Array:
    """``LSTMCell``'s default recurrent kernel: orthogonal in float32, then cast, so half
    precision gets the float32 matrix rounded (flax.nnx's, bit for bit)."""
    return initializers.orthogonal()(key, shape).astype(dtype)


class RNNCellBase(Module):
    """A recurrent cell: ``__call__(carry, inputs) -> (new_carry, output)``, plus what
    ``RNN`` needs to run it: ``initialize_carry`` and ``num_feature_axes``."""

    def initialize_carry(self, input_shape: tuple[int, ...],
                         rngs: Rngs | RngStream | None = None,
                         carry_init: Initializer | None = None) -> Carry:
        """The carry before the first step, for one step's input of ``input_shape``."""
        raise NotImplementedError

    def __call__(self, carry: Carry, inputs: Array) -> tuple[Carry, Array]:
        raise NotImplementedError

    @property
    def num_feature_axes(self) -> int:
        """How many trailing axes of one step's input are features (the rest are batch)."""
        raise NotImplementedError


class _VectorCell(RNNCellBase):
    """What every cell here shares: a carry of ``(*batch, hidden_features)`` arrays, one per
    ``_carry_parts``, drawn from ``carry_init`` (zeros unless given), and flax.nnx's
    handling of ``keep_rngs`` and of ``carry_init`` given at construction (both warned)."""

    _carry_parts = 1

    def _options(self, in_features: int, hidden_features: int, dtype: Dtype | None,
                 param_dtype: Dtype, promote_dtype: Callable[..., Any], keep_rngs: bool,
                 rngs: Rngs) -> None:
        self.in_features, self.hidden_features = in_features, hidden_features
        self.dtype, self.param_dtype, self.promote_dtype = dtype, param_dtype, promote_dtype
        if keep_rngs:
            warnings.warn("keep_rngs argument is deprecated. Please use rngs argument in "
                          "__call__ instead", stacklevel=3)
            self.rngs = rngs.carry.fork()
        else:
            self.rngs = data(None)

    def _keep_carry_init(self, carry_init: Initializer | None) -> None:
        """Keeps ``carry_init``; one given here is warned about, as flax.nnx does: the function
        is static data, so it is part of the graphdef."""
        if carry_init:
            warnings.warn("carry_init is provided in __init__. Please, use carry_init argument "
                          "in `initialize_carry` method instead to initialize the carry. "
                          "Otherwise, two instances with same configuration but different "
                          "carry_init functions will have different graphdefs.", stacklevel=3)
        self.carry_init = carry_init

    def initialize_carry(self, input_shape: tuple[int, ...],
                         rngs: Rngs | RngStream | None = None,
                         carry_init: Initializer | None = None) -> Carry:
        """``carry_init`` (this call's, else the cell's, else zeros) of ``(*input_shape[:-1],
        hidden_features)`` in ``param_dtype``, each part drawing one key from ``rngs`` (its
        ``carry`` stream for an ``Rngs``; the cell's kept stream when not given)."""
        stream = first_from(rngs, self.rngs, name="rngs",
                            fix="pass rngs=nnx.Rngs(carry=...) (or a stream) to "
                                "initialize_carry: RNGs must be provided to initialize the "
                                "cell carry")
        if isinstance(stream, Rngs):
            stream = stream.carry
        init = carry_init or self.carry_init or initializers.zeros_init()
        shape = tuple(input_shape[:-1]) + (self.hidden_features,)
        parts = tuple(init(stream(), shape, self.param_dtype) for _ in range(self._carry_parts))
        return parts if self._carry_parts > 1 else parts[0]

    @property
    def num_feature_axes(self) -> int:
        return 1


class LSTMCell(_VectorCell):
    r"""Long short-term memory cell; the carry is ``(c, h)``.

    .. math::
        i = \sigma(W_{ii} x + W_{hi} h + b_{hi}), \quad
        f = \sigma(W_{if} x + W_{hf} h + b_{hf}), \quad
        g = \tanh(W_{ig} x + W_{hg} h + b_{hg}), \quad
        o = \sigma(W_{io} x + W_{ho} h + b_{ho}) \\
        c' = f c + i g, \quad h' = o \tanh(c')

    Declares eight ``Linear``s: ``ii``, ``if_``, ``ig``, ``io`` (input, no bias) then
    ``hi``... ``ho`` (hidden, with bias); calls ``functional.recurrent.lstm_step``.
    """

    _carry_parts = 2

    def __init__(self, in_features: int, hidden_features: int, *,
                 gate_fn: Callable[..., Any] = sigmoid, activation_fn: Callable[..., Any] = tanh,
                 kernel_init: Initializer = default_kernel_init,
                 recurrent_kernel_init: Initializer = modified_orthogonal,
                 bias_init: Initializer = initializers.zeros_init(), dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, carry_init: Initializer | None = None,
                 promote_dtype: Callable[..., Any] = default_promote_dtype,
                 keep_rngs: bool = False, rngs: Rngs,
                 kernel_metadata: Metadata = NO_METADATA,
                 recurrent_kernel_metadata: Metadata = NO_METADATA,
                 bias_metadata: Metadata = NO_METADATA):
        self._options(in_features, hidden_features, dtype, param_dtype, promote_dtype,
                      keep_rngs, rngs)
        self.gate_fn, self.activation_fn = gate_fn, activation_fn
        options = dict(dtype=dtype, param_dtype=param_dtype, promote_dtype=promote_dtype,
                       rngs=rngs)
        for name in ("ii", "if_", "ig", "io"):
            setattr(self, name, Linear(in_features, hidden_features, use_bias=False,
                                       kernel_init=kernel_init,
                                       kernel_metadata=kernel_metadata, **options))
        for name in ("hi", "hf", "hg", "ho"):
            setattr(self, name, Linear(hidden_features, hidden_features, use_bias=True,
                                       kernel_init=recurrent_kernel_init, bias_init=bias_init,
                                       kernel_metadata=recurrent_kernel_metadata,
                                       bias_metadata=bias_metadata, **options))
        self._keep_carry_init(carry_init)

    def __call__(self, carry: tuple[Array, Array], inputs: Array
                 ) -> tuple[tuple[Array, Array], Array]:
        c, h = carry
        i, f, g, o = (self.ii(inputs) + self.hi(h), self.if_(inputs) + self.hf(h),
                      self.ig(inputs) + self.hg(h), self.io(inputs) + self.ho(h))
        new_c, new_h = F.lstm_step(c, i, f, g, o, gate_fn=self.gate_fn,
                                   activation_fn=self.activation_fn)
        return (new_c, new_h), new_h


class OptimizedLSTMCell(_VectorCell):
    """``LSTMCell``'s step with the four input maps fused into one ``Linear`` (``dense_i``,
    ``4 * hidden_features`` outputs, no bias) and the four hidden maps into another
    (``dense_h``, with bias), gates in the order ``i, f, g, o``; calls
    ``functional.recurrent.lstm_step``.  The carry is ``(c, h)``."""

    _carry_parts = 2

    def __init__(self, in_features: int, hidden_features: int, *,
                 gate_fn: Callable[..., Any] = sigmoid, activation_fn: Callable[..., Any] = tanh,
                 kernel_init: Initializer = default_kernel_init,
                 recurrent_kernel_init: Initializer = initializers.orthogonal(),
                 bias_init: Initializer = initializers.zeros_init(), dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, carry_init: Initializer | None = None,
                 promote_dtype: Callable[..., Any] = default_promote_dtype,
                 keep_rngs: bool = False, rngs: Rngs,
                 kernel_metadata: Metadata = NO_METADATA,
                 recurrent_kernel_metadata: Metadata = NO_METADATA,
                 bias_metadata: Metadata = NO_METADATA):
        self._options(in_features, hidden_features, dtype, param_dtype, promote_dtype,
                      keep_rngs, rngs)
        self.gate_fn, self.activation_fn = gate_fn, activation_fn
        options = dict(dtype=dtype, param_dtype=param_dtype, promote_dtype=promote_dtype,
                       rngs=rngs)
        self.dense_i = Linear(in_features, 4 * hidden_features, use_bias=False,
                              kernel_init=kernel_init, kernel_metadata=kernel_metadata, **options)
        self.dense_h = Linear(hidden_features, 4 * hidden_features, use_bias=True,
                              kernel_init=recurrent_kernel_init, bias_init=bias_init,
                              kernel_metadata=recurrent_kernel_metadata,
                              bias_metadata=bias_metadata, **options)
        self._keep_carry_init(carry_init)

    def __call__(self, carry: tuple[Array, Array], inputs: Array
                 ) -> tuple[tuple[Array, Array], Array]:
        c, h = carry
        i, f, g, o = jnp.split(self.dense_i(inputs) + self.dense_h(h), 4, axis=-1)
        new_c, new_h = F.lstm_step(c, i, f, g, o, gate_fn=self.gate_fn,
                                   activation_fn=self.activation_fn)
        return (new_c, new_h), new_h


class GRUCell(_VectorCell):
    r"""Gated recurrent unit; the carry is ``h``.

    .. math::
        r = \sigma(W_{ir} x + b_{ir} + W_{hr} h), \quad
        z = \sigma(W_{iz} x + b_{iz} + W_{hz} h) \\
        n = \tanh(W_{in} x + b_{in} + r (W_{hn} h)), \quad
        h' = (1 - z) n + z h

    Declares ``dense_i`` (``3 * hidden_features`` outputs, with bias) and ``dense_h``
    (no bias), split as ``r, z, n``; calls ``functional.recurrent.gru_step``.
    """

    def __init__(self, in_features: int, hidden_features: int, *,
                 gate_fn: Callable[..., Any] = sigmoid, activation_fn: Callable[..., Any] = tanh,
                 kernel_init: Initializer = default_kernel_init,
                 recurrent_kernel_init: Initializer = initializers.orthogonal(),
                 bias_init: Initializer = initializers.zeros_init(), dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, carry_init: Initializer | None = None,
                 promote_dtype: Callable[..., Any] = default_promote_dtype,
                 keep_rngs: bool = False, rngs: Rngs,
                 kernel_metadata: Metadata = NO_METADATA,
                 recurrent_kernel_metadata: Metadata = NO_METADATA,
                 bias_metadata: Metadata = NO_METADATA):
        self._options(in_features, hidden_features, dtype, param_dtype, promote_dtype,
                      keep_rngs, rngs)
        self.gate_fn, self.activation_fn = gate_fn, activation_fn
        options = dict(dtype=dtype, param_dtype=param_dtype, promote_dtype=promote_dtype,
                       rngs=rngs)
        self.dense_i = Linear(in_features, 3 * hidden_features, use_bias=True,
                              kernel_init=kernel_init, bias_init=bias_init,
                              kernel_metadata=kernel_metadata, bias_metadata=bias_metadata,
                              **options)
        self.dense_h = Linear(hidden_features, 3 * hidden_features, use_bias=False,
                              kernel_init=recurrent_kernel_init,
                              kernel_metadata=recurrent_kernel_metadata, **options)
        self._keep_carry_init(carry_init)

    def __call__(self, carry: Array, inputs: Array) -> tuple[Array, Array]:
        x_r, x_z, x_n = jnp.split(self.dense_i(inputs), 3, axis=-1)
        h_r, h_z, h_n = jnp.split(self.dense_h(carry), 3, axis=-1)
        new_h = F.gru_step(carry, x_r + h_r, x_z + h_z, x_n, h_n, gate_fn=self.gate_fn,
                           activation_fn=self.activation_fn)
        return new_h, new_h


class SimpleCell(_VectorCell):
    r"""Elman cell, :math:`h' = \mathrm{act}(W_i x + b_i + W_h h)` (plus ``h`` inside the
    activation when ``residual``); the carry is ``h``.

    Declares ``dense_h`` (no bias) then ``dense_i`` (with bias), flax.nnx's draw order;
    calls ``functional.recurrent.simple_step``.
    """

    def __init__(self, in_features: int, hidden_features: int, *, dtype: Dtype = jnp.float32,
                 param_dtype: Dtype = jnp.float32, carry_init: Initializer | None = None,
                 residual: bool = False, activation_fn: Callable[..., Any] = tanh,
                 kernel_init: Initializer = initializers.lecun_normal(),
                 recurrent_kernel_init: Initializer = initializers.orthogonal(),
                 bias_init: Initializer = initializers.zeros_init(),
                 promote_dtype: Callable[..., Any] = default_promote_dtype,
                 keep_rngs: bool = False, rngs: Rngs,
                 kernel_metadata: Metadata = NO_METADATA,
                 recurrent_kernel_metadata: Metadata = NO_METADATA,
                 bias_metadata: Metadata = NO_METADATA):
        self._options(in_features, hidden_features, dtype, param_dtype, promote_dtype,
                      keep_rngs, rngs)
        self.residual, self.activation_fn = residual, activation_fn
        options = dict(dtype=dtype, param_dtype=param_dtype, promote_dtype=promote_dtype,
                       rngs=rngs)
        self.dense_h = Linear(hidden_features, hidden_features, use_bias=False,
                              kernel_init=recurrent_kernel_init,
                              kernel_metadata=recurrent_kernel_metadata, **options)
        self.dense_i = Linear(in_features, hidden_features, use_bias=True,
                              kernel_init=kernel_init, bias_init=bias_init,
                              kernel_metadata=kernel_metadata, bias_metadata=bias_metadata,
                              **options)
        self._keep_carry_init(carry_init)

    def __call__(self, carry: Array, inputs: Array) -> tuple[Array, Array]:
        new_h = F.simple_step(carry, self.dense_i(inputs), self.dense_h(carry),
                              residual=self.residual, activation_fn=self.activation_fn)
        return new_h, new_h
