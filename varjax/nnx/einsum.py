"""``nnx.Einsum``: a declaration over ``varjax.functional.contraction.einsum``.

The kernel (``kernel_shape``) and, when ``bias_shape`` is given, the bias are ``Param``s
drawn from ``rngs.params()`` in NNX's order (kernel, then bias), so the same seed gives
flax.nnx's values; the contraction and the bias broadcast are the shared function Linen's
``Einsum`` calls too.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from varjax.functional.contraction import einsum
from varjax.ir import errors
from varjax.ir.typing import Dtype, Initializer, Metadata, PrecisionLike, Shape, ShardingLike
from varjax.nnx.call_options import first_from, no_out_sharding
from varjax.nnx.linear import NO_METADATA, default_bias_init, default_kernel_init, functional_promote
from varjax.nnx.linear import promote_dtype as default_promote_dtype
from varjax.nnx.module import Module
from varjax.nnx.pytree import data
from varjax.nnx.variablelib import Param
from varjax.trace.rngs import Rngs

__all__ = ["Einsum"]



def _checked(einsum_str: str) -> str:
    """The equation without spaces; one that is not ``'input,kernel->output'`` is a
    ``ConfigError`` (a ``ValueError``, as NNX raises) saying what is missing."""
    einsum_str = einsum_str.replace(" ", "")
    if "->" not in einsum_str:
        problem = "must be explicit and include '->'"
    elif einsum_str.count(",") != 1:
        problem = (f"must have exactly two operands (the input and the kernel), so one ',', "
                   f"not {einsum_str.count(',')}")
    else:
        return einsum_str
    raise errors.ConfigError(f"Einsum's equation {einsum_str!r} {problem}.",
                             path=("einsum_str",), **errors.where(),
                             fix="write it as 'input_axes,kernel_axes->output_axes', "
                                 "e.g. 'abc,cde->abde'")


class Einsum(Module):
    """``y = einsum(einsum_str, x, kernel) + bias``: declares ``kernel`` (``kernel_shape``)
    and ``bias`` (``bias_shape``, or none), calls ``einsum``.  The bias is broadcast along
    the output axes that do not come from the kernel; an equation given at the call
    replaces the layer's."""

    def __init__(self, einsum_str: str | None, kernel_shape: Shape, bias_shape: Shape | None = None,
                 *, dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
                 precision: PrecisionLike = None,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init,
                 promote_dtype: Callable[..., Any] = default_promote_dtype,
                 einsum_op: Callable[..., jax.Array] = jnp.einsum,
                 preferred_element_type: Dtype | None = None, rngs: Rngs,
                 kernel_metadata: Metadata = NO_METADATA,
                 bias_metadata: Metadata = NO_METADATA):
        # None leaves the equation to each call (flax.nnx documents this but fails on it).
        einsum_str = _checked(einsum_str) if einsum_str is not None else None
        self.kernel = Param(kernel_init(rngs.params(), kernel_shape, param_dtype),
                            **kernel_metadata)
        self.bias = Param(bias_init(rngs.params(), bias_shape, param_dtype), **bias_metadata) \
            if bias_shape is not None else data(None)
        self.einsum_str, self.kernel_shape, self.bias_shape = einsum_str, kernel_shape, bias_shape
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.promote_dtype, self.einsum_op = promote_dtype, einsum_op
        self.preferred_element_type = preferred_element_type

    def __call__(self, inputs: jax.Array, einsum_str: str | None = None,
                 out_sharding: ShardingLike = None) -> jax.Array:
        """``inputs`` contracted with the kernel by ``einsum_str`` (the call's, else the
        layer's)."""
        no_out_sharding("Einsum", out_sharding)
        einsum_str = _checked(first_from(einsum_str, self.einsum_str, name="einsum_str",
                                         fix="give Einsum an einsum_str"))
        bias = self.bias[...] if self.bias is not None else None
        return einsum(einsum_str, inputs, self.kernel[...], bias, dtype=self.dtype,
                      precision=self.precision,
                      preferred_element_type=self.preferred_element_type,
                      promote_dtype=functional_promote(self.promote_dtype),
                      einsum_op=self.einsum_op)
