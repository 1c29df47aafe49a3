"""Recurrent cells, as in Linen: one time step ``cell(carry, x) -> (new_carry, y)``.

``initialize_carry`` builds the first carry from one step's input shape and
``num_feature_axes`` says how many trailing input axes are features (``RNN`` finds
the time axis with it).  Parameter names (``ii``, ``hf``, ...), shapes and outputs
match ``flax.linen``:

* ``LSTMCell``, ``OptimizedLSTMCell`` (the same parameters, one matmul per
  input), ``GRUCell``, ``MGUCell``, ``SimpleCell``: vector carries of
  ``features`` entries, ``Dense`` submodules per gate;
* ``ConvLSTMCell``: an LSTM whose gates are convolutions (``Conv`` submodules
  ``ih`` and ``hh``); its carry keeps the input's spatial axes.

``RNN`` and ``Bidirectional`` are in ``varjax.nn.recurrent``, which re-exports
every cell here.

A cell computes its gates' pre-activations with its submodules and hands them to
``varjax.functional.recurrent`` (``lstm_step``, ``gru_step``, ``mgu_step``, ``simple_step``,
``fused_dense``) for the step itself.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from varjax.functional import recurrent as F
from varjax.nn import initializers
from varjax.nn.activation import sigmoid, tanh
from varjax.nn.linear import Conv, Dense, default_kernel_init
from varjax.nn.module import Module, compact, nowrap
from varjax.nn.typing import Carry, Dtype, Initializer, PrecisionLike

__all__ = ["RNNCellBase", "LSTMCell", "OptimizedLSTMCell", "GRUCell", "MGUCell", "SimpleCell",
           "ConvLSTMCell", "DenseParams"]

Array = jax.Array


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
    """Size of the hidden state."""
    gate_fn: Callable[..., Any] = sigmoid
    """The activation of the gates."""
    activation_fn: Callable[..., Any] = tanh
    """The activation applied to the candidate state."""
    kernel_init: initializers.Initializer = default_kernel_init
    """Initializer of the kernel."""
    recurrent_kernel_init: initializers.Initializer = initializers.orthogonal()
    """Initializer of the hidden-to-hidden kernels."""
    bias_init: initializers.Initializer = initializers.zeros_init()
    """Initializer of the gates' biases."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    carry_init: initializers.Initializer = initializers.zeros_init()
    """Initializer of the carry made by ``initialize_carry``."""


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
        i, f, g, o = (dense_i(name=f"i{gate}")(inputs) + dense_h(name=f"h{gate}")(h) for gate in "ifgo")
        new_c, new_h = F.lstm_step(c, i, f, g, o, gate_fn=self.gate_fn, activation_fn=self.activation_fn)
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
        r = dense_i(name="ir")(inputs) + dense_h(name="hr")(h)
        z = dense_i(name="iz")(inputs) + dense_h(name="hz")(h)
        x_n = dense_i(name="in")(inputs)
        h_n = dense_h(name="hn", use_bias=True)(h)
        new_h = F.gru_step(h, r, z, x_n, h_n, gate_fn=self.gate_fn, activation_fn=self.activation_fn)
        return new_h, new_h


