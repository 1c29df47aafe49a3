"""``nnx.Embed``: a declaration over ``varjax.functional.embedding`` (``embed``, ``attend``).

The table ``(num_embeddings, features)`` is one ``Param`` from one ``rngs.params()`` draw,
as NNX makes it, so the same seed gives flax.nnx's table; lookup and weight-tied projection
are the shared functions Linen's ``Embed`` calls too.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from varjax.functional import initializers
from varjax.functional.embedding import attend, embed
from varjax.ir.typing import Dtype, Initializer, Metadata, ShardingLike
from varjax.nnx.call_options import no_out_sharding
from varjax.nnx.linear import NO_METADATA, functional_promote
from varjax.nnx.linear import promote_dtype as default_promote_dtype
from varjax.nnx.module import Module
from varjax.nnx.variablelib import Param
from varjax.trace.rngs import Rngs

__all__ = ["Embed"]

default_embed_init = initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


class Embed(Module):
    """A lookup table from integers in ``[0, num_embeddings)`` to ``features``-vectors;
    ``attend`` reuses it as an output projection (weight tying)."""

    def __init__(self, num_embeddings: int, features: int, *, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32,
                 embedding_init: Initializer = default_embed_init,
                 promote_dtype: Callable[..., Any] = default_promote_dtype, rngs: Rngs,
                 embedding_metadata: Metadata = NO_METADATA):
        self.embedding = Param(embedding_init(rngs.params(), (num_embeddings, features),
                                              param_dtype), **embedding_metadata)
        self.num_embeddings, self.features = num_embeddings, features
        # NNX computes in the table's dtype unless told otherwise.
        self.dtype = dtype or self.embedding.dtype
        self.param_dtype, self.promote_dtype = param_dtype, promote_dtype

    def __call__(self, inputs: jax.Array, out_sharding: ShardingLike = None) -> jax.Array:
        """The rows of the table at the integer ``inputs``."""
        no_out_sharding("Embed", out_sharding)
        return embed(inputs, self.embedding[...], dtype=self.dtype,
                     promote_dtype=functional_promote(self.promote_dtype))

    def attend(self, query: jax.Array, out_sharding: ShardingLike = None) -> jax.Array:
        """``query @ embedding.T``: logits over the vocabulary."""
        no_out_sharding("Embed.attend", out_sharding)
        return attend(query, self.embedding[...], dtype=self.dtype,
                      promote_dtype=functional_promote(self.promote_dtype))
