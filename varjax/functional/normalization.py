"""Normalization statistics and the normalization itself, without the parameters.

Every normalization layer is ``moments`` over some axes, then ``normalize``:
``(x - mean) * rsqrt(var + epsilon) * scale + bias``.  The layers differ only in the axes
(``LayerNorm``: the features of an example; ``BatchNorm``: everything but the features;
``GroupNorm``: groups of features, ``group_moments``) and in whether they keep running
averages (``ema``).  ``scale`` and ``bias`` come in as arrays of ``feature_shape``, so each
frontend declares them as it declares parameters.

Statistics are reduced in at least float32 (``force_float32_reductions=True``) whatever
the compute dtype.  ``use_fast_variance`` takes ``E[x^2] - E[x]^2`` in one pass, which loses
precision when ``|mean| >> std``.  With ``axis_name`` the statistics are averaged over that
mapped axis (``lax.pmean``), so replicas normalize with global statistics.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from varjax.functional.dtypes import canonicalize_dtype, cast, promote_dtype
from varjax.functional.linear import AxisError
from varjax.ir import errors

__all__ = ["canonical_axes", "feature_shape", "batch_norm_axes", "instance_norm_axes", "moments",
           "group_count", "group_reduction_axes",
           "group_moments", "normalize", "ema"]

Axes = int | Iterable[int]


def canonical_axes(ndim: int, axes: Axes) -> tuple[int, ...]:
    """Non-negative, sorted, deduplicated axes; one outside ``[-ndim, ndim)`` is an
    ``AxisError`` (it would otherwise wrap to another axis)."""
    given = tuple(axes) if isinstance(axes, Iterable) else (axes,)
    for a in given:
        if not -ndim <= a < ndim:
            raise AxisError(f"axis {a} is out of range for an input of rank {ndim}.",
                            **errors.where(), fix=f"give axes in [-{ndim}, {ndim})")
    return tuple(sorted({a % ndim for a in given}))


def feature_shape(shape: Sequence[int], feature_axes: Axes) -> tuple[int, ...]:
    """The shape of ``scale`` and ``bias`` for an input of ``shape``: its ``feature_axes``."""
    return tuple(shape[a] for a in canonical_axes(len(shape), feature_axes))


def batch_norm_axes(ndim: int, axis: Axes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """BatchNorm's ``(feature_axes, reduction_axes)``: ``axis`` canonical, and every other
    axis (the statistics are shared across the batch and any other non-feature axis)."""
    feature_axes = canonical_axes(ndim, axis)
    return feature_axes, tuple(a for a in range(ndim) if a not in feature_axes)


def instance_norm_axes(ndim: int, feature_axes: Axes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """InstanceNorm's ``(feature_axes, reduction_axes)``: ``feature_axes`` canonical, and every
    axis but those and the batch axis 0 (each example gets its own statistics).  A feature
    axis 0 would be the batch axis: a ``ConfigError`` at the user's line."""
    axes = canonical_axes(ndim, feature_axes)
    if 0 in axes:
        raise errors.ConfigError(
            f"InstanceNorm's feature_axes {feature_axes!r} include axis 0, which is the batch "
            "axis.", **errors.where(),
            fix="give feature axes among 1..ndim-1 (the default is the last axis)")
    return axes, tuple(a for a in range(1, ndim) if a not in axes)


def _abs_sq(x: jax.Array) -> jax.Array:
    """``|x|^2``, real for complex ``x`` (so variances stay real)."""
    if jnp.iscomplexobj(x):
        return lax.square(lax.real(x)) + lax.square(lax.imag(x))
    return lax.square(x)


def moments(x: jax.Array, axes: Axes, *, dtype: Any = None, axis_name: str | None = None,
            axis_index_groups: Any = None, use_mean: bool = True, use_fast_variance: bool = True,
            mask: jax.Array | None = None, force_float32_reductions: bool = True
            ) -> tuple[jax.Array, jax.Array]:
    """Mean and variance of ``x`` over ``axes`` (and over ``axis_name`` if given).

    ``use_mean=False`` gives a zero mean and the mean square as the variance
    (RMS normalization).  ``mask`` excludes entries from both statistics.
    """
    dtype = jnp.result_type(x) if dtype is None else dtype
    if force_float32_reductions:
        dtype = canonicalize_dtype(dtype, jnp.float32, inexact=False)  # at least float32
    x = cast(x, dtype)
    axes = canonical_axes(x.ndim, axes)
    where = None if mask is None else jnp.asarray(mask, bool)
    count = math.prod(x.shape[a] for a in axes)

    def one_mean(v: jax.Array) -> jax.Array:
        if where is not None:
            return jnp.mean(v, axes, where=where)
        # jnp.mean's arithmetic in lax: layers trace this per call, and jnp's checks cost.
        # The count as a numpy scalar: a literal, where lax.convert_element_type binds.
        return lax.div(lax.reduce_sum(v, axes), np.asarray(count, v.dtype))

    def mean(*xs: jax.Array) -> list[jax.Array]:
        mus = [one_mean(v) for v in xs]
        if axis_name is None:
            return mus
        # Averaged over the mapped axis too: global, not per-replica, statistics.
        return lax.pmean(mus, axis_name, axis_index_groups=axis_index_groups)

    if not use_mean:
        (var,) = mean(_abs_sq(x))
        return jnp.zeros_like(var), var
    if use_fast_variance:
        mu, mu2 = mean(x, _abs_sq(x))
        # A scalar literal, not lax.full_like: one equation fewer per layer to trace.
        return mu, lax.max(lax.sub(mu2, _abs_sq(mu)), np.zeros((), mu2.dtype))
    (mu,) = mean(x)
    (var,) = mean(_abs_sq(x - jnp.expand_dims(mu, axes)))
    return mu, var


