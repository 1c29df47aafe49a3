"""Reparametrized weights: ``weight_norm`` (``scale * w / ||w||``) and ``spectral_norm``
(``w / sigma(w)`` by power iteration).

These normalize a layer's *weights*, not its activations.  The wrappers that apply them to
another layer's variables, and keep the learned scale and the power iteration's vector, are
frontend code (Linen's ``WeightNorm``/``SpectralNorm`` run the wrapped layer under
``map_variables``); the arithmetic on one weight is here.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from varjax.functional.dtypes import canonicalize_dtype, promote_dtype
from varjax.ir import errors

__all__ = ["l2_normalize", "weight_norm", "spectral_norm", "spectral_norm_applies"]


def l2_normalize(x: jax.Array, axis: Any = None, eps: float = 1e-12) -> jax.Array:
    """``x / ||x||`` over ``axis`` (all axes if None), with ``eps`` inside the root."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + eps)


def weight_norm(w: jax.Array, scale: jax.Array | None = None, *, feature_axes: tuple[int, ...] = (),
                epsilon: float = 1e-12, dtype: Any = None) -> jax.Array:
    """``w / ||w||`` over every axis but the (canonical) ``feature_axes``, times ``scale``
    (shaped like those axes) when given; cast to ``dtype`` or the promotion of ``w`` and
    ``scale``."""
    reduction_axes = tuple(a for a in range(w.ndim) if a not in feature_axes)
    normalized = l2_normalize(w, axis=reduction_axes, eps=epsilon)
    dtype_args = [w]
    if scale is not None:
        scale = jnp.reshape(scale, tuple(w.shape[a] if a in feature_axes else 1 for a in range(w.ndim)))
        normalized = jnp.multiply(*promote_dtype(normalized, scale, inexact=False))
        dtype_args.append(scale)
    return jnp.asarray(normalized, canonicalize_dtype(*dtype_args, dtype=dtype))


def spectral_norm(w: jax.Array, u: jax.Array, *, n_steps: int = 1, epsilon: float = 1e-12,
                  dtype: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(w / sigma, u', sigma)``: ``sigma`` is ``w``'s largest singular value (``w`` as a matrix,
    leading axes flattened), estimated by ``n_steps`` of power iteration from ``u``
    (``(1, w.shape[-1])``); ``u'`` is the iteration's new vector, to start the next call from.

    ``u'`` and the iteration's other vector are ``stop_gradient``: only ``w`` is differentiated.
    """
    shape = w.shape
    u, w = promote_dtype(u, jnp.reshape(w, (-1, shape[-1])) if w.ndim > 2 else w, inexact=False)
    for _ in range(n_steps):
        v = l2_normalize(u @ w.T, eps=epsilon)
        u = l2_normalize(v @ w, eps=epsilon)
    u, v = lax.stop_gradient(u), lax.stop_gradient(v)
    sigma = (v @ w @ u.T)[0, 0]
    w = w / jnp.where(sigma != 0, sigma, jnp.ones((), sigma.dtype))
    return jnp.asarray(jnp.reshape(w, shape), canonicalize_dtype(w, u, v, sigma, dtype=dtype)), u, sigma


def spectral_norm_applies(ndim: int, *, n_steps: int, error_on_non_matrix: bool,
                          path: Sequence[str] | None = None) -> bool:
    """Whether SpectralNorm normalizes a weight of rank ``ndim``: not a vector or a scalar,
    and nothing when ``n_steps < 1``.  A weight of more than 2 dimensions is flattened to a
    matrix, or refused when ``error_on_non_matrix``: a ``ConfigError`` (a ``ValueError``, as
    Flax raises) naming the weight's ``path``, at the user's line.  One rule for both
    frontends."""
    if ndim <= 1 or n_steps < 1:
        return False
    if ndim > 2 and error_on_non_matrix:
        raise errors.ConfigError(
            f"Layer instance parameter is {ndim}D but error_on_non_matrix is True.", path=path,
            **errors.where(),
            fix="pass error_on_non_matrix=False to SpectralNorm to flatten its leading axes")
    return True
