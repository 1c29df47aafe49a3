"""flax.nnx.nn.attention's names: the attention layer and its mask and product functions,
each ``varjax.nnx``'s own (``reexport``)."""
from __future__ import annotations

from varjax.nnx.attention import dot_product_attention_weights as dot_product_attention_weights
from varjax.nnx.nn.reexport import nnx_name

NAMES = ("MultiHeadAttention", "combine_masks", "dot_product_attention",
         "make_attention_mask", "make_causal_mask")
# served by __getattr__ below, so the names are no globals of this module; the weights
# function, which flax.nnx keeps only here (not among its exports), is imported as it is
__all__ = list(NAMES)


def __getattr__(name: str) -> object:
    return nnx_name(__name__, NAMES, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *NAMES})
