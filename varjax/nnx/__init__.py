"""``varjax.nnx``: Flax NNX by one import, on varjax's IR (SPEC §6; ``notes/nnx.md``).
``from varjax import nnx`` in place of ``from flax import nnx``: modules and Variables,
``Rngs`` (varjax's, which derives NNX's keys bit for bit) and the RNG helpers, the graph and
state functions with NNX's filters, every transform in graph and tree mode on the
object-mode transforms, training, the layer library (declarations over
``varjax.functional``) and the bridge to ``varjax.nn``.  A flax.nnx name not built exists
and raises ``NotProvidedError`` saying which part it belongs to (``unbuilt.py``).
"""
from __future__ import annotations

import importlib
import importlib.util
import typing

from varjax.functional import initializers as initializers
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
from varjax.nnx import filterlib, graph, metrics, optimizer, rnglib, statelib, training, transforms
from varjax.nnx import unbuilt as _unbuilt
from varjax.nnx.abstract import abstract_with_sharding, as_abstract, get_abstract_model
from varjax.nnx.activation_layers import PReLU, identity
from varjax.nnx.attention import (
    MultiHeadAttention,
    combine_masks,
    dot_product_attention,
    make_attention_mask,
    make_causal_mask,
)
from varjax.nnx.batching import vmap
from varjax.nnx.capturing import capture
from varjax.nnx.combinators import Sequential
from varjax.nnx.compilation import cached_partial, checkify, jit_partial, make_jaxpr
from varjax.nnx.config import set_graph_mode, set_graph_updates
from varjax.nnx.contexts import (
    MergeContext,
    SplitContext,
    UpdateContext,
    current_update_context,
    merge_context,
    split_context,
    update_context,
)
from varjax.nnx.control import cond, eval_shape, fori_loop, switch, while_loop
from varjax.nnx.convolution import Conv, ConvTranspose
from varjax.nnx.differentiation import custom_vjp, jvp, vjp
from varjax.nnx.eager_sharding import use_eager_sharding, using_eager_sharding
from varjax.nnx.einsum import Einsum
from varjax.nnx.ema import EMA
from varjax.nnx.embedding import Embed
from varjax.nnx.extract import NodeStates, from_tree, to_tree
from varjax.nnx.filter_maps import StateSharding
from varjax.nnx.filterlib import All, Any, Everything, Not, Nothing, OfType, PathContains, WithTag
from varjax.nnx.graph import (
    GraphDef,
    GraphState,
    PureState,
    clone,
    flatten,
    graphdef,
    merge,
    replace_by_pure_dict,
    split,
    state,
    to_pure_dict,
    unflatten,
    unpack,
    update,
)
from varjax.nnx.iteration import Carry, scan
from varjax.nnx.linear import Linear, LinearGeneral
from varjax.nnx.lora import LoRA, LoRALinear
from varjax.nnx.metrics import Metric, MultiMetric
from varjax.nnx.module import Module, iter_children, iter_modules
from varjax.nnx.module_helpers import (
    M,
    display,
    iter_module_children,
    set_metadata,
    tabulate,
    view,
    view_info,
    with_attributes,
)
from varjax.nnx.normalization import BatchNorm, GroupNorm, InstanceNorm, LayerNorm, RMSNorm
from varjax.nnx.optimizer import ModelAndOptimizer, OptArray, Optimizer, OptVariable
from varjax.nnx.pooling import avg_pool, max_pool, min_pool, pool
from varjax.nnx.prefixes import prefix
from varjax.nnx.proxy_caller import call
from varjax.nnx.pytree import (
    Data,
    Dict,
    List,
    Object,
    Pytree,
    Static,
    check_pytree,
    data,
    dataclass,
    has_data,
    is_data,
    register_data_type,
    static,
)
from varjax.nnx.recurrent import (
    RNN,
    Bidirectional,
    GRUCell,
    LSTMCell,
    OptimizedLSTMCell,
    RNNCellBase,
    SimpleCell,
)
from varjax.nnx.rnglib import fork_rngs, reseed, restore_rngs, split_rngs, with_rngs
from varjax.nnx.sharding_transforms import pmap, shard_map, transform_metadata
from varjax.nnx.spmd import (
    PARTITION_NAME,
    Initializer,
    get_named_sharding,
    get_partition_spec,
    logical_axis_rules,
    with_partitioning,
)
from varjax.nnx.state_axes import StateAxes
from varjax.nnx.state_ops import (
    as_pure,
    filter_state,
    find_duplicates,
    from_flat_state,
    iter_graph,
    map,
    map_state,
    merge_state,
    pop,
    pure,
    recursive_map,
    restore_int_paths,
    split_state,
    to_flat_state,
    vars_as,
    with_vars,
)
from varjax.nnx.statelib import FlatState, State
from varjax.nnx.stochastic import Dropout
from varjax.nnx.training import TrainState
from varjax.nnx.transforms import DiffState, grad, jit, remat, value_and_grad
from varjax.nnx.variablelib import (
    A,
    BatchStat,
    Cache,
    Intermediate,
    LoRAParam,
    OptState,
    Param,
    Perturbation,
    RngCount,
    RngKey,
    RngState,
    Variable,
    VariableMetadata,
    register_variable_name,
    var_defaults,
    variable_name_from_type,
    variable_type_from_name,
    with_metadata,
)
from varjax.nnx.weight_normalization import SpectralNorm, WeightNorm
from varjax.trace.rngs import Rngs, RngStream

