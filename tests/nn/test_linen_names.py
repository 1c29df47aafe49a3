"""Every public name of ``flax.linen`` is in ``varjax.nn``, or is listed here with the reason.

The test compares ``dir(flax.linen)`` with ``dir(varjax.nn)`` in both directions, so an
unexplained difference fails it: a Linen name varjax lacks must be implemented or listed in
one of the tables below, and a name varjax adds must be listed in ``EXTRA``.  A listed name
that stops being missing fails too, so the tables stay true.  Names present in both must be
the same kind of thing (class, module, function), Linen's layers must take Linen's fields
in Linen's order and their methods Linen's parameters, and functions must take Linen's
parameters (varjax may add some after them).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import types

import flax.linen as linen
import flax.linen.experimental.layers_with_named_axes  # noqa: F401

import varjax.nn as nn

# A package's dir() holds the submodules imported so far, by anyone: import them all, so
# the comparison does not depend on which other tests ran first.
for _package in (linen, nn):
    for _info in pkgutil.iter_modules(_package.__path__):
        importlib.import_module(f"{_package.__name__}.{_info.name}")

# Linen's Module API beyond the class itself: built in varjax/nn/module/, re-exported by
# varjax/nn/__init__.py.
FROM_VARJAX_NN_MODULE = [
    "Module", "compact", "nowrap", "apply", "init", "init_with_output", "merge_param",
    "compact_name_scope", "share_scope", "intercept_methods", "enable_named_call",
    "disable_named_call", "override_named_call", "tabulate",
]

# Linen names varjax does not have, with the reason.
NOT_PROVIDED = {
    "experimental": "Linen's named-axes layers (layers_with_named_axes) record axis names with the "
                    "legacy nn.partitioning.param_with_axes, whose leafless 'params_axes' variables "
                    "varjax cannot store (nn.partitioning); box the core layers' initializers "
                    "with nn.with_logical_partitioning instead",
    "kw_only_dataclasses": "Flax's backport of dataclass kw_only for Python < 3.10; use dataclasses.KW_ONLY",
}

# varjax.nn names flax.linen does not have, with the reason.
EXTRA = {
    "Scope": "the scope a bound module reads its variables through (Linen's is flax.core.Scope)",
    "custom_jvp": "lifted custom_jvp, which Linen lacks (SPEC 3.3)",
    "fori_loop": "lifted fori_loop (SPEC 3.3)",
    "pmap": "lifted pmap, on shard_map (SPEC 3.3)",
    "shard_map": "lifted shard_map (SPEC 3.3)",
    "min_pool": "Linen has it in flax.linen.pooling but does not re-export it; varjax does",
    "mish": "a jax.nn activation Linen does not re-export",
    "promote_dtype": "nn.dtypes.promote_dtype, also at the top level",
    "binding": "submodule: the roots and scopes bound modules read through",
    "einsum": "submodule holding Einsum (re-exported by nn.linear, where Linen has it)",
    "frozen_dict": "submodule holding FrozenDict, freeze and unfreeze (Linen's is flax.core.frozen_dict)",
    "recurrent_cells": "submodule holding the cells (re-exported by nn.recurrent, where Linen has them)",
    "weight_normalization": "submodule holding WeightNorm and SpectralNorm (re-exported by nn.normalization)",
    "typing": "submodule of Linen's annotation aliases (Linen's is flax.typing)",
    "serialization": "submodule: registers boxes and FrozenDict with flax.serialization when the user "
                     "imports it (varjax does not import flax)",
}

# Names in both whose signature differs from Linen's on purpose.
DIFFERENT = {
    "Variable": "varjax's variable handle is also object mode's vj.Variable(value, collection=, **metadata) "
                "(SPEC 4); Linen's is built by its scope, never by user code",
    "FrozenDict": "Linen's private __unsafe_skip_copy__ keyword is not taken",
    "named_call": "varjax's named_call(target, name, methods) lifts a module or function (SPEC 3.3); "
                  "Linen's named_call(class_fn, force) is its internal method wrapper",
    "scan": "Linen's private _split_transpose is not taken",
    **{name: "not provided: fp8 matmuls need the overwrite-with-gradient update rule (nn.fp8_ops)"
       for name in ["Fp8DirectDotGeneralOp", "Fp8DotGeneral", "Fp8DotGeneralOp", "Fp8Einsum",
                    "NANOOFp8DotGeneralOp"]},
}

# Methods of Linen's classes whose parameters differ on purpose or not yet match
# ("Class.method": reason).  Module's own are for varjax/nn/module/.
METHOD_DIFFERENT = {
    "Module.bind": "no extra positional arguments (Linen passes them to the scope and ignores them)",
    "Module.clone": "Linen's private _deep_clone and _reset_names are not taken",
    "Module.init": "passes= adds passes to the call's pipeline (issue 21)",
    "Module.init_with_output": "passes= adds passes to the call's pipeline (issue 21)",
    "Module.apply": "passes= adds passes to the call's pipeline (issue 21)",
}

# What Linen model code imports from flax.linen's submodules, by module path.
SUBMODULE_NAMES = {
    "activation": ["PReLU", "normalize", "relu", "gelu", "swish", "silu", "tanh", "sigmoid", "softmax",
                   "log_softmax", "one_hot", "standardize", "elu", "celu", "glu", "softplus"],
    "attention": ["MultiHeadDotProductAttention", "MultiHeadAttention", "SelfAttention",
                  "dot_product_attention", "dot_product_attention_weights", "make_attention_mask",
                  "make_causal_mask", "combine_masks",
                  "Dtype", "PrecisionLike", "Initializer", "PRNGKey", "Shape", "DotGeneralT"],
    "batch_apply": ["BatchApply"],
    "combinators": ["Sequential"],
    "dtypes": ["promote_dtype", "canonicalize_dtype", "Dtype"],
    "initializers": ["Initializer", "zeros", "ones", "zeros_init", "ones_init", "constant", "normal",
                     "uniform", "lecun_normal", "xavier_uniform", "glorot_normal", "he_normal",
                     "variance_scaling", "orthogonal", "truncated_normal", "delta_orthogonal"],
    "linear": ["Dense", "DenseGeneral", "Conv", "ConvLocal", "ConvTranspose", "Embed", "Einsum",
               "canonicalize_padding", "default_kernel_init", "default_embed_init", "promote_dtype",
               "PrecisionLike", "PaddingLike", "LaxPadding", "Array", "Dtype", "Initializer", "PRNGKey",
               "Shape", "DotGeneralT", "ConvGeneralDilatedT"],
    "meta": ["AxisMetadata", "Partitioned", "PARTITION_NAME", "with_partitioning", "unbox", "add_axis",
             "remove_axis", "replace_boxed", "map_axis_meta", "is_axis_metadata", "get_partition_spec",
             "get_sharding", "get_global_mesh", "global_mesh_defined"],
    "module": ["Module", "compact", "nowrap", "merge_param", "apply", "init", "init_with_output"],
    "normalization": ["BatchNorm", "LayerNorm", "RMSNorm", "GroupNorm", "InstanceNorm", "WeightNorm",
                      "SpectralNorm", "Array", "Axes", "Dtype", "Initializer", "PRNGKey", "Shape"],
    "partitioning": ["axis_rules", "get_axis_rules", "set_axis_rules", "logical_to_mesh_axes",
                     "logical_to_mesh", "with_sharding_constraint", "RulesFallback", "remat",
                     "param_with_axes", "variable_with_axes", "get_axis_names", "scan_with_axes",
                     "vmap_with_axes", "AxisMetadata", "PartitionedVariable", "core_remat_static"],
    "pooling": ["pool", "avg_pool", "max_pool", "min_pool"],
    "recurrent": ["RNNCellBase", "LSTMCell", "OptimizedLSTMCell", "GRUCell", "MGUCell", "SimpleCell",
                  "ConvLSTMCell", "DenseParams", "RNN", "RNNBase", "Bidirectional", "flip_sequences",
                  "Dtype", "Initializer", "PRNGKey", "PrecisionLike"],
    "spmd": ["LogicallyPartitioned", "with_logical_partitioning", "logical_to_mesh_axes", "logical_to_mesh",
             "logical_to_mesh_sharding", "with_logical_constraint", "RulesFallback",
             "get_logical_axis_rules"],
    "stochastic": ["Dropout"],
    "summary": ["tabulate"],
    "transforms": ["vmap", "scan", "jit", "remat", "checkpoint", "remat_scan", "map_variables", "named_call",
                   "jvp", "vjp", "grad", "value_and_grad", "custom_vjp", "while_loop", "cond", "switch",
                   "fold_rngs", "add_metadata_axis"],
}


def _public(module: types.ModuleType) -> set[str]:
    return {name for name in dir(module) if not name.startswith("_")}


def _kind(obj: object) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if inspect.isclass(obj):
        return "class"
    return "function" if callable(obj) else "value"


def _parameters(obj: object) -> list[str] | None:
    """A Linen layer's fields (without parent and name), or a function's parameter names."""
    if obj is None:
        return None
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj) if f.name not in ("parent", "name")]
    try:
        return [p.name for p in inspect.signature(obj).parameters.values()]
    except (TypeError, ValueError):
        return None


def test_every_linen_name_is_in_varjax_nn_or_listed():
    unexplained = sorted(_public(linen) - _public(nn) - set(NOT_PROVIDED))
    assert not unexplained, (f"flax.linen names missing from varjax.nn: {unexplained}. Implement them, "
                             "or list them in NOT_PROVIDED with the reason.")


def test_every_extra_varjax_nn_name_is_listed():
    unexplained = sorted(_public(nn) - _public(linen) - set(EXTRA))
    assert not unexplained, f"varjax.nn names flax.linen lacks: {unexplained}. List them in EXTRA, with why."


def test_star_import_gives_varjax_nn_all_its_public_names_but_the_submodules_python_binds():
    namespace: dict = {}
    exec("from varjax.nn import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(nn.__all__)
    bound = {n for n in _public(nn) if isinstance(getattr(nn, n), types.ModuleType)} - set(nn._SUBMODULES)
    assert bound and set(nn.__all__) == _public(nn) - bound
    assert {"Dense", "scan", "initializers", "relu"} <= set(nn.__all__) and "linear" not in nn.__all__


def test_listed_differences_are_still_true():
    stale = sorted(set(NOT_PROVIDED) & _public(nn)) + sorted(set(EXTRA) & _public(linen))
    assert not stale, f"listed as missing or extra, but no longer: {stale}. Update the tables."
    assert set(EXTRA) <= _public(nn), sorted(set(EXTRA) - _public(nn))
    assert set(NOT_PROVIDED) <= _public(linen), sorted(set(NOT_PROVIDED) - _public(linen))


def test_module_api_names_come_from_varjax_nn_module():
    missing = [name for name in FROM_VARJAX_NN_MODULE if not hasattr(nn.module, name)]
    assert not missing, f"varjax.nn.module does not export {missing} (the Module API is varjax/nn/module/)"
    stray = [name for name in FROM_VARJAX_NN_MODULE if getattr(nn, name) is not getattr(nn.module, name)]
    assert not stray, f"varjax.nn.{stray} should be varjax.nn.module's (re-export in varjax/nn/__init__.py)"


def test_common_names_are_the_same_kind_with_linen_s_parameters():
    wrong = []
    for name in sorted(_public(linen) & _public(nn)):
        ours, theirs = getattr(nn, name), getattr(linen, name)
        if _kind(ours) != _kind(theirs):
            wrong.append(f"{name}: a {_kind(ours)} here, a {_kind(theirs)} in Linen")
        elif name not in DIFFERENT and _kind(theirs) != "module" and ours is not theirs:
            want, have = _parameters(theirs), _parameters(ours)
            if want is not None and not _in_order(want, have, fields=dataclasses.is_dataclass(theirs)):
                wrong.append(f"{name}: takes {have}, Linen takes {want}")
    assert not wrong, "\n".join(wrong + ["(fix them, or list them in DIFFERENT with the reason)"])


def _in_order(want: list[str], have: list[str] | None, fields: bool) -> bool:
    """Linen's layer fields exactly; Linen's function parameters in order, extras allowed after."""
    if have is None:
        return False
    if fields:
        return want == have
    return have[:len(want)] == want


def test_listed_signature_differences_are_still_true():
    same = [name for name in DIFFERENT
            if _parameters(getattr(nn, name)) == _parameters(getattr(linen, name))]
    assert not same, f"listed in DIFFERENT but now take Linen's parameters: {same}"


def _methods(cls: type) -> list[str]:
    """The public methods (and ``__call__``) a Linen class defines, properties left out."""
    return [m for m in sorted(set(vars(cls)) | {"__call__"})
            if (m == "__call__" or not m.startswith("_")) and callable(getattr(cls, m, None))
            and not isinstance(inspect.getattr_static(cls, m, None), property)]


def test_linen_classes_methods_take_linen_s_parameters():
    wrong = []
    for name in sorted(_public(linen) & _public(nn)):
        theirs, ours = getattr(linen, name), getattr(nn, name)
        if not (inspect.isclass(theirs) and issubclass(theirs, linen.Module)) or name in DIFFERENT:
            continue
        for method in _methods(theirs):
            want, have = _parameters(getattr(theirs, method)), _parameters(getattr(ours, method, None))
            if want != have and f"{name}.{method}" not in METHOD_DIFFERENT:
                wrong.append(f"{name}.{method}: takes {have}, Linen takes {want}")
    assert not wrong, "\n".join(wrong + ["(fix them, or list them in METHOD_DIFFERENT with the reason)"])


def test_listed_method_differences_are_still_true():
    same = [key for key in METHOD_DIFFERENT
            if _parameters(getattr(getattr(nn, key.split(".")[0]), key.split(".")[1]))
            == _parameters(getattr(getattr(linen, key.split(".")[0]), key.split(".")[1]))]
    assert not same, f"listed in METHOD_DIFFERENT but now take Linen's parameters: {same}"


def test_submodule_paths_linen_code_imports_from_resolve():
    missing = [f"nn.{sub}.{name}" for sub, names in SUBMODULE_NAMES.items()
               for name in names if not hasattr(importlib.import_module(f"varjax.nn.{sub}"), name)]
    assert not missing, f"missing: {missing}"
    unknown = [f"flax.linen.{sub}.{name}" for sub, names in SUBMODULE_NAMES.items()
               for name in names if not hasattr(getattr(linen, sub), name)]   # nn.meta is an attribute
    assert not unknown, f"not Linen paths: {unknown}"


def test_nn_transforms_is_varjax_transforms():
    import varjax.transforms
    assert nn.transforms.scan is varjax.transforms.scan is nn.scan
    # plus Linen's helper for boxed metadata, which lives in flax.linen.transforms
    assert set(nn.transforms.__all__) == set(varjax.transforms.__all__) | {"add_metadata_axis"}
