"""flax.nnx.nn.attention's names: the attention layer and its mask and product functions,
each ``varjax.nnx``'s own object (``dot_product_attention_weights`` too, which flax.nnx
keeps only here)."""
from __future__ import annotations

from varjax.nnx.attention import (
    MultiHeadAttention,
    combine_masks,
    dot_product_attention,
    make_attention_mask,
    make_causal_mask,
)
from varjax.nnx.attention import dot_product_attention_weights as dot_product_attention_weights

__all__ = ["MultiHeadAttention", "combine_masks", "dot_product_attention", "make_attention_mask",
           "make_causal_mask"]
