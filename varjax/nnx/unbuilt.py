"""The flax.nnx names ``varjax.nnx`` has not built yet, and why each is missing.

Each name resolves (``nnx.jit``, ``from varjax.nnx import split``) to ``NotProvidedError``
saying which part of the NNX frontend it belongs to, rather than ``AttributeError``: ported
code fails at the line that asks for it, with the reason.  A name leaves this table when it
is built; ``tests/nnx/test_nnx_names.py`` compares the table with ``dir(flax.nnx)``.
"""
from __future__ import annotations

from typing import NoReturn

from varjax.trace.unprovided import not_provided

__all__ = ["NOT_YET", "missing"]

_PARTS = {
    "an nnx transform (issue 35, part 4); until then vj.jit, vj.grad, vj.vmap and the other "
    "object-mode transforms take NNX modules": (
        "jit_partial", "cached_partial", "pmap", "shard_map", "make_jaxpr", "capture",
        "transform_metadata", "prefix", "StateAxes", "StateSharding", "compat", "checkify", "call", "use_eager_sharding",
        "using_eager_sharding", "proxy_caller"),
    "graph and state (issue 35, part 3); until then vj.split, vj.merge, vj.state and "
    "vj.update take NNX modules": (
        "unpack", "to_tree",
        "from_tree", "GraphState", "PureState", "recursive_map", "split_context", "merge_context",
        "update_context", "current_update_context", "SplitContext", "MergeContext",
        "UpdateContext", "NodeStates", "flatten",
        "unflatten", "graphlib",

        "extract", "pure", "as_pure", "as_abstract", "get_abstract_model",
        "abstract_with_sharding", "vars_as", "with_vars", "check_pytree", "has_data",
        "is_data", "register_data_type", "Data", "Static", "dataclass", "traversals", "tracers",
        "variables", "pytreelib", "object", "module", "variablelib", "reprlib"),
    "randomness beyond Rngs (issue 35, part 2): with_rngs needs string filters that match "
    "streams by tag, and RngStream.split/broadcast": ("with_rngs",),
    "training (issue 35, part 5): TrainState needs GraphDef.apply": (
        "TrainState", "training"),
    "a Variable or module helper (issue 35, part 1)": (
        "register_variable_name", "var_defaults", "with_metadata", "set_metadata",
        "VariableMetadata", "view", "view_info", "with_attributes", "display", "tabulate",
        "summary", "visualization", "iter_module_children", "PARTITION_NAME",
        "get_partition_spec", "get_named_sharding", "with_partitioning", "logical_axis_rules",
        "spmd", "A", "M", "Initializer", "helpers",
        "deprecations", "wrappers", "bridge"),
}

# Every other public name of flax.nnx 0.12.8 is a layer or layer function: the layers issue.
_LAYERS = (
    "Bidirectional", "ConvTranspose", "EMA", "Einsum", "GRUCell", "GroupNorm", "InstanceNorm",
    "LSTMCell", "LinearGeneral", "LoRA", "LoRALinear", "MultiHeadAttention",
    "OptimizedLSTMCell", "PReLU", "RMSNorm", "RNN", "RNNCellBase", "Sequential", "SimpleCell",
    "SpectralNorm", "WeightNorm", "avg_pool", "combine_masks", "dot_product_attention",
    "identity", "make_attention_mask", "make_causal_mask", "max_pool", "min_pool", "nn",
    "pool")

NOT_YET: dict[str, str] = {
    **{name: why for why, names in _PARTS.items() for name in names},
    **{name: "a layer (the varjax.nnx layers issue, 36)" for name in _LAYERS},
}


def missing(name: str, module: str) -> NoReturn:
    """``NotProvidedError`` for a name of ``NOT_YET``, else ``AttributeError``.  Only
    names that are not submodules get here: a submodule (``varjax.nnx.graph``) is imported
    by the package's ``__getattr__`` before it asks."""
    if name in NOT_YET:
        not_provided(f"nnx.{name}", f"not built yet: it is {NOT_YET[name]}.",
                     "see notes/nnx.md for what varjax.nnx has now", by="varjax.nnx")
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
