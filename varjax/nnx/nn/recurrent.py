"""flax.nnx.nn.recurrent's names, each ``varjax.nnx``'s own object.

``__all__`` lists what flax.nnx exports; the helpers ported code imports from this
submodule (``flip_sequences``, ``modified_orthogonal``, ``RNNBase``, the default
initializers) are its attributes too."""
from __future__ import annotations

from varjax.nnx.linear import default_bias_init as default_bias_init
from varjax.nnx.linear import default_kernel_init as default_kernel_init
from varjax.nnx.recurrent import (
    RNN,
    Bidirectional,
    GRUCell,
    LSTMCell,
    OptimizedLSTMCell,
    RNNCellBase,
    SimpleCell,
)
from varjax.nnx.recurrent import RNNBase as RNNBase
from varjax.nnx.recurrent import flip_sequences as flip_sequences
from varjax.nnx.recurrent import modified_orthogonal as modified_orthogonal

__all__ = ["Bidirectional", "GRUCell", "LSTMCell", "OptimizedLSTMCell", "RNN", "RNNCellBase",
           "SimpleCell"]
