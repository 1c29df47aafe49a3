"""``nnx.Linear`` and ``nnx.LinearGeneral``: declarations over ``varjax.functional.linear``
(``dense``, ``dense_general``).

Each layer holds its kernel and bias as ``Param``s made from ``rngs.params()`` draws in
NNX's order (kernel, then bias), so the same seed gives flax.nnx's values bit for bit; the
math is the shared function Linen's ``Dense``/``DenseGeneral`` call too.
"""
from __future__ import annotations

import dataclasses
import functools
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax import lax

from varjax.functional import dtypes, initializers
from varjax.functional.linear import dense, dense_general, dense_general_axes, leading_batch_dims
from varjax.ir import errors
from varjax.ir.typing import DotGeneralT, Dtype, Initializer, Metadata, PrecisionLike, ShardingLike
from varjax.nnx.call_options import no_out_sharding
from varjax.nnx.module import Module
from varjax.nnx.pytree import data
from varjax.nnx.variablelib import Param, VariableMetadata
from varjax.trace.rngs import Rngs

__all__ = ["Linear", "LinearGeneral"]

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros
# The default of every layer's ``*_metadata`` arguments: no metadata, and immutable, as a
# default must be.
NO_METADATA: Metadata = MappingProxyType({})


def promote_dtype(args: tuple, /, *, dtype: Dtype | None = None, inexact: bool = True) -> tuple:
    """NNX's form of the shared promotion: the arrays come as one tuple."""
    return tuple(dtypes.promote_dtype(*args, dtype=dtype, inexact=inexact))


def functional_promote(promote_dtype: Callable[..., tuple]) -> Callable[..., tuple]:
    """A layer's NNX-form ``promote_dtype`` (the arrays as one tuple) in the form the shared
    math in ``varjax.functional`` calls (the arrays as arguments), keywords passed on."""
    return lambda *arrays, **options: promote_dtype(arrays, **options)


def with_preferred_element_type(fn: Callable[..., jax.Array],
                                preferred_element_type: Dtype | None) -> Callable[..., jax.Array]:
    """``fn`` given ``preferred_element_type`` when one is set, and untouched otherwise, so a
    user's ``dot_general`` written without that keyword keeps working, as in NNX."""
    if preferred_element_type is None:
        return fn
    return functools.partial(fn, preferred_element_type=preferred_element_type)


class Linear(Module):
    """``y = x @ kernel + bias`` over the last axis of ``x``: declares ``kernel``
    ``(in_features, out_features)`` and ``bias`` ``(out_features,)``, calls ``dense``."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 dtype: Dtype | None = None, param_dtype: Dtype = jax.numpy.float32,
                 precision: PrecisionLike = None,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init,
                 dot_general: DotGeneralT = lax.dot_general,
                 promote_dtype: Callable[..., Any] = promote_dtype,
                 preferred_element_type: Dtype | None = None, rngs: Rngs,
                 kernel_metadata: Metadata = NO_METADATA,
                 bias_metadata: Metadata = NO_METADATA):
        self.kernel = Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype),
                            **kernel_metadata)
        self.bias = Param(bias_init(rngs.params(), (out_features,), param_dtype),
                          **bias_metadata) if use_bias else data(None)
        self.in_features, self.out_features, self.use_bias = in_features, out_features, use_bias
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.dot_general, self.promote_dtype = dot_general, promote_dtype
        self.preferred_element_type = preferred_element_type

    def __call__(self, inputs: jax.Array, out_sharding: ShardingLike = None) -> jax.Array:
        no_out_sharding("Linear", out_sharding)
        bias = self.bias[...] if self.bias is not None else None
        return dense(inputs, self.kernel[...], bias, dtype=self.dtype, precision=self.precision,
                     dot_general=with_preferred_element_type(self.dot_general,
                                                             self.preferred_element_type),
                     promote_dtype=functional_promote(self.promote_dtype))


class BatchAxes(Mapping[int, int]):
    """``LinearGeneral.batch_axis``: an immutable, hashable mapping (flax.nnx holds a
    ``FrozenDict`` there), as static data of the graphdef must be, and one that copies and
    pickles as flax.nnx's layer does (``types.MappingProxyType`` does neither).  Linen's
    ``FrozenDict`` lives in ``varjax.nn``, which ``varjax.nnx`` may not import."""

    __slots__ = ("_axes",)

    def __init__(self, axes: Mapping[int, int]):
        self._axes = dict(axes)

    def __getitem__(self, axis: int) -> int:
        return self._axes[axis]

    def __iter__(self) -> Iterator[int]:
        return iter(self._axes)

    def __len__(self) -> int:
        return len(self._axes)

    def __hash__(self) -> int:
        return hash(tuple(self._axes.items()))

    def __repr__(self) -> str:
        return f"BatchAxes({self._axes!r})"


def _as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Sequence) else (x,)


def _reshaped(value: jax.Array | VariableMetadata, shape: tuple[int, ...]
              ) -> jax.Array | VariableMetadata:
    """An initializer's result reshaped, its metadata (``nnx.with_partitioning``) kept."""
    if isinstance(value, VariableMetadata):
        return dataclasses.replace(value, raw_value=jax.numpy.reshape(value.raw_value, shape))
    return jax.numpy.reshape(value, shape)


