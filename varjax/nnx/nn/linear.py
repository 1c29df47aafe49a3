"""flax.nnx.nn.linear's names: the linear, contraction, convolution and embedding
layers, each ``varjax.nnx``'s own object."""
from __future__ import annotations

from varjax.nnx.convolution import Conv, ConvTranspose
from varjax.nnx.einsum import Einsum
from varjax.nnx.embedding import Embed
from varjax.nnx.linear import Linear, LinearGeneral

__all__ = ["Conv", "ConvTranspose", "Einsum", "Embed", "Linear", "LinearGeneral"]
