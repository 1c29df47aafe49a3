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

The arithmetic is ``varjax.functional.normalization`` (``moments``, ``group_moments``,
``normalize``, ``ema``): a layer here computes its statistics, declares ``scale``/``bias``
(and ``BatchNorm``'s running averages) and calls ``normalize``.

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

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from varjax.functional import normalization as F
from varjax.nn import initializers
from varjax.nn.dtypes import merge_param
from varjax.nn.module import Module, compact
from varjax.nn.typing import Array as Array
from varjax.nn.typing import Axes as Axes
from varjax.nn.typing import Dtype as Dtype
from varjax.nn.typing import Initializer as Initializer
from varjax.nn.typing import PRNGKey as PRNGKey
from varjax.nn.typing import Shape as Shape
from varjax.nn.weight_normalization import SpectralNorm as SpectralNorm
from varjax.nn.weight_normalization import WeightNorm as WeightNorm

__all__ = ["LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm", "InstanceNorm", "SpectralNorm", "WeightNorm"]


def _learned(mdl: Module, x: jax.Array, feature_axes: Any, use_scale: bool, use_bias: bool
             ) -> tuple[jax.Array | None, jax.Array | None]:
    """The ``scale`` and ``bias`` parameters (each None when unused), of the features' shape."""
    shape = F.feature_shape(x.shape, feature_axes)
    scale = mdl.param("scale", mdl.scale_init, shape, mdl.param_dtype) if use_scale else None
    bias = mdl.param("bias", mdl.bias_init, shape, mdl.param_dtype) if use_bias else None
    return scale, bias


def _normalized(mdl: Module, x: jax.Array, mean: jax.Array, var: jax.Array, reduction_axes: Any,
                feature_axes: Any, use_bias: bool) -> jax.Array:
    """``x`` normalized with the given statistics and ``mdl``'s learned ``scale``/``bias``."""
    scale, bias = _learned(mdl, x, feature_axes, mdl.use_scale, use_bias)
    return F.normalize(x, mean, var, scale, bias, reduction_axes=reduction_axes, feature_axes=feature_axes,
                       epsilon=mdl.epsilon, dtype=mdl.dtype, param_dtype=mdl.param_dtype,
                       force_float32_reductions=mdl.force_float32_reductions)


def _moments(mdl: Module, x: jax.Array, axes: Any, **options: Any) -> tuple[jax.Array, jax.Array]:
    """``F.moments`` with ``mdl``'s reduction options."""
    return F.moments(x, axes, dtype=mdl.dtype, axis_index_groups=mdl.axis_index_groups,
                     use_fast_variance=mdl.use_fast_variance,
                     force_float32_reductions=mdl.force_float32_reductions, **options)


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
    """If true, normalize with the stored running statistics instead of the batch's (and do not
    update them); may be given to the call instead."""
    axis: int = -1
    """The feature axis: each index has its own statistics, scale and bias."""
    momentum: float = 0.99
    """Decay of the running averages: ``new = momentum * old + (1 - momentum) * batch``."""
    epsilon: float = 1e-5
    """Added to the variance before its square root, to avoid dividing by zero."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    use_bias: bool = True
    """Whether to add a learned bias."""
    use_scale: bool = True
    """Whether to multiply by a learned scale."""
    bias_init: initializers.Initializer = initializers.zeros
    """Initializer of the bias."""
    scale_init: initializers.Initializer = initializers.ones
    """Initializer of the scale."""
    axis_name: str | None = None
    """The named axis (of ``vmap``/``pmap``/``shard_map``) over which the statistics are also
    averaged; ``None``: none."""
    axis_index_groups: Sequence[Sequence[int]] | None = None
    """Groups of indices of ``axis_name`` to average over separately (as ``jax.lax.pmean``'s)."""
    use_fast_variance: bool = True
    """Computes the variance as ``E[x^2] - E[x]^2`` (one pass, less exact) rather than ``E[(x -
    E[x])^2]``."""
    force_float32_reductions: bool = True
    """Computes the mean and variance in float32 whatever ``dtype`` is."""

    @compact
    def __call__(self, x: jax.Array, use_running_average: bool | None = None, *,
                 mask: jax.Array | None = None) -> jax.Array:
        use_running_average = merge_param("use_running_average", self.use_running_average,
                                          use_running_average)
        feature_axes, reduction_axes = F.batch_norm_axes(x.ndim, self.axis)
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
            mean, var = _moments(self, x, reduction_axes, axis_name=None if initializing else self.axis_name,
                                 mask=mask)
            if not initializing:
                ra_mean.value = F.ema(ra_mean.value, mean, self.momentum)
                ra_var.value = F.ema(ra_var.value, var, self.momentum)
        return _normalized(self, x, mean, var, reduction_axes, feature_axes, self.use_bias)


class LayerNorm(Module):
    """Normalizes each example over ``reduction_axes`` (default: the last axis)."""

    epsilon: float = 1e-6
    """Added to the variance before its square root, to avoid dividing by zero."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    use_bias: bool = True
    """Whether to add a learned bias."""
    use_scale: bool = True
    """Whether to multiply by a learned scale."""
    bias_init: initializers.Initializer = initializers.zeros
    """Initializer of the bias."""
    scale_init: initializers.Initializer = initializers.ones
    """Initializer of the scale."""
    reduction_axes: Axes = -1
    """The axes the mean and variance are computed over."""
    feature_axes: Axes = -1
    """The axes that get their own scale and bias."""
    axis_name: str | None = None
    """The named axis (of ``vmap``/``pmap``/``shard_map``) over which the statistics are also
    averaged; ``None``: none."""
    axis_index_groups: Sequence[Sequence[int]] | None = None
    """Groups of indices of ``axis_name`` to average over separately (as ``jax.lax.pmean``'s)."""
    use_fast_variance: bool = True
    """Computes the variance as ``E[x^2] - E[x]^2`` (one pass, less exact) rather than ``E[(x -
    E[x])^2]``."""
    force_float32_reductions: bool = True
    """Computes the mean and variance in float32 whatever ``dtype`` is."""

    @compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        mean, var = _moments(self, x, self.reduction_axes, axis_name=self.axis_name, mask=mask)
        return _normalized(self, x, mean, var, self.reduction_axes, self.feature_axes, self.use_bias)


class RMSNorm(Module):
    """Scales each example by its root mean square over ``reduction_axes``: no centring, no bias."""

    epsilon: float = 1e-6
    """Added to the mean square before its square root, to avoid dividing by zero."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    use_scale: bool = True
    """Whether to multiply by a learned scale."""
    scale_init: initializers.Initializer = initializers.ones
    """Initializer of the scale."""
    reduction_axes: Axes = -1
    """The axes the mean square is computed over."""
    feature_axes: Axes = -1
    """The axes that get their own scale and bias."""
    axis_name: str | None = None
    """The named axis (of ``vmap``/``pmap``/``shard_map``) over which the statistics are also
    averaged; ``None``: none."""
    axis_index_groups: Sequence[Sequence[int]] | None = None
    """Groups of indices of ``axis_name`` to average over separately (as ``jax.lax.pmean``'s)."""
    use_fast_variance: bool = True
    """Computes the variance as ``E[x^2] - E[x]^2`` (one pass, less exact) rather than ``E[(x -
    E[x])^2]``."""
    force_float32_reductions: bool = True
    """Computes the mean and variance in float32 whatever ``dtype`` is."""

    @compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        mean, var = _moments(self, x, self.reduction_axes, axis_name=self.axis_name, use_mean=False,
                             mask=mask)
        return _normalized(self, x, mean, var, self.reduction_axes, self.feature_axes, use_bias=False)


class GroupNorm(Module):
    """Splits the last (feature) axis into groups and normalizes each group per example.

    Give either ``num_groups`` or ``group_size`` (set ``num_groups=None`` to
    use ``group_size``: ``num_groups`` defaults to 32).  ``reduction_axes``
    must include the last axis and defaults to every axis but the first.
    """

    num_groups: int | None = 32
    """Number of groups the channels are split into (``None``: set by ``group_size``)."""
    group_size: int | None = None
    """Number of channels per group (``None``: set by ``num_groups``); give exactly one of the
    two."""
    epsilon: float = 1e-6
    """Added to the variance before its square root, to avoid dividing by zero."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    use_bias: bool = True
    """Whether to add a learned bias."""
    use_scale: bool = True
    """Whether to multiply by a learned scale."""
    bias_init: initializers.Initializer = initializers.zeros
    """Initializer of the bias."""
    scale_init: initializers.Initializer = initializers.ones
    """Initializer of the scale."""
    reduction_axes: Axes | None = None
    """The axes the statistics are computed over besides the group's channels (``None``: every
    axis but the first)."""
    axis_name: str | None = None
    """The named axis (of ``vmap``/``pmap``/``shard_map``) over which the statistics are also
    averaged; ``None``: none."""
    axis_index_groups: Sequence[Sequence[int]] | None = None
    """Groups of indices of ``axis_name`` to average over separately (as ``jax.lax.pmean``'s)."""
    use_fast_variance: bool = True
    """Computes the variance as ``E[x^2] - E[x]^2`` (one pass, less exact) rather than ``E[(x -
    E[x])^2]``."""
    force_float32_reductions: bool = True
    """Computes the mean and variance in float32 whatever ``dtype`` is."""

    @compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        axes = self.reduction_axes if self.reduction_axes is not None else [*range(1, x.ndim - 1), -1]
        reduction_axes = F.canonical_axes(x.ndim, axes)
        if reduction_axes[-1] != x.ndim - 1:
            raise ValueError("GroupNorm's reduction_axes must include the last axis, which holds the "
                             "features.")
        num_groups = F.group_count(x.shape[-1], self.num_groups, self.group_size)
        mean, var = F.group_moments(x, num_groups, reduction_axes, dtype=self.dtype, axis_name=self.axis_name,
                                    axis_index_groups=self.axis_index_groups,
                                    use_fast_variance=self.use_fast_variance, mask=mask,
                                    force_float32_reductions=self.force_float32_reductions)
        return _normalized(self, x, mean, var, reduction_axes[:-1], (-1,), self.use_bias)


class InstanceNorm(Module):
    """Normalizes each example and feature over the remaining axes (the spatial ones).

    Axis 0 is the batch; ``feature_axes`` (default: the last) get the learned
    ``scale``/``bias`` and are not reduced.
    """

    epsilon: float = 1e-6
    """Added to the variance before its square root, to avoid dividing by zero."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    use_bias: bool = True
    """Whether to add a learned bias."""
    use_scale: bool = True
    """Whether to multiply by a learned scale."""
    bias_init: initializers.Initializer = initializers.zeros
    """Initializer of the bias."""
    scale_init: initializers.Initializer = initializers.ones
    """Initializer of the scale."""
    feature_axes: Axes = -1
    """The axes that get their own scale and bias."""
    axis_name: str | None = None
    """The named axis (of ``vmap``/``pmap``/``shard_map``) over which the statistics are also
    averaged; ``None``: none."""
    axis_index_groups: Sequence[Sequence[int]] | None = None
    """Groups of indices of ``axis_name`` to average over separately (as ``jax.lax.pmean``'s)."""
    use_fast_variance: bool = True
    """Computes the variance as ``E[x^2] - E[x]^2`` (one pass, less exact) rather than ``E[(x -
    E[x])^2]``."""
    force_float32_reductions: bool = True
    """Computes the mean and variance in float32 whatever ``dtype`` is."""

    @compact
    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        feature_axes, reduction_axes = F.instance_norm_axes(x.ndim, self.feature_axes)
        mean, var = _moments(self, x, reduction_axes, axis_name=self.axis_name, mask=mask)
        return _normalized(self, x, mean, var, reduction_axes, feature_axes, self.use_bias)
