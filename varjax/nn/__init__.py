"""``varjax.nn``: Flax Linen's API on varjax.  Port a Linen model with ``import varjax.nn as nn``.

Every public name of ``flax.linen`` is here, or is listed with the reason it is not in
``tests/nn/test_linen_names.py`` (see ``notes/linen-parity.md``).  The submodules carry
Linen's module paths too (``nn.linear.PrecisionLike``, ``nn.transforms.scan``).
"""
import types as _types

from varjax.ir.axis_metadata import PARTITION_NAME as PARTITION_NAME
from varjax.ir.axis_metadata import Partitioned as Partitioned
from varjax.ir.axis_metadata import get_logical_axis_rules as get_logical_axis_rules
from varjax.ir.axis_metadata import get_partition_spec as get_partition_spec
from varjax.ir.axis_metadata import get_sharding as get_sharding
from varjax.ir.axis_metadata import logical_axis_rules as logical_axis_rules
from varjax.ir.axis_metadata import set_logical_axis_rules as set_logical_axis_rules
from varjax.ir.axis_metadata import unbox as unbox
from varjax.ir.filters import DenyList as DenyList
from varjax.nn import fp8_ops as fp8_ops
from varjax.nn import initializers as initializers
from varjax.nn import meta as meta
from varjax.nn import partitioning as partitioning
from varjax.nn import spmd as spmd
from varjax.nn import summary as summary
from varjax.nn import transforms as transforms
from varjax.nn.activation import *  # noqa: F403  (the jax.nn activations by Linen's names, and PReLU)
from varjax.nn.attention import MultiHeadAttention as MultiHeadAttention
from varjax.nn.attention import MultiHeadDotProductAttention as MultiHeadDotProductAttention
from varjax.nn.attention import SelfAttention as SelfAttention
from varjax.nn.attention import combine_masks as combine_masks
from varjax.nn.attention import dot_product_attention as dot_product_attention
from varjax.nn.attention import dot_product_attention_weights as dot_product_attention_weights
from varjax.nn.attention import make_attention_mask as make_attention_mask
from varjax.nn.attention import make_causal_mask as make_causal_mask
from varjax.nn.batch_apply import BatchApply as BatchApply
from varjax.nn.combinators import Sequential as Sequential
from varjax.nn.dtypes import promote_dtype as promote_dtype
from varjax.nn.fp8_ops import Fp8DirectDotGeneralOp as Fp8DirectDotGeneralOp
from varjax.nn.fp8_ops import Fp8DotGeneral as Fp8DotGeneral
from varjax.nn.fp8_ops import Fp8DotGeneralOp as Fp8DotGeneralOp
from varjax.nn.fp8_ops import Fp8Einsum as Fp8Einsum
from varjax.nn.fp8_ops import NANOOFp8DotGeneralOp as NANOOFp8DotGeneralOp
from varjax.nn.frozen_dict import FrozenDict as FrozenDict
from varjax.nn.initializers import ones as ones
from varjax.nn.initializers import ones_init as ones_init
from varjax.nn.initializers import zeros as zeros
from varjax.nn.initializers import zeros_init as zeros_init
from varjax.nn.linear import Conv as Conv
from varjax.nn.linear import ConvLocal as ConvLocal
from varjax.nn.linear import ConvTranspose as ConvTranspose
from varjax.nn.linear import Dense as Dense
from varjax.nn.linear import DenseGeneral as DenseGeneral
from varjax.nn.linear import Einsum as Einsum
from varjax.nn.linear import Embed as Embed
from varjax.nn.meta import with_partitioning as with_partitioning
from varjax.nn.module import Module as Module
from varjax.nn.module import Scope as Scope
from varjax.nn.module import apply as apply
from varjax.nn.module import compact as compact
from varjax.nn.module import compact_name_scope as compact_name_scope
from varjax.nn.module import disable_named_call as disable_named_call
from varjax.nn.module import enable_named_call as enable_named_call
from varjax.nn.module import init as init
from varjax.nn.module import init_with_output as init_with_output
from varjax.nn.module import intercept_methods as intercept_methods
from varjax.nn.module import merge_param as merge_param
from varjax.nn.module import nowrap as nowrap
from varjax.nn.module import override_named_call as override_named_call
from varjax.nn.module import share_scope as share_scope
from varjax.nn.module import tabulate as tabulate
from varjax.nn.normalization import BatchNorm as BatchNorm
from varjax.nn.normalization import GroupNorm as GroupNorm
from varjax.nn.normalization import InstanceNorm as InstanceNorm
from varjax.nn.normalization import LayerNorm as LayerNorm
from varjax.nn.normalization import RMSNorm as RMSNorm
from varjax.nn.normalization import SpectralNorm as SpectralNorm
from varjax.nn.normalization import WeightNorm as WeightNorm
from varjax.nn.pooling import avg_pool as avg_pool
from varjax.nn.pooling import max_pool as max_pool
from varjax.nn.pooling import min_pool as min_pool
from varjax.nn.pooling import pool as pool
from varjax.nn.recurrent import RNN as RNN
from varjax.nn.recurrent import Bidirectional as Bidirectional
from varjax.nn.recurrent import ConvLSTMCell as ConvLSTMCell
from varjax.nn.recurrent import GRUCell as GRUCell
from varjax.nn.recurrent import LSTMCell as LSTMCell
from varjax.nn.recurrent import MGUCell as MGUCell
from varjax.nn.recurrent import OptimizedLSTMCell as OptimizedLSTMCell
from varjax.nn.recurrent import RNNCellBase as RNNCellBase
from varjax.nn.recurrent import SimpleCell as SimpleCell
from varjax.nn.spmd import LogicallyPartitioned as LogicallyPartitioned
from varjax.nn.spmd import logical_to_mesh as logical_to_mesh
from varjax.nn.spmd import logical_to_mesh_axes as logical_to_mesh_axes
from varjax.nn.spmd import logical_to_mesh_sharding as logical_to_mesh_sharding
from varjax.nn.spmd import with_logical_constraint as with_logical_constraint
from varjax.nn.spmd import with_logical_partitioning as with_logical_partitioning
from varjax.nn.stochastic import Dropout as Dropout
from varjax.nn.transforms import add_metadata_axis as add_metadata_axis
from varjax.trace.variable_api import Variable as Variable
from varjax.transforms import *  # noqa: F403  (the lifted transforms, as in flax.linen)

_SUBMODULES = ("fp8_ops", "initializers", "meta", "partitioning", "spmd", "summary", "transforms")
# Everything imported above by name or by star, and the submodules imported as themselves;
# not the submodules Python binds here on import (``linear``, ``module``, ...).
__all__ = sorted(name for name, value in globals().items() if not name.startswith("_")
                 and (not isinstance(value, _types.ModuleType) or name in _SUBMODULES))
