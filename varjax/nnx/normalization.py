"""``nnx.LayerNorm``, ``BatchNorm``, ``RMSNorm``, ``GroupNorm``, ``InstanceNorm``: declarations
over ``varjax.functional.normalization``.

Each layer declares its ``scale`` and ``bias`` as ``Param``s drawn from ``rngs.params()``
in NNX's order (scale, then bias; each only when used), ``BatchNorm`` its running
``mean``/``var`` as ``BatchStat``s, and computes with the functions ``varjax.nn``'s layers
call (``moments``/``group_moments``, ``normalize``, ``ema``).  NNX promotes the input and every Variable to
one dtype before the statistics (``promote_dtype``), so the layers here do too: that is what
makes their outputs and running averages flax.nnx's bit for bit.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from varjax.functional import initializers
from varjax.functional import normalization as F
from varjax.ir.typing import Dtype, Initializer, Metadata
from varjax.nnx.call_options import first_from
from varjax.nnx.linear import NO_METADATA
from varjax.nnx.linear import promote_dtype as default_promote_dtype
from varjax.nnx.module import Module
from varjax.nnx.pytree import data
from varjax.nnx.variablelib import BatchStat, Param
from varjax.trace.rngs import Rngs

__all__ = ["LayerNorm", "BatchNorm", "RMSNorm", "GroupNorm", "InstanceNorm"]

Axes = int | tuple[int, ...]


def _param(use: bool, init: Initializer, rngs: Rngs, num_features: int, param_dtype: Dtype,
           metadata: Mapping[str, Any]) -> Param | None:
    """A ``Param`` of ``(num_features,)`` from one ``rngs.params()`` draw, or ``data(None)``
    (no draw) when unused: NNX draws each learned vector only when the layer has it."""
    if not use:
        return data(None)
    return Param(init(rngs.params(), (num_features,), param_dtype), **metadata)


def _learned(module: Module, num_features: int, rngs: Rngs, param_dtype: Dtype,
             use_scale: bool, scale_init: Initializer, scale_metadata: Mapping[str, Any],
             use_bias: bool, bias_init: Initializer, bias_metadata: Mapping[str, Any]
             ) -> None:
    """Sets ``module.scale`` and ``module.bias`` (``_param``), scale drawn first."""
    module.scale = _param(use_scale, scale_init, rngs, num_features, param_dtype,
                          scale_metadata)
    module.bias = _param(use_bias, bias_init, rngs, num_features, param_dtype, bias_metadata)


def _value(variable: Param | None) -> jax.Array | None:
    return None if variable is None else variable[...]


class LayerNorm(Module):
    """Normalizes each example over ``reduction_axes`` (the features by default), then
    scales and shifts per feature."""

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, use_bias: bool = True, use_scale: bool = True,
                 bias_init: Initializer = initializers.zeros_init(),
                 scale_init: Initializer = initializers.ones_init(),
                 reduction_axes: Axes = -1, feature_axes: Axes = -1,
                 axis_name: str | None = None,
                 axis_index_groups: Sequence[Sequence[int]] | None = None,
                 use_fast_variance: bool = True,
                 promote_dtype: Callable[..., Any] = default_promote_dtype, rngs: Rngs,
                 bias_metadata: Metadata = NO_METADATA,
                 scale_metadata: Metadata = NO_METADATA):
        _learned(self, num_features, rngs, param_dtype, use_scale, scale_init, scale_metadata,
                 use_bias, bias_init, bias_metadata)
        self.num_features, self.epsilon = num_features, epsilon
        self.dtype, self.param_dtype = dtype, param_dtype
        self.use_bias, self.use_scale = use_bias, use_scale
        self.reduction_axes, self.feature_axes = reduction_axes, feature_axes
        self.axis_name, self.axis_index_groups = axis_name, axis_index_groups
        self.use_fast_variance, self.promote_dtype = use_fast_variance, promote_dtype

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        x, scale, bias = self.promote_dtype((x, _value(self.scale), _value(self.bias)),
                                            dtype=self.dtype)
        mean, var = F.moments(x, self.reduction_axes, dtype=self.dtype, axis_name=self.axis_name,
                              axis_index_groups=self.axis_index_groups,
                              use_fast_variance=self.use_fast_variance, mask=mask)
        return F.normalize(x, mean, var, scale, bias, reduction_axes=self.reduction_axes,
                           feature_axes=self.feature_axes, epsilon=self.epsilon, dtype=self.dtype)


class BatchNorm(Module):
    """Normalizes each feature over the batch (every axis but ``axis``).

    In training (``use_running_average=False``, what ``Module.train()`` sets) it uses the
    batch's statistics and updates the running averages in place,
    ``ra = momentum * ra + (1 - momentum) * batch_stat``; in evaluation it uses the running
    averages and writes nothing.
    """

    def __init__(self, num_features: int, *, use_running_average: bool | None = False,
                 axis: int = -1, momentum: float = 0.99, epsilon: float = 1e-5,
                 dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
                 use_bias: bool = True, use_scale: bool = True,
                 bias_init: Initializer = initializers.zeros_init(),
                 scale_init: Initializer = initializers.ones_init(),
                 axis_name: str | None = None,
                 axis_index_groups: Sequence[Sequence[int]] | None = None,
                 use_fast_variance: bool = True,
                 promote_dtype: Callable[..., Any] = default_promote_dtype, rngs: Rngs,
                 bias_metadata: Metadata = NO_METADATA,
                 scale_metadata: Metadata = NO_METADATA):
        # Running statistics are float32 whatever param_dtype, as NNX keeps them.
        self.mean = BatchStat(jnp.zeros((num_features,), jnp.float32))
        self.var = BatchStat(jnp.ones((num_features,), jnp.float32))
        _learned(self, num_features, rngs, param_dtype, use_scale, scale_init, scale_metadata,
                 use_bias, bias_init, bias_metadata)
        self.num_features, self.use_running_average = num_features, use_running_average
        self.axis, self.momentum, self.epsilon = axis, momentum, epsilon
        self.dtype, self.param_dtype = dtype, param_dtype
        self.use_bias, self.use_scale = use_bias, use_scale
        self.axis_name, self.axis_index_groups = axis_name, axis_index_groups
        self.use_fast_variance, self.promote_dtype = use_fast_variance, promote_dtype

    def set_view(self, use_running_average: bool | None = None) -> None:
        """What ``nnx.view(model, use_running_average=...)`` sets on this layer of the
        copy (``nnx.view_info`` prints the ``Args:`` below, flax.nnx's text).

        Args:
          use_running_average: if True, the stored batch statistics will be
            used instead of computing the batch statistics on the input.
        """
        if use_running_average is not None:
            self.use_running_average = use_running_average

    def __call__(self, x: jax.Array, use_running_average: bool | None = None, *,
                 mask: jax.Array | None = None) -> jax.Array:
        use_running_average = first_from(
            use_running_average, self.use_running_average, name="use_running_average",
            fix="pass use_running_average= to BatchNorm or its call, or call "
                "model.train()/eval()")
        feature_axes, reduction_axes = F.batch_norm_axes(x.ndim, self.axis)
        x, mean, var, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], _value(self.scale), _value(self.bias)),
            dtype=self.dtype)
        if not use_running_average:
            mean, var = F.moments(x, reduction_axes, dtype=self.dtype, axis_name=self.axis_name,
                                  axis_index_groups=self.axis_index_groups,
                                  use_fast_variance=self.use_fast_variance, mask=mask)
            self.mean[...] = F.ema(self.mean[...], mean, self.momentum)
            self.var[...] = F.ema(self.var[...], var, self.momentum)
        return F.normalize(x, mean, var, scale, bias, reduction_axes=reduction_axes,
                           feature_axes=feature_axes, epsilon=self.epsilon, dtype=self.dtype)


class RMSNorm(Module):
    """Divides each example by its root mean square over ``reduction_axes`` (no centering),
    then scales per feature: ``F.moments(use_mean=False)`` and ``F.normalize`` without a
    bias, so it declares only ``scale``."""

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, use_scale: bool = True,
                 scale_init: Initializer = initializers.ones,
                 reduction_axes: Axes = -1, feature_axes: Axes = -1,
                 axis_name: str | None = None,
                 axis_index_groups: Sequence[Sequence[int]] | None = None,
                 use_fast_variance: bool = True,
                 promote_dtype: Callable[..., Any] = default_promote_dtype, rngs: Rngs,
                 scale_metadata: Metadata = NO_METADATA):
        self.scale = _param(use_scale, scale_init, rngs, num_features, param_dtype,
                            scale_metadata)
        self.num_features, self.epsilon = num_features, epsilon
        self.dtype, self.param_dtype, self.use_scale = dtype, param_dtype, use_scale
        self.reduction_axes, self.feature_axes = reduction_axes, feature_axes
        self.axis_name, self.axis_index_groups = axis_name, axis_index_groups
        self.use_fast_variance, self.promote_dtype = use_fast_variance, promote_dtype

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        x, scale = self.promote_dtype((x, _value(self.scale)), dtype=self.dtype)
        mean, var = F.moments(x, self.reduction_axes, dtype=self.dtype, axis_name=self.axis_name,
                              axis_index_groups=self.axis_index_groups, use_mean=False,
                              use_fast_variance=self.use_fast_variance, mask=mask)
        return F.normalize(x, mean, var, scale, None, reduction_axes=self.reduction_axes,
                           feature_axes=self.feature_axes, epsilon=self.epsilon, dtype=self.dtype)


class GroupNorm(Module):
    """Splits the last (feature) axis into ``num_groups`` groups (or groups of
    ``group_size``) and normalizes each group of each example: ``F.group_moments``, then
    ``F.normalize`` with a per-feature ``scale`` and ``bias``.

    The group count is checked at construction (``F.group_count``: a ``ConfigError``, a
    ``ValueError`` as flax.nnx raises) and kept as ``num_groups``/``group_size``.  Unlike
    flax.nnx 0.12.8, which repeats the group statistics along axis 1, the statistics are
    repeated along the feature axis, so ``reduction_axes`` that leave out a middle axis (an
    input with extra leading axes) normalize each group instead of mixing them.
    """

    def __init__(self, num_features: int, num_groups: int | None = 32,
                 group_size: int | None = None, *, epsilon: float = 1e-6,
                 dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
                 use_bias: bool = True, use_scale: bool = True,
                 bias_init: Initializer = initializers.zeros_init(),
                 scale_init: Initializer = initializers.ones_init(),
                 reduction_axes: Axes | None = None, axis_name: str | None = None,
                 axis_index_groups: Sequence[Sequence[int]] | None = None,
                 use_fast_variance: bool = True,
                 promote_dtype: Callable[..., Any] = default_promote_dtype, rngs: Rngs,
                 bias_metadata: Metadata = NO_METADATA,
                 scale_metadata: Metadata = NO_METADATA):
        self.feature_axis = -1
        self.num_groups = F.group_count(num_features, num_groups, group_size)
        self.group_size = num_features // self.num_groups
        _learned(self, num_features, rngs, param_dtype, use_scale, scale_init, scale_metadata,
                 use_bias, bias_init, bias_metadata)
        self.epsilon, self.dtype, self.param_dtype = epsilon, dtype, param_dtype
        self.use_bias, self.use_scale, self.reduction_axes = use_bias, use_scale, reduction_axes
        self.axis_name, self.axis_index_groups = axis_name, axis_index_groups
        self.use_fast_variance, self.promote_dtype = use_fast_variance, promote_dtype

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        reduction_axes = F.group_reduction_axes(x.ndim, self.reduction_axes)
        x, scale, bias = self.promote_dtype((x, _value(self.scale), _value(self.bias)),
                                            dtype=self.dtype)
        mean, var = F.group_moments(x, self.num_groups, reduction_axes, dtype=self.dtype,
                                    axis_name=self.axis_name,
                                    axis_index_groups=self.axis_index_groups,
                                    use_fast_variance=self.use_fast_variance, mask=mask)
        return F.normalize(x, mean, var, scale, bias, reduction_axes=reduction_axes[:-1],
                           feature_axes=(self.feature_axis,), epsilon=self.epsilon,
                           dtype=self.dtype)


class InstanceNorm(Module):
    """Normalizes each example over every axis but the batch (axis 0) and ``feature_axes``,
    then scales and shifts per feature: ``F.moments`` and ``F.normalize`` with those axes.
    ``feature_axes`` including axis 0 is a ``ConfigError`` (flax.nnx's ``ValueError``)."""

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, use_bias: bool = True, use_scale: bool = True,
                 bias_init: Initializer = initializers.zeros,
                 scale_init: Initializer = initializers.ones,
                 feature_axes: Axes = -1, axis_name: str | None = None,
                 axis_index_groups: Sequence[Sequence[int]] | None = None,
                 use_fast_variance: bool = True,
                 promote_dtype: Callable[..., Any] = default_promote_dtype, rngs: Rngs,
                 bias_metadata: Metadata = NO_METADATA,
                 scale_metadata: Metadata = NO_METADATA):
        _learned(self, num_features, rngs, param_dtype, use_scale, scale_init, scale_metadata,
                 use_bias, bias_init, bias_metadata)
        self.num_features, self.epsilon = num_features, epsilon
        self.dtype, self.param_dtype = dtype, param_dtype
        self.use_bias, self.use_scale, self.feature_axes = use_bias, use_scale, feature_axes
        self.axis_name, self.axis_index_groups = axis_name, axis_index_groups
        self.use_fast_variance, self.promote_dtype = use_fast_variance, promote_dtype

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        feature_axes, reduction_axes = F.instance_norm_axes(x.ndim, self.feature_axes)
        x, scale, bias = self.promote_dtype((x, _value(self.scale), _value(self.bias)),
                                            dtype=self.dtype)
        mean, var = F.moments(x, reduction_axes, dtype=self.dtype, axis_name=self.axis_name,
                              axis_index_groups=self.axis_index_groups,
                              use_fast_variance=self.use_fast_variance, mask=mask)
        return F.normalize(x, mean, var, scale, bias, reduction_axes=reduction_axes,
                           feature_axes=feature_axes, epsilon=self.epsilon, dtype=self.dtype)