# flax.nnx's other name for ``state`` (its Variable module is ``variablelib``, as here)
variables = state

__all__ = [
    "unpack", "GraphState", "PureState", "flatten", "unflatten", "recursive_map", "as_pure",
    "pure", "with_vars", "vars_as", "split_context", "merge_context", "update_context",
    "current_update_context", "SplitContext", "MergeContext", "UpdateContext", "to_tree",
    "from_tree", "NodeStates", "Data", "Static", "dataclass", "register_data_type", "is_data",
    "has_data", "check_pytree", "as_abstract", "abstract_with_sharding", "get_abstract_model",
    "graphlib", "extract", "traversals",
    "set_graph_mode", "set_graph_updates", "with_rngs", "TrainState", "training",
    "StateAxes", "StateSharding", "prefix", "jit_partial", "cached_partial", "make_jaxpr",
    "checkify", "call", "capture",
    "shard_map", "pmap", "transform_metadata", "use_eager_sharding", "using_eager_sharding",
    "compat", "proxy_caller", "var_defaults", "with_metadata", "VariableMetadata",
    "register_variable_name", "A", "M", "view", "view_info", "with_attributes", "display",
    "iter_module_children", "set_metadata", "tabulate", "PARTITION_NAME", "get_partition_spec",
    "get_named_sharding", "with_partitioning", "logical_axis_rules", "Initializer", "spmd",
    "module", "variables", "variablelib",
    "rnglib", "split_rngs", "fork_rngs", "restore_rngs", "reseed",
    "pop", "to_flat_state", "from_flat_state", "merge_state", "map_state", "split_state",
    "filter_state", "iter_graph", "find_duplicates", "map", "restore_int_paths", "FlatState",
    "metrics", "optimizer", "Optimizer", "ModelAndOptimizer", "OptArray", "OptVariable", "Metric",
    "MultiMetric",
    "scan", "Carry", "jvp", "vjp", "custom_vjp",
    "vmap", "cond", "switch", "while_loop", "fori_loop", "eval_shape",
    "transforms", "jit", "grad", "value_and_grad", "remat", "DiffState",
    "graph", "statelib", "filterlib", "split", "merge", "state", "update", "clone", "graphdef",
    "GraphDef", "State", "to_pure_dict", "replace_by_pure_dict", "All", "Any", "Not", "Nothing",
    "Everything", "OfType", "PathContains", "WithTag",
    "Module", "Pytree", "Object", "List", "Dict", "data", "static", "iter_modules",
    "iter_children", "Variable", "Param", "BatchStat", "Cache", "Intermediate", "Perturbation",
    "OptState", "LoRAParam", "RngState", "RngKey", "RngCount", "variable_name_from_type",
    "variable_type_from_name", "Rngs", "RngStream", "Linear", "Conv", "Embed", "LayerNorm",
    "BatchNorm", "Dropout", "initializers",
    "LinearGeneral", "Einsum", "ConvTranspose", "RMSNorm", "GroupNorm", "InstanceNorm",
    "WeightNorm", "SpectralNorm", "RNNCellBase", "LSTMCell", "OptimizedLSTMCell", "GRUCell",
    "SimpleCell", "RNN", "Bidirectional", "Sequential", "LoRA", "LoRALinear", "PReLU", "EMA",
    "identity", "pool", "avg_pool", "max_pool", "min_pool", "nn", "bridge",
    "MultiHeadAttention", "dot_product_attention", "make_attention_mask", "make_causal_mask",
    "combine_masks",
    "celu", "elu", "gelu", "glu", "hard_sigmoid", "hard_silu", "hard_swish", "hard_tanh",
    "leaky_relu", "log_sigmoid", "log_softmax", "logsumexp", "one_hot", "relu", "relu6", "selu",
    "sigmoid", "silu", "soft_sign", "softmax", "softplus", "standardize", "swish", "tanh",
]


def __getattr__(name: str) -> typing.Any:
    # ``from varjax.nnx import <submodule>`` asks for the attribute before importing it.
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    return _unbuilt.missing(name, __name__)


def __dir__() -> list[str]:
    return sorted({*__all__, *_unbuilt.NOT_YET})