class LinearGeneral(Module):
    """A linear map over several axes of ``x`` (``axis``) to several output features, with an
    optional kernel per index of leading batch axes (``batch_axis``: axis to size).

    Declares ``kernel`` ``(*batch sizes, *in_features, *out_features)`` and ``bias``
    ``(*batch sizes, *out_features)``; the initializers see them flattened to 2-D
    ``(fan_in, fan_out)`` and 1-D, as NNX draws them, so fan-based initializers scale as for
    a ``Linear``.  Calls ``dense_general``.
    """

    def __init__(self, in_features: int | Sequence[int], out_features: int | Sequence[int], *,
                 axis: int | Sequence[int] = -1,
                 batch_axis: Mapping[int, int] = MappingProxyType({}),
                 use_bias: bool = True, dtype: Dtype | None = None,
                 param_dtype: Dtype = jax.numpy.float32,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init, precision: PrecisionLike = None,
                 promote_dtype: Callable[..., Any] = promote_dtype,
                 dot_general: DotGeneralT | None = None,
                 dot_general_cls: Callable[[], DotGeneralT] | None = None,
                 preferred_element_type: Dtype | None = None, rngs: Rngs,
                 kernel_metadata: Metadata = NO_METADATA,
                 bias_metadata: Metadata = NO_METADATA):
        self.in_features, self.out_features = _as_tuple(in_features), _as_tuple(out_features)
        self.axis, self.batch_axis = _as_tuple(axis), BatchAxes(batch_axis)
        if len(self.in_features) != len(self.axis):
            raise errors.ConfigError(
                f"LinearGeneral's in_features {self.in_features} and axis {self.axis} must "
                "have the same length.", path=("in_features",), **errors.where(),
                fix="give one input feature size per contracted axis")
        # Checked here, where the user's line is the cause; the axes' range needs the input.
        leading_batch_dims(tuple(self.batch_axis), name="batch_axis")
        batch_shape = tuple(self.batch_axis.values())
        n_batch, n_in = len(batch_shape), len(self.in_features)
        kernel_shape = (*batch_shape, *self.in_features, *self.out_features)
        fan_in = int(np.prod(kernel_shape[:n_batch]) * np.prod(kernel_shape[n_batch:n_batch + n_in]))
        flat = (fan_in, int(np.prod(self.out_features)))
        self.kernel = Param(_reshaped(kernel_init(rngs.params(), flat, param_dtype), kernel_shape),
                            **kernel_metadata)
        if use_bias:
            bias_shape = (*batch_shape, *self.out_features)
            bias = bias_init(rngs.params(), (int(np.prod(bias_shape)),), param_dtype)
            self.bias = Param(_reshaped(bias, bias_shape), **bias_metadata)
        else:
            self.bias = data(None)
        self.use_bias, self.dtype, self.param_dtype = use_bias, dtype, param_dtype
        self.precision, self.promote_dtype = precision, promote_dtype
        self.dot_general, self.dot_general_cls = dot_general, dot_general_cls
        self.preferred_element_type = preferred_element_type

    def __call__(self, inputs: jax.Array, out_sharding: ShardingLike = None) -> jax.Array:
        """``inputs`` contracted over ``axis``: ``(*batch axes, *other axes, *out_features)``."""
        no_out_sharding("LinearGeneral", out_sharding)
        axis, batch_dims = dense_general_axes(inputs.ndim, self.axis, tuple(self.batch_axis),
                                              names=("axis", "batch_axis"))
        if self.dot_general_cls is not None:
            dot_general = self.dot_general_cls()
        else:
            dot_general = self.dot_general or lax.dot_general
        bias = self.bias[...] if self.bias is not None else None
        return dense_general(inputs, self.kernel[...], bias, axis=axis, batch_dims=batch_dims,
                             dtype=self.dtype, precision=self.precision,
                             dot_general=with_preferred_element_type(
                                 dot_general, self.preferred_element_type),
                             promote_dtype=functional_promote(self.promote_dtype))

