"""Convolutions over channels-last inputs: ``conv``, ``conv_local``, ``conv_transpose``.

Inputs are ``(*batch, *spatial, features)`` with any number of batch axes, including none:
they are folded into the one batch axis ``lax`` takes and restored afterwards.  Kernels are
``(*window, in, out)``.  The kernel (and bias) come in as arrays, so each frontend declares
its own and both run this one copy of the padding modes and the batch folding.

``padding`` is ``'SAME'``, ``'VALID'``, ``'CIRCULAR'`` (periodic: the input is wrap-padded,
then convolved ``'VALID'``), ``'REFLECT'``, ``'CAUSAL'`` (1-D only: left padding so output
``t`` sees inputs ``<= t``), an int, or one int / ``(low, high)`` pair per spatial axis.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from varjax.functional import dtypes
from varjax.functional.linear import add_bias
from varjax.ir import errors

__all__ = ["canonicalize_padding", "conv_kernel_shape", "conv", "conv_local_shapes", "conv_local",
           "conv_transpose"]

PromoteDtype = Callable[..., list[Any]]
PaddingLike = str | int | Sequence[int | tuple[int, int]]
PerAxis = None | int | Sequence[int]


def canonicalize_padding(padding: PaddingLike, rank: int) -> str | list[tuple[int, int]]:
    """Linen's padding spellings as ``lax`` takes them: a string, or ``rank`` ``(low, high)`` pairs.

    An int pads every spatial axis by that much on both sides; in a sequence an
    int pads that one axis on both sides.
    """
    if isinstance(padding, str):
        return padding
    if isinstance(padding, int):
        return [(padding, padding)] * rank
    if isinstance(padding, Sequence) and len(padding) == rank:
        pairs = [(p, p) if isinstance(p, int) else tuple(p) for p in padding]
        if all(len(p) == 2 for p in pairs):
            return pairs
    raise ValueError(f"Invalid padding {padding!r}: expected a string, an int, or a sequence of {rank} "
                     "ints or (low, high) pairs.")


def _dimension_numbers(ndim: int) -> lax.ConvDimensionNumbers:
    """Channels-last input and output (``N...C``), kernel ``...IO``."""
    io = (0, ndim - 1) + tuple(range(1, ndim - 1))
    return lax.ConvDimensionNumbers(io, (ndim - 1, ndim - 2) + tuple(range(ndim - 2)), io)


def _per_axis(x: PerAxis, rank: int) -> tuple[int, ...]:
    """Strides/dilations: ``None`` means 1, an int applies to every spatial axis."""
    if x is None:
        x = 1
    return (x,) * rank if isinstance(x, int) else tuple(x)


def _flatten_batch(x: jax.Array, rank: int) -> tuple[jax.Array, tuple[int, ...] | None]:
    """Folds all leading batch axes (possibly none) into one; returns how to undo it."""
    n_batch = x.ndim - rank - 1
    if n_batch == 1:
        return x, None
    return jnp.reshape(x, (-1,) + x.shape[n_batch:]), x.shape[:n_batch]


def _restore_batch(y: jax.Array, batch_shape: tuple[int, ...] | None) -> jax.Array:
    return y if batch_shape is None else jnp.reshape(y, batch_shape + y.shape[1:])


def _pad_input(x: jax.Array, padding: PaddingLike, kernel_size: tuple[int, ...],
               kernel_dilation: tuple[int, ...]) -> tuple[jax.Array, Any]:
    """``x`` padded for the modes ``lax`` lacks (then ``'VALID'``), and the padding ``lax`` gets."""
    rank = len(kernel_size)
    padding = canonicalize_padding(padding, rank)
    if padding in ("CIRCULAR", "REFLECT"):
        # Pad by the dilated kernel's reach so a 'VALID' convolution keeps the size 'SAME' would.
        reach = [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation)]
        pads = [(0, 0)] + [((r - 1) // 2, r // 2) for r in reach] + [(0, 0)]
        return jnp.pad(x, pads, mode="wrap" if padding == "CIRCULAR" else "reflect"), "VALID"
    if padding == "CAUSAL":
        if rank != 1:
            raise ValueError("Causal padding is only implemented for 1D convolutions.")
        return jnp.pad(x, [(0, 0), (kernel_dilation[0] * (kernel_size[0] - 1), 0), (0, 0)]), "VALID"
    return x, padding


def _masked(kernel: jax.Array, mask: jax.Array | None) -> jax.Array:
    """``kernel * mask`` (a mask zeroes connections, e.g. for autoregressive convolutions).
    A mask of another shape is a ``ConfigError`` (a ``ValueError``, Flax's type and wording)
    at the user's line, for both frontends."""
    if mask is None:
        return kernel
    if tuple(mask.shape) != tuple(kernel.shape):
        raise errors.ConfigError(
            f"Mask needs to have the same shape as weights. Shapes are: {tuple(mask.shape)}, "
            f"{tuple(kernel.shape)}", path=("mask",), **errors.where(),
            fix=f"give a mask of the kernel's shape {tuple(kernel.shape)}")
    # A float32 mask on a float16 kernel widens it, as Flax's ``kernel * mask`` does
    # (standard promotion, explicitly).
    kernel, mask = dtypes.promote_dtype(kernel, mask, inexact=False)
    return kernel * mask


def conv_kernel_shape(kernel_size: tuple[int, ...], in_features: int, features: int,
                      feature_group_count: int = 1) -> tuple[int, ...]:
    """The kernel ``conv`` takes: ``(*kernel_size, in_features // groups, features)``."""
    if in_features % feature_group_count:
        raise ValueError(f"feature_group_count={feature_group_count} does not divide the "
                         f"{in_features} input features.")
    return kernel_size + (in_features // feature_group_count, features)


def _prepared(x, kernel, bias, padding, kernel_size: tuple, kernel_dilation, mask, dtype,
              promote_dtype: "PromoteDtype"):
    """What the shared and the unshared convolution do before convolving: batch dimensions
    flattened, the input padded (``CIRCULAR``, ``REFLECT``, ``CAUSAL`` by hand), the kernel masked, and
    the operands promoted.  Returns them with the batch shape, the padding left for lax and
    the per-axis kernel dilation."""
    rank = len(kernel_size)
    x, batch_shape = _flatten_batch(x, rank)
    kernel_dilation = _per_axis(kernel_dilation, rank)
    x, padding = _pad_input(x, padding, kernel_size, kernel_dilation)
    kernel = _masked(kernel, mask)
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=dtype)
    return x, kernel, bias, batch_shape, padding, kernel_dilation


def conv(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *, strides: PerAxis = 1,
         padding: PaddingLike = "SAME", input_dilation: PerAxis = 1, kernel_dilation: PerAxis = 1,
         feature_group_count: int = 1, mask: jax.Array | None = None, dtype: Any = None,
         precision: Any = None, conv_general_dilated: Callable[..., jax.Array] = lax.conv_general_dilated,
         promote_dtype: PromoteDtype = dtypes.promote_dtype) -> jax.Array:
    """An N-d convolution (``lax.conv_general_dilated``): one kernel shared by every position."""
    kernel_size = tuple(kernel.shape[:-2])
    rank = len(kernel_size)
    x, kernel, bias, batch_shape, padding, kernel_dilation = _prepared(
        x, kernel, bias, padding, kernel_size, kernel_dilation, mask, dtype, promote_dtype)
    y = conv_general_dilated(x, kernel, _per_axis(strides, rank), padding,
                             lhs_dilation=_per_axis(input_dilation, rank), rhs_dilation=kernel_dilation,
                             dimension_numbers=_dimension_numbers(x.ndim),
                             feature_group_count=feature_group_count, precision=precision)
    return _restore_batch(add_bias(y, bias), batch_shape)


def conv_local_shapes(x: Any, kernel_size: tuple[int, ...], features: int, *,
                      strides: PerAxis = 1, padding: PaddingLike = "SAME", input_dilation: PerAxis = 1,
                      kernel_dilation: PerAxis = 1,
                      conv_general_dilated: Callable[..., jax.Array] = lax.conv_general_dilated
                      ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The kernel and bias shapes of ``conv_local`` for input ``x`` (an array or a shape struct).

    Kernel and bias carry the output's spatial shape, the one the shared convolution would
    give, as leading axes: ``out_spatial + (prod(kernel_size) * in, features)`` and
    ``out_spatial + (features,)``.  Computed abstractly, so nothing is added to a trace.
    """
    rank = len(kernel_size)
    in_features = np.shape(x)[-1]

    def shared(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        lhs, _ = _flatten_batch(lhs, rank)
        lhs, pad = _pad_input(lhs, padding, kernel_size, _per_axis(kernel_dilation, rank))
        return conv_general_dilated(lhs, rhs, _per_axis(strides, rank), pad,
                                    lhs_dilation=_per_axis(input_dilation, rank),
                                    rhs_dilation=_per_axis(kernel_dilation, rank),
                                    dimension_numbers=_dimension_numbers(rank + 2))

    x_struct = jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
    out_shape = jax.eval_shape(
        shared, x_struct, jax.ShapeDtypeStruct(kernel_size + (in_features, features), x_struct.dtype)).shape
    return out_shape[1:-1] + (math.prod(kernel_size) * in_features, features), out_shape[1:]


def conv_local(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
               kernel_size: tuple[int, ...], strides: PerAxis = 1, padding: PaddingLike = "SAME",
               input_dilation: PerAxis = 1, kernel_dilation: PerAxis = 1, mask: jax.Array | None = None,
               dtype: Any = None, precision: Any = None,
               promote_dtype: PromoteDtype = dtypes.promote_dtype) -> jax.Array:
    """The unshared convolution (``lax.conv_general_dilated_local``): a kernel per output position.

    ``kernel`` and ``bias`` have the shapes ``conv_local_shapes`` gives.
    """
    rank = len(kernel_size)
    x, kernel, bias, batch_shape, padding, kernel_dilation = _prepared(
        x, kernel, bias, padding, kernel_size, kernel_dilation, mask, dtype, promote_dtype)
    y = lax.conv_general_dilated_local(x, kernel, _per_axis(strides, rank), padding, kernel_size,
                                       lhs_dilation=_per_axis(input_dilation, rank),
                                       rhs_dilation=kernel_dilation,
                                       dimension_numbers=_dimension_numbers(x.ndim), precision=precision)
    return _restore_batch(add_bias(y, bias), batch_shape)


def conv_transpose(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
                   strides: PerAxis = None, padding: PaddingLike = "SAME", kernel_dilation: PerAxis = None,
                   transpose_kernel: bool = False, mask: jax.Array | None = None, dtype: Any = None,
                   precision: Any = None, preferred_element_type: Any = None,
                   promote_dtype: PromoteDtype = dtypes.promote_dtype) -> jax.Array:
    """A transposed convolution (``lax.conv_transpose``): upsamples by ``strides``.

    With ``transpose_kernel=True`` the kernel is ``(*window, out, in)`` and flipped
    spatially, i.e. it is the gradient of a ``conv`` with that kernel.  ``'CIRCULAR'``
    padding folds the full ``'VALID'`` output back onto a periodic grid of
    ``input_size * stride``.
    """
    rank = kernel.ndim - 2
    x, batch_shape = _flatten_batch(x, rank)
    strides = _per_axis(strides, rank)
    kernel = _masked(kernel, mask)
    padding = canonicalize_padding(padding, rank)
    circular = padding == "CIRCULAR"
    x, kernel, bias = promote_dtype(x, kernel, bias, dtype=dtype)
    y = lax.conv_transpose(x, kernel, strides, "VALID" if circular else padding,
                           rhs_dilation=_per_axis(kernel_dilation, rank), transpose_kernel=transpose_kernel,
                           precision=precision, preferred_element_type=preferred_element_type)
    if circular:
        y = _wrap_onto_period(y, [n * s for n, s in zip(x.shape[1:-1], strides)], transpose_kernel)
    return _restore_batch(add_bias(y, bias), batch_shape)


def _wrap_onto_period(y: jax.Array, periods: list[int], transpose_kernel: bool) -> jax.Array:
    """Sums every spatial axis of ``y`` modulo its period (periodic boundary conditions).

    Each axis is zero-padded to an odd multiple of its period, centred the
    way the kernel orientation requires, then folded and summed.
    """
    for i, period in enumerate(periods, start=1):
        extra = (period - y.shape[i]) % (2 * period)
        small, large = extra // 2, (extra + 1) // 2
        pads = [(0, 0)] * y.ndim
        pads[i] = (small, large) if transpose_kernel else (large, small)
        y = jnp.pad(y, pads)
        y = jnp.reshape(y, y.shape[:i] + (-1, period) + y.shape[i + 1:]).sum(axis=i)
    return y
