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
from varjax.ir import errors

__all__ = ["dense", "dense_general", "dense_general_axes", "leading_batch_dims", "AxisError",
           "add_bias"]

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


class AxisError(errors.ConfigError, TypeError, IndexError):
    """An axis outside the input's rank.  Also a ``TypeError`` and an ``IndexError``, the
    types flax raises (from ``lax.dot_general``, from a normalization's shape lookup); a
    ``ConfigError`` (``ValueError``) as varjax's other layer arguments, so each ``except``
    catches it."""


def leading_batch_dims(batch_dims: int | Iterable[int], *, name: str = "batch_dims"
                       ) -> tuple[int, ...]:
    """``batch_dims`` as a tuple, which must be the consecutive leading axes ``0, 1, ...``: a
    kernel per batch index is laid out first in the kernel, in the input's order.  Needs no
    rank, so a layer checks it where it is built."""
    batch_dims = _as_tuple(batch_dims)
    if batch_dims and set(batch_dims) != set(range(max(batch_dims) + 1)):
        raise errors.ConfigError(
            f"{name} {batch_dims} must be consecutive leading dimensions starting from 0.",
            path=(name,), **errors.where(), fix=f"{name} must be the axes 0, 1, ... of the input")
    return batch_dims


def _in_range(ndim: int, axes: tuple[int, ...], name: str) -> tuple[int, ...]:
    """``axes`` non-negative and sorted; each must lie in ``[-ndim, ndim)`` (``a % ndim``
    would silently contract another axis)."""
    for a in axes:
        if not -ndim <= a < ndim:
            raise AxisError(f"{name} {a} is out of range for an input of rank {ndim}.",
                            path=(name,), **errors.where(),
                            fix=f"give axes in [-{ndim}, {ndim}), or an input of higher rank")
    return tuple(sorted(a % ndim for a in axes))


def dense_general_axes(ndim: int, axis: int | Iterable[int], batch_dims: int | Iterable[int] = (),
                       *, names: tuple[str, str] = ("axis", "batch_dims")
                       ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(axis, batch_dims)`` of an input of rank ``ndim``: non-negative and sorted.

    ``batch_dims`` must be the leading axes (``leading_batch_dims``); both must lie within the
    rank (an ``AxisError`` otherwise).  ``names`` are the layer's names for the two arguments,
    given as the error's path.
    """
    batch_dims = leading_batch_dims(batch_dims, name=names[1])
    return _in_range(ndim, _as_tuple(axis), names[0]), _in_range(ndim, batch_dims, names[1])


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
