"""Activations: ``varjax.functional.activations`` (``jax.nn``'s functions under the names Linen
uses) re-exported, and ``PReLU``.

``PReLU`` is a layer, not a function: its negative slope is a learned parameter, applied by
``varjax.functional.prelu``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from varjax.functional.activations import celu as celu
from varjax.functional.activations import elu as elu
from varjax.functional.activations import gelu as gelu
from varjax.functional.activations import glu as glu
from varjax.functional.activations import hard_sigmoid as hard_sigmoid
from varjax.functional.activations import hard_silu as hard_silu
from varjax.functional.activations import hard_swish as hard_swish
from varjax.functional.activations import hard_tanh as hard_tanh
from varjax.functional.activations import leaky_relu as leaky_relu
from varjax.functional.activations import log_sigmoid as log_sigmoid
from varjax.functional.activations import log_softmax as log_softmax
from varjax.functional.activations import logsumexp as logsumexp
from varjax.functional.activations import mish as mish
from varjax.functional.activations import normalize as normalize
from varjax.functional.activations import one_hot as one_hot
from varjax.functional.activations import prelu
from varjax.functional.activations import relu as relu
from varjax.functional.activations import relu6 as relu6
from varjax.functional.activations import selu as selu
from varjax.functional.activations import sigmoid as sigmoid
from varjax.functional.activations import silu as silu
from varjax.functional.activations import soft_sign as soft_sign
from varjax.functional.activations import softmax as softmax
from varjax.functional.activations import softplus as softplus
from varjax.functional.activations import standardize as standardize
from varjax.functional.activations import swish as swish
from varjax.functional.activations import tanh as tanh
from varjax.nn.module import Module, compact
from varjax.nn.typing import Dtype

__all__ = ["PReLU", "celu", "elu", "gelu", "glu", "hard_sigmoid", "hard_silu", "hard_swish", "hard_tanh",
           "leaky_relu", "log_sigmoid", "log_softmax", "logsumexp", "mish", "normalize", "one_hot", "relu",
           "relu6", "selu", "sigmoid", "silu", "soft_sign", "softmax", "softplus", "standardize", "swish",
           "tanh"]


class PReLU(Module):
    """``x`` where ``x >= 0``, else ``negative_slope * x``, with ``negative_slope`` a scalar
    parameter (created as ``negative_slope_init`` in ``param_dtype``, applied in ``x``'s dtype)."""

    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    negative_slope_init: float = 0.01
    """Initial value of the learned slope for negative inputs."""

    @compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        slope = self.param("negative_slope",
                           lambda _key: jnp.asarray(self.negative_slope_init, self.param_dtype))
        return prelu(inputs, slope)
