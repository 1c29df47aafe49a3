"""``Einsum``: a learned kernel contracted with the input by an einsum equation, as in Linen.

The equation has exactly two operands, the input and the kernel (``'abc,cde->abde'``,
kernel shape ``shape``).  The bias, if any, has one entry per output axis that comes from
the kernel (``(d, e)`` here) and is broadcast over the others.  ``'...'`` stands for the
same leading axes as in ``jnp.einsum``.  The arithmetic is ``varjax.functional.contraction``.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from varjax.functional import contraction as F
from varjax.ir import errors
from varjax.nn import dtypes, initializers
from varjax.nn.module import Module, compact
from varjax.nn.typing import Dtype, Initializer, PrecisionLike, Shape
from varjax.trace.context import site

__all__ = ["Einsum"]


class Einsum(Module):
    """``y = einsum(einsum_str, x, kernel) + bias``; ``einsum_str`` is a field or a call argument."""

    shape: Shape
    """The kernel's shape."""
    einsum_str: str | None = None
    """The einsum equation ``inputs,kernel->output``; may be given to the call instead."""
    use_bias: bool = True
    """Whether to add a learned bias (one entry per output axis that comes from the kernel)."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    precision: PrecisionLike = None
    """``jax.lax.Precision`` of the matmul or convolution (``None``: the default)."""
    kernel_init: Initializer = initializers.lecun_normal()
    """Initializer of the kernel."""
    bias_init: Initializer = initializers.zeros_init()
    """Initializer of the bias."""
    promote_dtype: Callable[..., list[Any]] = dtypes.promote_dtype
    """Casts the inputs and parameters to one dtype before the computation (``dtype`` given to
    it)."""
    preferred_element_type: Dtype | None = None
    """The dtype JAX accumulates in (``preferred_element_type`` of the ``lax`` call)."""

    @compact
    def __call__(self, inputs: jax.Array, einsum_str: str | None = None) -> jax.Array:
        einsum_str = dtypes.merge_param("einsum_str", self.einsum_str, einsum_str).replace(" ", "")
        if "->" not in einsum_str or einsum_str.count(",") != 1:
            raise errors.ConfigError(
                f"Einsum's equation {einsum_str!r} must name exactly two operands (the input and the "
                "kernel: one ',') and its output explicitly ('->').", **site(),
                fix="write it as 'input_axes,kernel_axes->output_axes', e.g. 'abc,cde->abde'.")
        kernel = self.param("kernel", self.kernel_init, tuple(self.shape), self.param_dtype)
        bias = None
        if self.use_bias:
            bias_shape = F.einsum_bias_shape(einsum_str, inputs.ndim, tuple(self.shape))
            bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
        return F.einsum(einsum_str, inputs, kernel, bias, dtype=self.dtype, precision=self.precision,
                        preferred_element_type=self.preferred_element_type, promote_dtype=self.promote_dtype)

