"""Dropout given a key: zeroes a random fraction ``rate`` of ``x`` and rescales the rest.

Kept entries are scaled by ``1 / (1 - rate)`` so the expected output equals the input, which
is why evaluation can skip dropout altogether.  Where the key comes from (Linen's
``make_rng('dropout')``, NNX's ``rngs.dropout()``) is the frontend's business; the mask
drawn from a given key is the same in both.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["dropout"]


def dropout(x: jax.Array, rate: float, key: jax.Array | None, *, broadcast_dims: Sequence[int] = ()
            ) -> jax.Array:
    """``x`` with each entry kept with probability ``1 - rate`` (and scaled), else zero.

    ``broadcast_dims`` share one mask entry along those axes (e.g. the time axis, for the
    same mask at every step).  ``rate`` 0 returns ``x`` and ``rate`` 1 zeros; neither draws,
    so ``key`` may then be None.
    """
    if rate == 0.0:
        return x
    if rate == 1.0:
        # keep_prob would be 0: avoid the 0/0 of rescaling.
        return jnp.zeros_like(x)
    keep_prob = 1.0 - rate
    mask_shape = list(x.shape)
    for dim in broadcast_dims:
        mask_shape[dim] = 1
    keep = jnp.broadcast_to(jax.random.bernoulli(key, p=keep_prob, shape=mask_shape), x.shape)
    return lax.select(keep, x / keep_prob, jnp.zeros_like(x))