def group_count(channels: int, num_groups: int | None, group_size: int | None) -> int:
    """How many groups ``channels`` features split into; exactly one of the two is given.

    A bad pair is a ``ConfigError`` (a ``ValueError``, as Flax raises) at the user's line:
    both frontends check it here, Linen at the first call, NNX at construction.
    """
    fix = "give num_groups dividing the features, or num_groups=None and group_size"
    if (num_groups is None) == (group_size is None):
        raise errors.ConfigError(
            "Give exactly one of GroupNorm's num_groups and group_size; to use group_size, "
            "pass num_groups=None (it defaults to 32).", **errors.where(), fix=fix)
    if group_size is not None:
        if not isinstance(group_size, int) or group_size <= 0:
            raise errors.ConfigError(f"group_size ({group_size!r}) must be a positive int.",
                                     path=("group_size",), **errors.where(), fix=fix)
        if channels % group_size:
            raise errors.ConfigError(f"Number of channels ({channels}) is not a multiple of "
                                     f"group_size ({group_size}).", **errors.where(), fix=fix)
        return channels // group_size
    if not isinstance(num_groups, int) or num_groups <= 0 or channels % num_groups:
        raise errors.ConfigError(f"num_groups ({num_groups!r}) does not divide the number of "
                                 f"channels ({channels}).", **errors.where(), fix=fix)
    return num_groups


def group_reduction_axes(ndim: int, reduction_axes: Axes | None) -> tuple[int, ...]:
    """GroupNorm's canonical ``reduction_axes`` (default: every axis but the first), which
    must include the last (feature) axis: ``group_moments`` splits that axis into groups."""
    axes = canonical_axes(ndim, [*range(1, ndim - 1), -1] if reduction_axes is None
                          else reduction_axes)
    if axes[-1] != ndim - 1:
        raise errors.ConfigError(
            f"GroupNorm's reduction_axes {reduction_axes!r} must include the last axis, which "
            "holds the features.", **errors.where(), fix=f"add -1 (axis {ndim - 1}) to them")
    return axes


def group_moments(x: jax.Array, num_groups: int, reduction_axes: tuple[int, ...], *,
                  mask: jax.Array | None = None, **options: Any) -> tuple[jax.Array, jax.Array]:
    """``moments`` of each group of the last (feature) axis, repeated back to one per feature.

    ``reduction_axes`` are canonical and end with the last axis; ``options`` are
    ``moments``'s.
    """
    group_size = x.shape[-1] // num_groups
    grouped = x.shape[:-1] + (num_groups, group_size)
    if mask is not None:
        mask = jnp.reshape(mask, mask.shape[:-1] + (num_groups, group_size))
    # In the grouped view, the former feature axis is the group axis and
    # the members of a group are the new last axis.
    mean, var = moments(jnp.reshape(x, grouped), [*reduction_axes[:-1], -1], mask=mask, **options)
    return jnp.repeat(mean, group_size, axis=-1), jnp.repeat(var, group_size, axis=-1)


def normalize(x: jax.Array, mean: jax.Array, var: jax.Array, scale: jax.Array | None = None,
              bias: jax.Array | None = None, *, reduction_axes: Axes, feature_axes: Axes, epsilon: float,
              dtype: Any = None, param_dtype: Any = jnp.float32,
              force_float32_reductions: bool = True) -> jax.Array:
    """``(x - mean) * rsqrt(var + epsilon) * scale + bias``; ``mean``/``var`` lack ``reduction_axes``.

    Every binary operation promotes its operands as JAX's standard promotion
    would (explicitly, via ``promote_dtype``), so mixed input/statistic/
    parameter dtypes give Linen's result dtypes even under strict promotion.
    The output is cast to ``dtype``, or to the promotion of ``x`` and the
    parameters if ``dtype`` is None.
    """
    reduction_axes = canonical_axes(x.ndim, reduction_axes)
    feature_axes = canonical_axes(x.ndim, feature_axes)
    broadcast_shape = tuple(x.shape[a] if a in feature_axes else 1 for a in range(x.ndim))

    def learned(p: jax.Array) -> jax.Array:
        p = lax.reshape(p, broadcast_shape)
        return p if force_float32_reductions else cast(p, param_dtype)

    # lax once operands are promoted: same arithmetic as jnp, less trace time per layer.
    y = lax.sub(*promote_dtype(x, lax.expand_dims(mean, reduction_axes), inexact=False))
    var = lax.expand_dims(var, reduction_axes)
    mul = lax.rsqrt(lax.add(var, np.asarray(epsilon, var.dtype)))
    out_args = [x]
    if scale is not None:
        scale = learned(scale)
        mul = lax.mul(*promote_dtype(mul, scale, inexact=False))
        out_args.append(scale)
    y = lax.mul(*promote_dtype(y, mul, inexact=False))
    if bias is not None:
        bias = learned(bias)
        y = lax.add(*promote_dtype(y, bias, inexact=False))
        out_args.append(bias)
    return cast(y, canonicalize_dtype(*out_args, dtype=dtype))


def ema(old: jax.Array, new: jax.Array, momentum: float) -> jax.Array:
    """``momentum * old + (1 - momentum) * new``, kept in ``old``'s dtype (a running average
    keeps its dtype).  Computed as flax writes it (``v[...] = decay * v + (1 - decay) * new``):
    each term in its array's dtype (a Python float keeps it), their sum in the promotion of
    the two, cast once when written.  Casting ``new`` first would round a float32 update to
    a bfloat16 average's precision before the blend."""
    kept, added = promote_dtype(momentum * old, (1 - momentum) * new, inexact=False)
    return cast(kept + added, old.dtype)
