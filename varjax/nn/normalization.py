"""Normalization layers: ``LayerNorm``, ``RMSNorm``, ``BatchNorm``, ``GroupNorm``, ``InstanceNorm``.

All five compute a mean and variance over some axes, then
``(x - mean) * rsqrt(var + epsilon) * scale + bias`` with ``scale``/``bias``
learned per feature (parameters ``scale`` and ``bias``, as in Linen).  They
differ only in which axes are reduced:

* ``LayerNorm`` / ``RMSNorm``: the feature axes of each example (``RMSNorm``
  skips the mean and the bias);
* ``BatchNorm``: every axis except the feature ``axis``, i.e. across the
  batch, so it keeps running averages in the ``batch_stats`` collection
  (``mean``, ``var``) for evaluation;
* ``GroupNorm``: the features split into groups, per example;
* ``InstanceNorm``: every axis but the first (batch) and the features, per
  example and feature.

``WeightNorm`` and ``SpectralNorm``, which normalize another layer's weights
rather than activations, live in ``varjax.nn.weight_normalization`` and are
re-exported here, where Linen keeps them.

With ``axis_name`` the statistics are averaged over that mapped axis
(``jax.lax.pmean``), so replicas under ``vmap``/``shard_map`` normalize with
global rather than per-replica statistics.

Sharp edges:
  * Statistics are reduced in at least float32
    (``force_float32_reductions=True``, the default), whatever ``dtype``.
  * ``use_fast_variance`` computes ``E[x^2] - E[x]^2`` in one pass; it loses
    precision when ``|mean| >> std``.  Set it to False for the two-pass form.
  * ``BatchNorm`` in training mode writes ``batch_stats``: apply it with
    ``mutable=['batch_stats']``.  During ``init`` the running averages keep
    their initial values and ``axis_name`` is ignored, as in Linen.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from varjax.ir import errors
from varjax.nn import initializers
from varjax.nn.dtypes import canonicalize_dtype, cast, merge_param, promote_dtype
from varjax.nn.module import Module, compact, nowrap
from varjax.nn.typing import Array as Array
from varjax.nn.typing import Axes as Axes
from varjax.nn.typing import Dtype as Dtype
from varjax.nn.typing import Initializer as Initializer
from varjax.nn.typing import PRNGKey as PRNGKey
from varjax.nn.typing import Shape as Shape
from varjax.nn.weight_normalization import SpectralNorm as SpectralNorm
from varjax.nn.weight_normalization import WeightNorm as WeightNorm
from varjax.trace.context import site

__all__ = ["LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm", "InstanceNorm", "SpectralNorm", "WeightNorm"]


def _canonical_axes(ndim: int, axes: Axes) -> tuple[int, ...]:
    """Non-negative, sorted, deduplicated axes."""
    return tuple(sorted({a % ndim for a in (axes if isinstance(axes, Iterable) else (axes,))}))


def _abs_sq(x: jax.Array) -> jax.Array:
    """``|x|^2``, real for complex ``x`` (so variances stay real)."""
    if jnp.iscomplexobj(x):
        return lax.square(lax.real(x)) + lax.square(lax.imag(x))
    return lax.square(x)


def _compute_stats(x: jax.Array, axes: Axes, dtype: Any, axis_name: str | None = None,
                   axis_index_groups: Any = None, use_mean: bool = True, use_fast_variance: bool = True,
                   mask: jax.Array | None = None,
                   force_float32_reductions: bool = True) -> tuple[jax.Array, jax.Array]:
    """Mean and variance of ``x`` over ``axes`` (and over ``axis_name`` if given).

    ``use_mean=False`` gives a zero mean and the mean square as the variance
    (RMS normalization).  ``mask`` excludes entries from both statistics.
    """
    dtype = jnp.result_type(x) if dtype is None else dtype
    if force_float32_reductions:
        dtype = canonicalize_dtype(dtype, jnp.float32, inexact=False)  # at least float32
    x = cast(x, dtype)
    axes = _canonical_axes(x.ndim, axes)
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


def _normalize(mdl: Module, x: jax.Array, mean: jax.Array, var: jax.Array, reduction_axes: Axes,
               feature_axes: Axes, dtype: Any, param_dtype: Any, epsilon: float, use_bias: bool,
               use_scale: bool, bias_init: initializers.Initializer, scale_init: initializers.Initializer,
               force_float32_reductions: bool = True) -> jax.Array:
    """Normalizes ``x`` with the given statistics and applies the learned ``scale``/``bias``.

    Every binary operation promotes its operands as JAX's standard promotion
    would (explicitly, via ``promote_dtype``), so mixed input/statistic/
    parameter dtypes give Linen's result dtypes even under strict promotion.
    The output is cast to ``dtype``, or to the promotion of ``x`` and the
    parameters if ``dtype`` is None.
    """
    reduction_axes = _canonical_axes(x.ndim, reduction_axes)
    feature_axes = _canonical_axes(x.ndim, feature_axes)
    param_shape = tuple(x.shape[a] for a in feature_axes)
    broadcast_shape = tuple(x.shape[a] if a in feature_axes else 1 for a in range(x.ndim))

    def learned(name: str, init: initializers.Initializer) -> jax.Array:
        p = lax.reshape(mdl.param(name, init, param_shape, param_dtype), broadcast_shape)
        return p if force_float32_reductions else cast(p, param_dtype)

    # lax once operands are promoted: same arithmetic as jnp, less trace time per layer.
    y = lax.sub(*promote_dtype(x, lax.expand_dims(mean, reduction_axes), inexact=False))
    var = lax.expand_dims(var, reduction_axes)
    mul = lax.rsqrt(lax.add(var, np.asarray(epsilon, var.dtype)))
    out_args = [x]
    if use_scale:
        scale = learned("scale", scale_init)
        mul = lax.mul(*promote_dtype(mul, scale, inexact=False))
        out_args.append(scale)
    y = lax.mul(*promote_dtype(y, mul, inexact=False))
    if use_bias:
        bias = learned("bias", bias_init)
        y = lax.add(*promote_dtype(y, bias, inexact=False))
        out_args.append(bias)
    return cast(y, canonicalize_dtype(*out_args, dtype=dtype))


class BatchNorm(Module):
    """Normalizes each feature over the batch (all axes but ``axis``).

    In training (``use_running_average=False``) it normalizes with the batch
    statistics and updates the running averages
    ``ra = momentum * ra + (1 - momentum) * batch_stat``; in evaluation it
    normalizes with the running averages and writes nothing.
    ``use_running_average`` is given as a field or as a call argument, not
    both (see ``merge_param``).
    """

    use_running_average: bool | None = None
    axis: int = -1
    momentum: float = 0.99
    epsilon: float = 1e-5
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: initializers.Initializer = initializers.zeros
    scale_init: initializers.Initializer = initializers.ones
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x: jax.Array, use_running_average: bool | None = None, *,
                 mask: jax.Array | None = None) -> jax.Array:
        use_running_average = merge_param("use_running_average", self.use_running_average,
                                          use_running_average)
        feature_axes = _canonical_axes(x.ndim, self.axis)
        reduction_axes = tuple(a for a in range(x.ndim) if a not in feature_axes)
        feature_shape = tuple(x.shape[a] for a in feature_axes)
        stats_dtype = jnp.float32 if self.force_float32_reductions else self.param_dtype
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, feature_shape, stats_dtype)
        ra_var = self.variable("batch_stats", "var", jnp.ones, feature_shape, stats_dtype)

        if use_running_average:
            mean, var = ra_mean.value, ra_var.value
            if not self.force_float32_reductions:
                mean, var = jnp.asarray(mean, self.param_dtype), jnp.asarray(var, self.param_dtype)
        else:
            initializing = self.is_initializing()
            mean, var = _compute_stats(x, reduction_axes, self.dtype,
                                       axis_name=None if initializing else self.axis_name,
                                       axis_index_groups=self.axis_index_groups,
                                       use_fast_variance=self.use_fast_variance, mask=mask,
                                       force_float32_reductions=self.force_float32_reductions)
            if not initializing:
                ra_mean.value = self._updated(ra_mean.value, mean)
                ra_var.value = self._updated(ra_var.value, var)
        return _normalize(self, x, mean, var, reduction_axes, feature_axes, self.dtype, self.param_dtype,
                          self.epsilon, self.use_bias, self.use_scale, self.bias_init, self.scale_init,
                          self.force_float32_reductions)

    @nowrap
    def _updated(self, running: jax.Array, batch: jax.Array) -> jax.Array:
        """The exponential moving average step, kept in the running statistic's dtype."""
        return jnp.asarray(self.momentum * running + (1 - self.momentum) * jnp.asarray(batch, running.dtype),
                           running.dtype)


