"""flax.nnx.nn.stochastic's names, each ``varjax.nnx``'s own object."""
from __future__ import annotations

from varjax.nnx.stochastic import Dropout

__all__ = ["Dropout"]
