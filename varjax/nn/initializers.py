"""Initializers: ``jax.nn.initializers``, re-exported under the names Linen uses.

They live in ``varjax.functional.initializers`` (shared with ``varjax.nnx``), with Linen's
``zeros_init()`` / ``ones_init()`` factories.
"""
from varjax.functional.initializers import Initializer as Initializer
from varjax.functional.initializers import constant as constant
from varjax.functional.initializers import delta_orthogonal as delta_orthogonal
from varjax.functional.initializers import glorot_normal as glorot_normal
from varjax.functional.initializers import glorot_uniform as glorot_uniform
from varjax.functional.initializers import he_normal as he_normal
from varjax.functional.initializers import he_uniform as he_uniform
from varjax.functional.initializers import kaiming_normal as kaiming_normal
from varjax.functional.initializers import kaiming_uniform as kaiming_uniform
from varjax.functional.initializers import lecun_normal as lecun_normal
from varjax.functional.initializers import lecun_uniform as lecun_uniform
from varjax.functional.initializers import normal as normal
from varjax.functional.initializers import ones as ones
from varjax.functional.initializers import ones_init as ones_init
from varjax.functional.initializers import orthogonal as orthogonal
from varjax.functional.initializers import truncated_normal as truncated_normal
from varjax.functional.initializers import uniform as uniform
from varjax.functional.initializers import variance_scaling as variance_scaling
from varjax.functional.initializers import xavier_normal as xavier_normal
from varjax.functional.initializers import xavier_uniform as xavier_uniform
from varjax.functional.initializers import zeros as zeros
from varjax.functional.initializers import zeros_init as zeros_init