class LayerNorm(Module):
    """Normalizes each example over ``reduction_axes`` (default: the last axis)."""

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: initializers.Initializer = initializers.zeros
    scale_init: initializers.Initializer = initializers.ones
    reduction_axes: Axes = -1
    feature_axes: Axes = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        mean, var = _compute_stats(x, self.reduction_axes, self.dtype, self.axis_name, self.axis_index_groups,
                                   use_fast_variance=self.use_fast_variance, mask=mask,
                                   force_float32_reductions=self.force_float32_reductions)
        return _normalize(self, x, mean, var, self.reduction_axes, self.feature_axes, self.dtype,
                          self.param_dtype, self.epsilon, self.use_bias, self.use_scale, self.bias_init,
                          self.scale_init, self.force_float32_reductions)


class RMSNorm(Module):
    """Scales each example by its root mean square over ``reduction_axes``: no centring, no bias."""

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_scale: bool = True
    scale_init: initializers.Initializer = initializers.ones
    reduction_axes: Axes = -1
    feature_axes: Axes = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        mean, var = _compute_stats(x, self.reduction_axes, self.dtype, self.axis_name, self.axis_index_groups,
                                   use_mean=False, use_fast_variance=self.use_fast_variance, mask=mask,
                                   force_float32_reductions=self.force_float32_reductions)
        return _normalize(self, x, mean, var, self.reduction_axes, self.feature_axes, self.dtype,
                          self.param_dtype, self.epsilon, False, self.use_scale, initializers.zeros,
                          self.scale_init, self.force_float32_reductions)


