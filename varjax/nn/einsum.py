"""``Einsum``: a learned kernel contracted with the input by an einsum equation, as in Linen.

The equation has exactly two operands, the input and the kernel (``'abc,cde->abde'``,
kernel shape ``shape``).  The bias, if any, has one entry per output axis that comes from
the kernel (``(d, e)`` here) and is broadcast over the others.  ``'...'`` stands for the
same leading axes as in ``jnp.einsum``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from varjax.ir import errors
from varjax.nn import dtypes, initializers
from varjax.nn.module import Module, compact
from varjax.nn.typing import Dtype, Initializer, PrecisionLike, Shape
from varjax.trace.context import site

__all__ = ["Einsum"]


class Einsum(Module):
    """``y = einsum(einsum_str, x, kernel) + bias``; ``einsum_str`` is a field or a call argument."""

    shape: Shape
    einsum_str: str | None = None
    use_bias: bool = True
    dtype: Dtype | None = None
    param_dtype: Dtype = jnp.float32
    precision: PrecisionLike = None
    kernel_init: Initializer = initializers.lecun_normal()
    bias_init: Initializer = initializers.zeros_init()
    promote_dtype: Callable[..., list[Any]] = dtypes.promote_dtype
    preferred_element_type: Dtype | None = None

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
            bias_shape, broadcast_shape = _bias_shapes(einsum_str, inputs.ndim, tuple(self.shape))
            bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = jnp.einsum(einsum_str, inputs, kernel, precision=self.precision,
                       preferred_element_type=self.preferred_element_type)
        if bias is None:
            return y
        return y + jnp.reshape(bias, broadcast_shape)


def _bias_shapes(einsum_str: str, lhs_ndim: int, kernel_shape: tuple[int, ...]
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The bias shape (the output axes that come from the kernel, in output order) and the
    shape it is reshaped to for the sum (those sizes, 1 on every other output axis)."""
    operands, result = einsum_str.split("->")
    lhs, rhs = operands.split(",")
    n_ellipsis = max(_ellipsis_rank(spec, ndim) for spec, ndim in ((lhs, lhs_ndim), (rhs, len(kernel_shape))))
    rhs_axes = {label: i for i, label in enumerate(_labels(rhs, len(kernel_shape), n_ellipsis))}
    out = _labels(result, None, n_ellipsis)
    bias = tuple(kernel_shape[rhs_axes[label]] for label in out if label in rhs_axes)
    broadcast = tuple(kernel_shape[rhs_axes[label]] if label in rhs_axes else 1 for label in out)
    return bias, broadcast


def _ellipsis_rank(spec: str, ndim: int) -> int:
    """How many axes ``'...'`` covers in an operand of rank ``ndim`` (0 without one)."""
    return ndim - (len(spec) - 3) if "..." in spec else 0


def _labels(spec: str, ndim: int | None, n_ellipsis: int) -> Sequence[str]:
    """One label per axis; the axes under ``'...'`` get labels shared by every operand, right
    aligned, as broadcasting aligns them (``ndim=None``: the output, which takes them all)."""
    if "..." not in spec:
        return list(spec)
    before, after = spec.split("...")
    covered = n_ellipsis if ndim is None else ndim - len(before) - len(after)
    return [*before, *(f"...{i}" for i in range(n_ellipsis - covered, n_ellipsis)), *after]
