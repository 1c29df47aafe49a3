"""Embedding lookups: ``embed`` (integers to rows of a table) and ``attend`` (the table reused
as an output projection, for weight tying).

The table comes in as an array, so each frontend declares it as it declares parameters.
``embed`` returns NaN rows for indices ``>= num_embeddings`` (``jnp.take``'s fill mode), and
negative indices count from the end, as Linen's and NNX's ``Embed`` do.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from varjax.functional import dtypes

__all__ = ["embed", "attend"]

PromoteDtype = Callable[..., list[Any]]


def embed(indices: jax.Array, embedding: jax.Array, *, dtype: Any = None,
          promote_dtype: PromoteDtype = dtypes.promote_dtype) -> jax.Array:
    """The rows of ``embedding`` (``(num_embeddings, features)``) at the integer ``indices``."""
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise ValueError(f"Embed input must have an integer dtype, got {indices.dtype}.")
    (embedding,) = promote_dtype(embedding, dtype=dtype, inexact=False)
    if embedding.shape[0] == 1:
        return jnp.broadcast_to(embedding, indices.shape + (embedding.shape[-1],))
    return jnp.take(embedding, indices, axis=0)


def attend(query: jax.Array, embedding: jax.Array, *, dtype: Any = None,
           promote_dtype: PromoteDtype = dtypes.promote_dtype) -> jax.Array:
    """``query @ embedding.T``: logits over the vocabulary."""
    query, embedding = promote_dtype(query, embedding, dtype=dtype)
    return jnp.dot(query, embedding.T)
