"""Pooling: ``pool``, ``max_pool``, ``avg_pool``, ``min_pool`` (functions, no variables).

Linen exports them as ``nn.max_pool`` and so on (``varjax.nn.pooling`` re-exports these);
NNX uses the same functions, so they live below both frontends.

Inputs are channels-last, ``(*batch, *spatial, features)`` with
``len(spatial) == len(window_shape)``; the window slides over the spatial axes
only.  Any number of batch axes is allowed, including none.

Sharp edges:
  * ``padding`` is ``'SAME'``, ``'VALID'`` (the default) or one ``(low, high)``
    pair per spatial axis.  Padded positions hold the reduction's identity
    (``-inf`` for max, ``0`` for sums).
  * ``avg_pool(count_include_pad=True)`` divides by the full window size even
    where the window overlaps padding; ``False`` divides by the number of real
    entries.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from varjax.functional.dtypes import promote_dtype
from varjax.ir.typing import ArrayLike

__all__ = ["pool", "max_pool", "avg_pool", "min_pool"]

Padding = str | Sequence[tuple[int, int]]


def pool(inputs: jax.Array, init: ArrayLike, reduce_fn: Callable, window_shape: Sequence[int],
         strides: Sequence[int] | None, padding: Padding) -> jax.Array:
    """Reduces ``inputs`` with ``reduce_fn`` over sliding spatial windows (``lax.reduce_window``).

    ``init`` must be ``reduce_fn``'s identity.  ``strides`` default to 1.
    """
    window_shape = tuple(window_shape)
    strides = tuple(strides) if strides else (1,) * len(window_shape)
    if len(strides) != len(window_shape):
        raise ValueError(f"strides {strides} must have one entry per window axis {window_shape}.")
    n_batch = inputs.ndim - len(window_shape) - 1
    if n_batch < 0:
        raise ValueError(f"inputs of shape {inputs.shape} have too few axes for window {window_shape} "
                         "plus a feature axis.")
    if not isinstance(padding, str):
        padding = tuple(tuple(p) for p in padding)
        if len(padding) != len(window_shape) or any(len(p) != 2 for p in padding):
            raise ValueError(f"padding {padding} must be one (low, high) pair per window axis "
                             f"{window_shape}.")
        padding = ((0, 0),) * n_batch + padding + ((0, 0),)
    ones = (1,) * n_batch
    return lax.reduce_window(inputs, init, reduce_fn, ones + window_shape + (1,), ones + strides + (1,),
                             padding)


def avg_pool(inputs: jax.Array, window_shape: Sequence[int], strides: Sequence[int] | None = None,
             padding: Padding = "VALID", count_include_pad: bool = True) -> jax.Array:
    """Mean over each window; see the module docstring for ``count_include_pad``."""
    y = pool(inputs, 0.0, lax.add, window_shape, strides, padding)
    if count_include_pad:
        return y / math.prod(window_shape)
    # Count the real entries in each window by pooling ones of the spatial
    # shape (size 1 on batch and feature axes, broadcast on division).
    n_batch = inputs.ndim - len(window_shape) - 1
    ones = jnp.ones((1,) * n_batch + inputs.shape[n_batch:-1] + (1,), jnp.float32)
    return jnp.divide(*promote_dtype(y, pool(ones, 0.0, lax.add, window_shape, strides, padding),
                                     inexact=False))


def max_pool(inputs: jax.Array, window_shape: Sequence[int], strides: Sequence[int] | None = None,
             padding: Padding = "VALID") -> jax.Array:
    """Maximum over each window."""
    return pool(inputs, -jnp.inf, lax.max, window_shape, strides, padding)


def min_pool(inputs: jax.Array, window_shape: Sequence[int], strides: Sequence[int] | None = None,
             padding: Padding = "VALID") -> jax.Array:
    """Minimum over each window."""
    return pool(inputs, jnp.inf, lax.min, window_shape, strides, padding)
