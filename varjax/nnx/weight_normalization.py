"""``nnx.WeightNorm`` and ``nnx.SpectralNorm``: wrappers that normalize another layer's
weights in place before calling it, over ``varjax.functional.weight_normalization``.

As in flax.nnx 0.12.8, each call writes the normalized weight *into* the wrapped layer's
Variable (so after a call ``layer_instance.kernel`` holds the normalized kernel, and the next
call normalizes that again), then calls the layer.  The wrapper's own state is keyed by the
wrapped Variable's path inside the layer, flax.nnx's layout: ``WeightNorm.scales`` a dict of
plain arrays (``{('kernel',): ...}``: not ``Param``s, so ``nnx.grad`` does not train them, as
in flax.nnx), ``SpectralNorm.batch_stats`` a dict of ``BatchStat``s
(``{('kernel', 'u'): ..., ('kernel', 'sigma'): ...}``), so ``nnx.state`` paths and values
match flax.nnx's bit for bit from the same seed.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from varjax.functional import initializers
from varjax.functional import weight_normalization as F
from varjax.functional.normalization import canonical_axes
from varjax.ir import errors
from varjax.ir.typing import Axes, Dtype, Filter, Initializer, PathParts, PyTree
from varjax.nnx.filterlib import PathContains, to_predicate
from varjax.nnx.graph import state
from varjax.nnx.linear import promote_dtype as default_promote_dtype
from varjax.nnx.module import Module
from varjax.nnx.pytree import data
from varjax.nnx.state_ops import to_flat_state
from varjax.nnx.variablelib import BatchStat, Param
from varjax.trace.rngs import Rngs
from varjax.trace.variable import Variable

__all__ = ["WeightNorm", "SpectralNorm", "WrappedLayerChangedError"]


class WrappedLayerChangedError(errors.MissingVariableError, RuntimeError):
    """A wrapped layer has a weight the wrapper keeps no state for (a Variable added to it
    after the wrapper was built).  Also a ``RuntimeError``, as flax.nnx raises."""


def _changed(wrapper: str, path: PathParts, what: str) -> WrappedLayerChangedError:
    return WrappedLayerChangedError(
        f"{wrapper} has no {what} for the wrapped layer's Variable at this path: the layer's "
        "weights changed after the wrapper was built.", path=[str(p) for p in path],
        **errors.where(), fix=f"build the {wrapper} over the layer once it has all its weights")


def _store(variable: Variable, value: jax.Array) -> None:
    """``variable[...] = value`` cast to the Variable's dtype first, so a ``bfloat16`` ``u``
    stays one when the iteration ran in float32, as in flax.nnx.  ``v[...] = x`` alone would
    cast through ``.at[...].set``, which JAX refuses under ``jax_numpy_dtype_promotion=
    'strict'`` and warns about (a ``FutureWarning``) under ``'standard'``: flax.nnx's own
    call warns there."""
    variable[...] = jnp.asarray(value, variable.dtype)


class WeightNorm(Module):
    """Wraps ``layer_instance``: each call replaces each of its Variables that
    ``variable_filter`` selects (the kernel by default) by ``scale * w / ||w||``, the norm over
    every axis but ``feature_axes`` (``F.weight_norm``), then calls the layer.

    ``scales`` holds one plain array per selected ``Param`` (of the ``feature_axes``' shape),
    made by ``scale_init(rngs['params'], shape)`` as flax.nnx makes it: the stream itself is
    the key argument, so no key is drawn and an initializer that needs one (``normal()``)
    fails with JAX's ``TypeError``, as in flax.nnx.  ``param_dtype`` and ``promote_dtype``
    are kept as attributes for flax.nnx's signature; flax.nnx 0.12.8 uses neither.
    """

    def __init__(self, layer_instance: Module, *, feature_axes: Axes | None = -1,
                 use_scale: bool = True, scale_init: Initializer = initializers.ones,
                 epsilon: float = 1e-12, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32,
                 variable_filter: Filter = PathContains("kernel"),
                 promote_dtype: Callable[..., Any] = default_promote_dtype, rngs: Rngs):
        self.layer_instance = layer_instance
        self.feature_axes = () if feature_axes is None else feature_axes
        self.use_scale, self.scale_init, self.epsilon = use_scale, scale_init, epsilon
        self.dtype, self.param_dtype = dtype, param_dtype
        self.variable_filter = to_predicate(variable_filter)
        self.promote_dtype = promote_dtype
        self.scales = data({
            path: scale_init(rngs["params"], self._feature_shape(param.shape))
            for path, param in to_flat_state(state(layer_instance, Param))
            if self.variable_filter(path, param)}) if use_scale else None

    def _feature_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(shape[a] for a in canonical_axes(len(shape), self.feature_axes))

    def __call__(self, x: jax.Array, *args: PyTree, **kwargs: PyTree) -> PyTree:
        for path, variable in to_flat_state(state(self.layer_instance)):
            if isinstance(variable, Variable) and self.variable_filter(path, variable):
                self._normalize_in_place(path, variable)
        return self.layer_instance(x, *args, **kwargs)

    def _normalize_in_place(self, path: PathParts, variable: Variable) -> None:
        scale = None
        if self.use_scale:
            if path not in self.scales:
                raise _changed("WeightNorm", path, "scale")
            scale = self.scales[path]
        w = variable[...]
        feature_axes = canonical_axes(w.ndim, self.feature_axes)
        # A replacement, flax.nnx's ``set_value``: the result may take ``dtype``.
        variable.value = F.weight_norm(w, scale, feature_axes=feature_axes,
                                       epsilon=self.epsilon, dtype=self.dtype)


class SpectralNorm(Module):
    """Wraps ``layer_instance``: each call divides each of its ``Param``s of 2 or more
    dimensions by its largest singular value, estimated by ``n_steps`` of power iteration
    (``F.spectral_norm``; leading axes flattened unless ``error_on_non_matrix``), then calls
    the layer.

    ``batch_stats`` holds per weight the iteration's vector ``u`` (``(1, out)``, drawn
    ``normal()`` from one ``rngs.params()`` key per weight, in path order) and the last
    ``sigma``, both ``BatchStat``s of ``param_dtype``; with ``update_stats`` (the call's
    argument, else ``not use_running_average``, which ``train()``/``eval()`` set) the call
    writes them back, so the estimate improves from call to call.
    """

    def __init__(self, layer_instance: Module, *, n_steps: int = 1, epsilon: float = 1e-12,
                 dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
                 error_on_non_matrix: bool = False, update_stats: bool = True, rngs: Rngs):
        self.layer_instance, self.n_steps, self.epsilon = layer_instance, n_steps, epsilon
        self.dtype, self.param_dtype = dtype, param_dtype
        self.error_on_non_matrix = error_on_non_matrix
        self.use_running_average = not update_stats
        batch_stats: dict[PathParts, BatchStat] = {}
        for path, param in to_flat_state(state(layer_instance, Param)):
            if not self._applies(path, param.ndim):
                continue
            key = rngs.params()
            batch_stats[path + ("u",)] = BatchStat(
                initializers.normal()(key, (1, param.shape[-1]), param_dtype))
            batch_stats[path + ("sigma",)] = BatchStat(initializers.ones(key, (), param_dtype))
        self.batch_stats = data(batch_stats)

    def _applies(self, path: PathParts, ndim: int) -> bool:
        return F.spectral_norm_applies(ndim, n_steps=self.n_steps,
                                       error_on_non_matrix=self.error_on_non_matrix,
                                       path=[str(p) for p in path])

    def __call__(self, x: jax.Array, update_stats: bool | None = None) -> PyTree:
        if update_stats is None:
            update_stats = not self.use_running_average
        for path, param in to_flat_state(state(self.layer_instance, Param)):
            if self._applies(path, param.ndim):
                self._normalize_in_place(path, param, update_stats)
        return self.layer_instance(x)

    def _normalize_in_place(self, path: PathParts, param: Param, update_stats: bool) -> None:
        u_path, sigma_path = path + ("u",), path + ("sigma",)
        for stat in (u_path, sigma_path):
            if stat not in self.batch_stats:
                raise _changed("SpectralNorm", path, f"{stat[-1]} batch stat")
        w, u, sigma = F.spectral_norm(param[...], self.batch_stats[u_path][...],
                                      n_steps=self.n_steps, epsilon=self.epsilon,
                                      dtype=self.dtype)
        if update_stats:
            _store(self.batch_stats[u_path], u)
            _store(self.batch_stats[sigma_path], sigma)
        _store(param, w)