class SimpleCell(_VectorCell):
    r"""Elman cell, :math:`h' = \mathrm{act}(W_i x + b_i + W_h h)`; the carry is ``h``.

    ``residual=True`` adds ``h`` before the activation (arXiv:1801.06105).
    """

    features: int
    """Size of the hidden state."""
    activation_fn: Callable[..., Any] = tanh
    """The activation applied to the candidate state."""
    kernel_init: initializers.Initializer = default_kernel_init
    """Initializer of the kernel."""
    recurrent_kernel_init: initializers.Initializer = initializers.orthogonal()
    """Initializer of the hidden-to-hidden kernels."""
    bias_init: initializers.Initializer = initializers.zeros_init()
    """Initializer of the bias."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    carry_init: initializers.Initializer = initializers.zeros_init()
    """Initializer of the carry made by ``initialize_carry``."""
    residual: bool = False
    """Whether to add the previous hidden state to the new one (a residual connection)."""

    @compact
    def __call__(self, carry: Array, inputs: Array) -> tuple[Array, Array]:
        x_part = Dense(carry.shape[-1], use_bias=True, kernel_init=self.kernel_init, bias_init=self.bias_init,
                       dtype=self.dtype, param_dtype=self.param_dtype, name="i")(inputs)
        h_part = Dense(carry.shape[-1], use_bias=False, kernel_init=self.recurrent_kernel_init,
                       dtype=self.dtype, param_dtype=self.param_dtype, name="h")(carry)
        new_carry = F.simple_step(carry, x_part, h_part, residual=self.residual,
                                  activation_fn=self.activation_fn)
        return new_carry, new_carry


class DenseParams(Module):
    """The ``kernel`` (and ``bias``) a ``Dense`` of ``features`` would create, returned unapplied,
    so a cell can concatenate several of them into one matmul."""

    features: int
    use_bias: bool = True
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = initializers.zeros_init()

    @compact
    def __call__(self, inputs: Array) -> tuple[Array, Array | None]:
        kernel = self.param("kernel", self.kernel_init, (inputs.shape[-1], self.features), self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias
                else None)
        return kernel, bias


class OptimizedLSTMCell(_GatedCell):
    """``LSTMCell`` with its four input and four hidden matmuls fused into one each.

    Same parameters (``ii``... ``ho``, made by ``DenseParams``), same outputs up to
    float rounding; usually faster for hidden sizes up to about 2048.
    """

    _carry_parts = 2

    @compact
    def __call__(self, carry: tuple[Array, Array], inputs: Array) -> tuple[tuple[Array, Array], Array]:
        c, h = carry
        gates = "ifgo"
        dense_params = functools.partial(DenseParams, features=h.shape[-1], param_dtype=self.param_dtype,
                                         bias_init=self.bias_init)
        from_i, from_h = {}, {}
        for gate in gates:
            from_i[gate] = dense_params(use_bias=False, kernel_init=self.kernel_init, name=f"i{gate}")(inputs)
            from_h[gate] = dense_params(use_bias=True, kernel_init=self.recurrent_kernel_init,
                                        name=f"h{gate}")(h)
        ys_h = F.fused_dense(h, [from_h[g] for g in gates], dtype=self.dtype)
        ys_i = F.fused_dense(inputs, [from_i[g] for g in gates], dtype=self.dtype)
        i, f, g, o = (y_h + y_i for y_h, y_i in zip(ys_h, ys_i))
        new_c, new_h = F.lstm_step(c, i, f, g, o, gate_fn=self.gate_fn, activation_fn=self.activation_fn)
        return (new_c, new_h), new_h


class MGUCell(_VectorCell):
    r"""Minimal gated unit (arXiv:1603.09420); the carry is ``h``.

    .. math::
        f = \sigma(W_{if} x + b_{if} + W_{hf} h), \quad
        n = \tanh(W_{in} x + b_{in} + f (W_{hn} h + b_{hn})), \quad
        h' = (1 - f) n + f h

    Without ``reset_gate`` the ``f (\cdot)`` factor and ``b_{hn}`` are dropped.  The
    forget gate's bias starts at one (``forget_bias_init``).
    """

    features: int
    """Size of the hidden state."""
    gate_fn: Callable[..., Any] = sigmoid
    """The activation of the gates."""
    activation_fn: Callable[..., Any] = tanh
    """The activation applied to the candidate state."""
    kernel_init: Initializer = default_kernel_init
    """Initializer of the kernel."""
    recurrent_kernel_init: Initializer = initializers.orthogonal()
    """Initializer of the hidden-to-hidden kernels."""
    forget_bias_init: Initializer = initializers.ones_init()
    """Initializer of the forget gate's bias."""
    activation_bias_init: Initializer = initializers.zeros_init()
    """Initializer of the candidate activation's bias."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    carry_init: Initializer = initializers.zeros_init()
    """Initializer of the carry made by ``initialize_carry``."""
    reset_gate: bool = True
    """Whether the cell has a reset gate (without one: the minimal gated unit's simpler form)."""

    @compact
    def __call__(self, carry: Array, inputs: Array) -> tuple[Array, Array]:
        h = carry
        dense_h = functools.partial(Dense, features=h.shape[-1], use_bias=False, dtype=self.dtype,
                                    param_dtype=self.param_dtype, kernel_init=self.recurrent_kernel_init,
                                    bias_init=self.activation_bias_init)
        dense_i = functools.partial(Dense, features=h.shape[-1], use_bias=True, dtype=self.dtype,
                                    param_dtype=self.param_dtype, kernel_init=self.kernel_init)
        f = dense_i(name="if", bias_init=self.forget_bias_init)(inputs) + dense_h(name="hf")(h)
        h_n = dense_h(name="hn", use_bias=self.reset_gate)(h)
        x_n = dense_i(name="in", bias_init=self.activation_bias_init)(inputs)
        new_h = F.mgu_step(h, f, x_n, h_n, reset_gate=self.reset_gate, gate_fn=self.gate_fn,
                           activation_fn=self.activation_fn)
        return new_h, new_h


class ConvLSTMCell(RNNCellBase):
    r"""An LSTM whose gates are convolutions (Shi et al., 2015); the carry is ``(c, h)``.

    One ``Conv`` of ``4 * features`` filters on the input (``ih``) and one on
    ``h`` (``hh``) give the gates, split as ``i, g, f, o``; the forget gate gets
    ``+1`` before its sigmoid, so it starts near open.  Inputs are
    ``[batch..., spatial..., features]``.
    """

    features: int
    """Number of output channels of the hidden state."""
    kernel_size: Sequence[int]
    """The convolutions' kernel size in each spatial dimension."""
    strides: Sequence[int] | None = None
    """The stride of each spatial dimension (``None``: 1)."""
    padding: str | Sequence[tuple[int, int]] = "SAME"
    """``'SAME'``, ``'VALID'``, or ``(low, high)`` pairs per spatial dimension."""
    use_bias: bool = True
    """Whether to add a learned bias."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    carry_init: Initializer = initializers.zeros_init()
    """Initializer of the carry made by ``initialize_carry``."""

    @compact
    def __call__(self, carry: tuple[Array, Array], inputs: Array) -> tuple[tuple[Array, Array], Array]:
        c, h = carry
        conv = functools.partial(Conv, features=4 * self.features, kernel_size=self.kernel_size,
                                 strides=self.strides, padding=self.padding, use_bias=self.use_bias,
                                 dtype=self.dtype, param_dtype=self.param_dtype)
        gates = conv(name="ih")(inputs) + conv(name="hh")(h)
        i, g, f, o = jnp.split(gates, 4, axis=-1)
        # The forget gate's +1 starts it near open.
        new_c, new_h = F.lstm_step(c, i, f + 1, g, o, gate_fn=sigmoid, activation_fn=jnp.tanh)
        return (new_c, new_h), new_h

    @nowrap
    def initialize_carry(self, rng: Array, input_shape: tuple[int, ...]) -> tuple[Array, Array]:
        """Zeros (``carry_init``) of the input's batch and spatial shape with ``features`` channels."""
        shape = (*input_shape[:-1], self.features)
        key_c, key_h = jax.random.split(rng)
        return (self.carry_init(key_c, shape, self.param_dtype),
                self.carry_init(key_h, shape, self.param_dtype))

    @property
    def num_feature_axes(self) -> int:
        return len(self.kernel_size) + 1
