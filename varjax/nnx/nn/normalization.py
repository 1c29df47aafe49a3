"""flax.nnx.nn.normalization's names, each ``varjax.nnx``'s own object."""
from __future__ import annotations

from varjax.nnx.normalization import BatchNorm, GroupNorm, InstanceNorm, LayerNorm, RMSNorm
from varjax.nnx.weight_normalization import SpectralNorm, WeightNorm

__all__ = ["BatchNorm", "GroupNorm", "InstanceNorm", "LayerNorm", "RMSNorm", "SpectralNorm",
           "WeightNorm"]
