"""``WeightNorm`` and ``SpectralNorm``: wrappers that normalize another layer's weights.

Both run the wrapped ``layer_instance`` under ``nn.map_variables``, whose
``trans_in_fn`` replaces each of its parameters by a normalized copy before the
layer sees it, as Linen does.  The wrapper's own variables are named after the
wrapped variable's path (``Dense_0/kernel/scale``), so a Linen checkpoint loads
unchanged:

* ``WeightNorm``: ``w / ||w||`` over the non-feature axes, times a learned
  ``scale`` per feature (parameters of the wrapper, in ``params``);
* ``SpectralNorm``: ``w / sigma``, where ``sigma``, the largest singular value of
  ``w`` (as a matrix: leading axes flattened), is estimated by ``n_steps`` of power
  iteration from the vector ``u`` kept in ``collection_name`` (``batch_stats``).
  With ``update_stats=True`` the new ``u`` and ``sigma`` are stored: apply with
  ``mutable=['batch_stats']``.

The arithmetic on one weight is ``varjax.functional.weight_normalization``'s (``weight_norm``,
``spectral_norm``); the wrappers here choose the variables and keep the wrapper's own.

Sharp edges:
  * ``SpectralNorm`` draws its first ``u`` from the ``params`` stream at init.
  * Variables of rank 0 or 1 pass through ``SpectralNorm`` unchanged.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax
import jax.numpy as jnp

from varjax.functional import weight_normalization as F
from varjax.functional.normalization import canonical_axes
from varjax.nn import initializers
from varjax.nn.module import Module, compact, nowrap
from varjax.nn.typing import Axes, Dtype, Initializer
from varjax.transforms.calls import map_variables

__all__ = ["WeightNorm", "SpectralNorm"]


def _wrapped_name(layer: Module, path: tuple) -> str:
    """``<layer name>/<variable path inside it>``: the key path minus its collection (a boxed
    variable's value adds ``value``: ``Dense_0/kernel/value``, Linen's ``WeightNorm`` name)."""
    return layer.name + "/" + jax.tree_util.keystr(path[1:], simple=True, separator="/")


def _normal_or_zeros(key: jax.Array | None, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """``u``'s initializer.  Without a key (the variable exists, so this runs only to check
    the stored value's shape and dtype) it gives zeros of that shape."""
    return jnp.zeros(shape, dtype) if key is None else jax.random.normal(key, shape, dtype)


class WeightNorm(Module):
    """Each filtered variable ``w`` of ``layer_instance`` is used as ``scale * w / ||w||``.

    The norm is taken over every axis except ``feature_axes`` (``None``: over all
    axes, one scalar scale).  ``variable_filter`` keeps the variables whose
    ``<layer>/<path>`` contains one of its strings (default ``{'kernel'}``); an empty
    filter normalizes them all.
    """

    layer_instance: Module
    """The wrapped layer whose parameters are normalized."""
    epsilon: float = 1e-12
    """Added to the norm before dividing by it."""
    dtype: Dtype | None = None
    """The dtype of the computation (``None``: the parameter's)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the scale is created in."""
    use_scale: bool = True
    """Whether to multiply the normalized parameter by a learned scale."""
    scale_init: Initializer = initializers.ones
    """Initializer of the scale."""
    feature_axes: Axes | None = -1
    """The axes that keep their own norm and scale (``None``: one norm over the whole
    parameter)."""
    variable_filter: Iterable | None = dataclasses.field(default_factory=lambda: {"kernel"})
    """Only the wrapped layer's variables whose name contains one of these are normalized
    (``None``: every one)."""

    @compact
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return map_variables(
            lambda layer: layer(*args, **kwargs),
            trans_in_fn=lambda vs: jax.tree_util.tree_map_with_path(self._normalized, vs),
            init=self.is_initializing())(self.layer_instance)

    @nowrap
    def _normalized(self, path: tuple, value: jax.Array) -> jax.Array:
        value = jnp.asarray(value)
        name = _wrapped_name(self.layer_instance, path)
        if self.variable_filter and not any(f in name for f in self.variable_filter):
            return value
        feature_axes = () if self.feature_axes is None else canonical_axes(value.ndim, self.feature_axes)
        scale = None
        if self.use_scale:
            scale = self.param(name + "/scale", self.scale_init, tuple(value.shape[a] for a in feature_axes),
                               self.param_dtype)
        return F.weight_norm(value, scale, feature_axes=feature_axes, epsilon=self.epsilon, dtype=self.dtype)


class SpectralNorm(Module):
    """Each variable ``w`` of rank >= 2 of ``layer_instance`` is used as ``w / sigma(w)``.

    ``__call__(*args, update_stats, **kwargs)`` calls the layer; ``update_stats``
    (keyword, required) stores the power iteration's new ``u`` and ``sigma``.
    ``error_on_non_matrix`` rejects variables of rank > 2 instead of flattening
    their leading axes.
    """

    layer_instance: Module
    """The wrapped layer whose parameters are normalized."""
    n_steps: int = 1
    """Power-iteration steps per call estimating the largest singular value."""
    epsilon: float = 1e-12
    """Added to norms in the power iteration before dividing by them."""
    dtype: Dtype | None = None
    """The dtype of the computation (``None``: the parameter's)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the power iteration's state is created in."""
    error_on_non_matrix: bool = False
    """Whether a parameter of rank above 2 is an error instead of being reshaped to a matrix."""
    collection_name: str = "batch_stats"
    """The collection holding the power iteration's state (``u`` and ``sigma``)."""

    @compact
    def __call__(self, *args: Any, update_stats: bool, **kwargs: Any) -> Any:
        return map_variables(
            lambda layer: layer(*args, **kwargs),
            trans_in_fn=lambda vs: jax.tree_util.tree_map_with_path(
                lambda path, v: self._normalized(path, v, update_stats), vs),
            init=self.is_initializing(), mutable=True)(self.layer_instance)

    @nowrap
    def _normalized(self, path: tuple, value: jax.Array, update_stats: bool) -> jax.Array:
        value = jnp.asarray(value)
        shape = value.shape
        name = _wrapped_name(self.layer_instance, path)
        if not F.spectral_norm_applies(value.ndim, n_steps=self.n_steps,
                                       error_on_non_matrix=self.error_on_non_matrix,
                                       path=name.split("/")):
            return value
        rng = None if self.has_variable(self.collection_name, name + "/u") else self.make_rng("params")
        u_var = self.variable(self.collection_name, name + "/u", _normal_or_zeros, rng, (1, shape[-1]),
                              self.param_dtype)
        sigma_var = self.variable(self.collection_name, name + "/sigma", jnp.ones, (), self.param_dtype)
        value, u, sigma = F.spectral_norm(value, u_var.value, n_steps=self.n_steps, epsilon=self.epsilon,
                                          dtype=self.dtype)
        if update_stats:
            u_var.value = u
            sigma_var.value = sigma
        return value
