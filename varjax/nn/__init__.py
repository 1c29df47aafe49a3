"""``varjax.nn``: Flax Linen's API on varjax.  Port a Linen model with ``import varjax.nn as nn``."""
from varjax.filters import DenyList as DenyList
from varjax.nn import initializers as initializers
from varjax.nn.activation import *  # noqa: F403  (the jax.nn activations, by Linen's names)
from varjax.nn.module import Module as Module
from varjax.nn.module import Scope as Scope
from varjax.nn.module import apply as apply
from varjax.nn.module import compact as compact
from varjax.nn.module import init as init
from varjax.nn.module import init_with_output as init_with_output
from varjax.nn.module import nowrap as nowrap
from varjax.scope import Variable as Variable
from varjax.nn.linear import Dense as Dense
