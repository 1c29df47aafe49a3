"""flax.nnx.nn.activations's names: the activation functions (``jax.nn``'s), ``identity``
and ``PReLU``, each ``varjax.nnx``'s own (``reexport``)."""
from __future__ import annotations

from varjax.nnx.nn.reexport import nnx_name

NAMES = ("PReLU", "celu", "elu", "gelu", "glu", "hard_sigmoid", "hard_silu", "hard_swish",
         "hard_tanh", "identity", "leaky_relu", "log_sigmoid", "log_softmax", "logsumexp",
         "one_hot", "relu", "relu6", "selu", "sigmoid", "silu", "soft_sign", "softmax",
         "softplus", "standardize", "swish", "tanh")
# served by __getattr__ below, so the names are no globals of this module
__all__ = list(NAMES)


def __getattr__(name: str) -> object:
    return nnx_name(__name__, NAMES, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *NAMES})
