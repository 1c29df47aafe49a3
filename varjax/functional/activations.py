"""Activations: ``jax.nn``'s functions under the names Linen and NNX use, and ``prelu``.

Nothing is re-implemented; ``tanh`` comes from ``jax.numpy`` as in Linen, and
``normalize`` is Linen's old name for ``standardize``.  ``mish`` is exported too
(``jax.nn`` has it; Linen does not re-export it).  Both frontends re-export these, so
``nn.relu is nnx.relu``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.nn import celu as celu
from jax.nn import elu as elu
from jax.nn import gelu as gelu
from jax.nn import glu as glu
from jax.nn import hard_sigmoid as hard_sigmoid
from jax.nn import hard_silu as hard_silu
from jax.nn import hard_swish as hard_swish
from jax.nn import hard_tanh as hard_tanh
from jax.nn import leaky_relu as leaky_relu
from jax.nn import log_sigmoid as log_sigmoid
from jax.nn import log_softmax as log_softmax
from jax.nn import logsumexp as logsumexp
from jax.nn import mish as mish
from jax.nn import one_hot as one_hot
from jax.nn import relu as relu
from jax.nn import relu6 as relu6
from jax.nn import selu as selu
from jax.nn import sigmoid as sigmoid
from jax.nn import silu as silu
from jax.nn import soft_sign as soft_sign
from jax.nn import softmax as softmax
from jax.nn import softplus as softplus
from jax.nn import standardize as standardize
from jax.nn import swish as swish
from jax.numpy import tanh as tanh

__all__ = ["celu", "elu", "gelu", "glu", "hard_sigmoid", "hard_silu", "hard_swish", "hard_tanh", "leaky_relu",
           "log_sigmoid", "log_softmax", "logsumexp", "mish", "normalize", "one_hot", "prelu", "relu",
           "relu6", "selu", "sigmoid", "silu", "soft_sign", "softmax", "softplus", "standardize", "swish",
           "tanh"]

normalize = standardize


def prelu(x: jax.Array, negative_slope: jax.Array) -> jax.Array:
    """``x`` where ``x >= 0``, else ``negative_slope * x``; the slope (a learned scalar in
    ``PReLU``) is cast to ``x``'s dtype, so a float32 slope keeps a bfloat16 activation."""
    return jnp.where(x >= 0, x, jnp.asarray(negative_slope, x.dtype) * x)
