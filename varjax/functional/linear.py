"""Dense maps: ``dense`` (the last axis) and ``dense_general`` (several axes, batched kernels).

The kernel and bias come in as arrays; a frontend declares them (Linen with
``self.param``, NNX as ``nnx.Param`` attributes) and calls these functions, so both compute
the same operations in the same order.  ``promote_dtype`` and ``dot_general`` are
arguments because Linen's layers take them as fields (quantization libraries hook in
there).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
from jax import lax

from varjax.functional import dtypes

__all__ = ["dense", "dense_general", "dense_general_axes", "add_bias"]

PromoteDtype = Callable[..., list[Any]]


def add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    """``y + bias`` with ``bias`` aligned to ``y``'s trailing axes (explicit rank, no rank promotion)."""
    if bias is None:
        return y
    if y.dtype != bias.dtype:
        # A preferred_element_type can widen the product past the bias's dtype: promote as
        # Flax's ``y + bias`` does (standard promotion, explicitly).
        y, bias = dtypes.promote_dtype(y, bias, inexact=False)
    # lax, not jnp: the dtypes agree now, and jnp's checks cost trace time per layer.
    return lax.add(y, lax.broadcast_in_dim(bias, y.shape, tuple(range(y.ndim - bias.ndim, y.ndim))))


def dense(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *, dtype: Any = None,
          precision: Any = None, dot_general: Callable[..., jax.Array] = lax.dot_general,
          promote_dtype: PromoteDtype = dtypes.promote_dtype) -> jax.Array:
    """``x @ kernel + bias`` over the last axis of ``x``; ``kernel`` is ``(in, out)``, ``bias`` ``(out,)``.

    Computed in ``dtype``, or in the standard promotion of ``x``, ``kernel`` and ``bias``.
    """
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=dtype)
    y = dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
    return add_bias(y, bias)


def _as_tuple(x: int | Iterable[int]) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Iterable) else (x,)


def dense_general_axes(ndim: int, axis: int | Iterable[int], batch_dims: int | Iterable[int] = ()
                       ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(axis, batch_dims)`` of an input of rank ``ndim``: non-negative and sorted.

    ``batch_dims`` must be consecutive leading axes: a kernel per batch index is laid out
    first in the kernel, in the input's order.
    """
    batch_dims = _as_tuple(batch_dims)
    if batch_dims and set(batch_dims) != set(range(max(batch_dims) + 1)):
        raise ValueError(f"batch_dims {batch_dims} must be consecutive leading dimensions "
                         "starting from 0.")
    return (tuple(sorted(a % ndim for a in _as_tuple(axis))),
            tuple(sorted(a % ndim for a in batch_dims)))


def dense_general(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                  axis: tuple[int, ...], batch_dims: tuple[int, ...] = (), dtype: Any = None,
                  precision: Any = None, dot_general: Callable[..., jax.Array] = lax.dot_general,
                  promote_dtype: PromoteDtype = dtypes.promote_dtype) -> jax.Array:
    """Contracts ``x``'s ``axis`` with a kernel of shape ``batch + contracted + features``.

    ``axis`` and ``batch_dims`` are as ``dense_general_axes`` returns them.  The output is
    ``(batch dims, remaining axes of x, features)``; ``bias`` (``batch + features``) varies
    only along the batch dims and the features.
    """
    n_batch, n_axis = len(batch_dims), len(axis)
    features = tuple(kernel.shape[n_batch + n_axis:])
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=dtype)
    kernel_batch = tuple(range(n_batch))
    kernel_contract = tuple(range(n_batch, n_batch + n_axis))
    out = dot_general(x, kernel, ((axis, kernel_contract), (batch_dims, kernel_batch)), precision=precision)
    if bias is None:
        return out
    kept = [a for a in range(x.ndim) if a not in axis]
    bias_shape = tuple(x.shape[a] if a in batch_dims else 1 for a in kept) + features
    return add_bias(out, jnp.reshape(bias, bias_shape))
