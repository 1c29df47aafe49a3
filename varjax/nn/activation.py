"""Activations: ``jax.nn`` functions, re-exported under the names Linen uses.

Nothing is re-implemented; ``tanh`` comes from ``jax.numpy`` as in Linen.
(Linen's ``PReLU`` layer, which owns a parameter, is not provided.)
"""
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
from jax.nn import tanh as tanh
