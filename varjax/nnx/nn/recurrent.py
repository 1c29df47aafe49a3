"""flax.nnx.nn.recurrent's names, each ``varjax.nnx``'s own object."""
from __future__ import annotations

from varjax.nnx.recurrent import (
    RNN,
    Bidirectional,
    GRUCell,
    LSTMCell,
    OptimizedLSTMCell,
    RNNCellBase,
    SimpleCell,
)

__all__ = ["Bidirectional", "GRUCell", "LSTMCell", "OptimizedLSTMCell", "RNN", "RNNCellBase",
           "SimpleCell"]