class GroupNorm(Module):
    """Splits the last (feature) axis into groups and normalizes each group per example.

    Give either ``num_groups`` or ``group_size`` (set ``num_groups=None`` to
    use ``group_size``: ``num_groups`` defaults to 32).  ``reduction_axes``
    must include the last axis and defaults to every axis but the first.
    """

    num_groups: int | None = 32
    group_size: int | None = None
    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: initializers.Initializer = initializers.zeros
    scale_init: initializers.Initializer = initializers.ones
    reduction_axes: Axes | None = None
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        axes = self.reduction_axes if self.reduction_axes is not None else [*range(1, x.ndim - 1), -1]
        reduction_axes = _canonical_axes(x.ndim, axes)
        if reduction_axes[-1] != x.ndim - 1:
            raise ValueError("GroupNorm's reduction_axes must include the last axis, which holds the "
                             "features.")
        num_groups = self._num_groups(x.shape[-1])
        group_size = x.shape[-1] // num_groups
        grouped = x.shape[:-1] + (num_groups, group_size)
        if mask is not None:
            mask = jnp.reshape(mask, mask.shape[:-1] + (num_groups, group_size))
        # In the grouped view, the former feature axis is the group axis and
        # the members of a group are the new last axis.
        mean, var = _compute_stats(jnp.reshape(x, grouped), [*reduction_axes[:-1], -1], self.dtype,
                                   self.axis_name, self.axis_index_groups,
                                   use_fast_variance=self.use_fast_variance, mask=mask,
                                   force_float32_reductions=self.force_float32_reductions)
        mean = jnp.repeat(mean, group_size, axis=-1)
        var = jnp.repeat(var, group_size, axis=-1)
        return _normalize(self, x, mean, var, reduction_axes[:-1], (-1,), self.dtype, self.param_dtype,
                          self.epsilon, self.use_bias, self.use_scale, self.bias_init, self.scale_init,
                          self.force_float32_reductions)

    @nowrap
    def _num_groups(self, channels: int) -> int:
        if (self.num_groups is None) == (self.group_size is None):
            raise ValueError("Give exactly one of GroupNorm's num_groups and group_size; to use group_size, "
                             "pass num_groups=None (it defaults to 32).")
        if self.group_size is not None:
            if channels % self.group_size:
                raise ValueError(f"Number of channels ({channels}) is not a multiple of group_size "
                                 f"({self.group_size}).")
            return channels // self.group_size
        if self.num_groups <= 0 or channels % self.num_groups:
            raise ValueError(f"num_groups ({self.num_groups}) does not divide the number of channels "
                             f"({channels}).")
        return self.num_groups


class InstanceNorm(Module):
    """Normalizes each example and feature over the remaining axes (the spatial ones).

    Axis 0 is the batch; ``feature_axes`` (default: the last) get the learned
    ``scale``/``bias`` and are not reduced.
    """

    epsilon: float = 1e-6
    dtype: Any = None
    param_dtype: Any = jnp.float32
    use_bias: bool = True
    use_scale: bool = True
    bias_init: initializers.Initializer = initializers.zeros
    scale_init: initializers.Initializer = initializers.ones
    feature_axes: Axes = -1
    axis_name: str | None = None
    axis_index_groups: Any = None
    use_fast_variance: bool = True
    force_float32_reductions: bool = True

    @compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        feature_axes = _canonical_axes(x.ndim, self.feature_axes)
        if 0 in feature_axes:
            raise errors.ConfigError(
                f"InstanceNorm's feature_axes {self.feature_axes!r} include axis 0, which is the batch axis.",
                **site(), fix="give feature axes among 1..ndim-1 (the default is the last axis).")
        reduction_axes = tuple(a for a in range(1, x.ndim) if a not in feature_axes)
        mean, var = _compute_stats(x, reduction_axes, self.dtype, self.axis_name, self.axis_index_groups,
                                   use_fast_variance=self.use_fast_variance, mask=mask,
                                   force_float32_reductions=self.force_float32_reductions)
        return _normalize(self, x, mean, var, reduction_axes, feature_axes, self.dtype, self.param_dtype,
                          self.epsilon, self.use_bias, self.use_scale, self.bias_init, self.scale_init,
                          self.force_float32_reductions)
