"""A kernel contracted with the input by a two-operand einsum equation, plus a bias.

The equation is ``'input_axes,kernel_axes->output_axes'`` (``'...'`` allowed, as in
``jnp.einsum``).  The bias has one entry per output axis that comes from the kernel and is
broadcast over the others; ``einsum_bias_shape`` gives its shape, so a frontend can declare
it before calling ``einsum``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from varjax.functional import dtypes
from varjax.functional.linear import add_bias

__all__ = ["einsum", "einsum_bias_shape"]


def einsum_bias_shape(equation: str, lhs_ndim: int, kernel_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The bias shape: the output axes that come from the kernel, in output order."""
    return _bias_shapes(equation, lhs_ndim, kernel_shape)[0]


def einsum(equation: str, x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
           dtype: Any = None, precision: Any = None, preferred_element_type: Any = None,
           promote_dtype: Callable[..., list[Any]] = dtypes.promote_dtype,
           einsum_op: Callable[..., jax.Array] = jnp.einsum) -> jax.Array:
    """``einsum_op(equation, x, kernel) + bias``, computed in ``dtype`` (or the promotion).

    ``einsum_op`` (``jnp.einsum``'s signature) is an argument so a quantized einsum can
    replace it; ``preferred_element_type`` reaches it only when given, so one written
    without that keyword still works, as in NNX.
    """
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=dtype)
    options = {} if preferred_element_type is None else \
        {"preferred_element_type": preferred_element_type}
    y = einsum_op(equation, x, kernel, precision=precision, **options)
    if bias is None:
        return y
    _, broadcast_shape = _bias_shapes(equation, x.ndim, tuple(kernel.shape))
    return add_bias(y, jnp.reshape(bias, broadcast_shape))


def _bias_shapes(equation: str, lhs_ndim: int, kernel_shape: tuple[int, ...]
                 ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The bias shape and the shape it is reshaped to for the sum (those sizes, 1 on every
    other output axis)."""
    operands, result = equation.split("->")
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
