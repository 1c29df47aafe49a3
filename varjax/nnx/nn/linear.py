"""flax.nnx.nn.linear's names: the linear, contraction, convolution and embedding
layers, each ``varjax.nnx``'s own object.

``__all__`` lists what flax.nnx exports; the defaults and ``canonicalize_padding`` that
ported code imports from this submodule are its attributes too."""
from __future__ import annotations

from varjax.functional.convolution import canonicalize_padding as canonicalize_padding
from varjax.nnx.convolution import Conv, ConvTranspose
from varjax.nnx.einsum import Einsum
from varjax.nnx.embedding import Embed
from varjax.nnx.embedding import default_embed_init as default_embed_init
from varjax.nnx.linear import Linear, LinearGeneral
from varjax.nnx.linear import default_bias_init as default_bias_init
from varjax.nnx.linear import default_kernel_init as default_kernel_init

__all__ = ["Conv", "ConvTranspose", "Einsum", "Embed", "Linear", "LinearGeneral"]
