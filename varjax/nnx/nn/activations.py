"""flax.nnx.nn.activations' names: the activation functions and ``PReLU``, each
``varjax.nnx``'s own object."""
from __future__ import annotations

from varjax.functional.activations import (
    celu,
    elu,
    gelu,
    glu,
    hard_sigmoid,
    hard_silu,
    hard_swish,
    hard_tanh,
    leaky_relu,
    log_sigmoid,
    log_softmax,
    logsumexp,
    one_hot,
    relu,
    relu6,
    selu,
    sigmoid,
    silu,
    soft_sign,
    softmax,
    softplus,
    standardize,
    swish,
    tanh,
)
from varjax.nnx.activation_layers import PReLU, identity

__all__ = ["PReLU", "celu", "elu", "gelu", "glu", "hard_sigmoid", "hard_silu", "hard_swish",
           "hard_tanh", "identity", "leaky_relu", "log_sigmoid", "log_softmax", "logsumexp",
           "one_hot", "relu", "relu6", "selu", "sigmoid", "silu", "soft_sign", "softmax",
           "softplus", "standardize", "swish", "tanh"]
