"""varjax: neural-network variables as effects in the jaxpr.

Trace stateful code into a jaxpr whose variable reads, writes and RNG draws
are effectful primitives; rewrite it with passes; functionalize it per
collection.  This file is the whole public API.


The names below are imported on first use (PEP 562), all at once and in this order, so that
``import varjax`` costs nothing until one is touched: ``python -m varjax --help`` answers
without importing JAX.  ``_API`` is the list the interpreter uses; the ``TYPE_CHECKING``
block spells the same imports out for type checkers and editors
(``tests/tools/test_lazy_import.py`` checks that the two agree).
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# public name -> the module it comes from; ``_SUBMODULES`` are modules themselves
_SUBMODULES = ("errors", "passes")
_API: dict[str, str] = {
    "errors": "varjax.errors",
    "passes": "varjax.passes",
    "PARTITION_NAME": "varjax.axis_metadata",
    "clear_caches": "varjax.caches",
    "set_cache_size": "varjax.caches",
    "DenyList": "varjax.filters",
    "Functionalized": "varjax.functionalize",
    "functionalize": "varjax.functionalize",
    "from_tree": "varjax.lift_groups",
    "lift": "varjax.lifting",
    "to_tree": "varjax.lift_groups",
    "capture": "varjax.objects.capture",
    "transform_metadata": "varjax.objects.metadata",
    "GraphDef": "varjax.objects.state",
    "merge": "varjax.objects.state",
    "split": "varjax.objects.state",
    "state": "varjax.objects.state",
    "update": "varjax.objects.state",
    "pretty": "varjax.printing",
    "Rngs": "varjax.rngs",
    "RngStream": "varjax.rngs",
    "reseed": "varjax.rngs",
    "Variable": "varjax.scope",
    "has_variable": "varjax.scope",
    "is_initializing": "varjax.scope",
    "is_mutable_collection": "varjax.scope",
    "make_rng": "varjax.scope",
    "param": "varjax.scope",
    "sow": "varjax.scope",
    "variable": "varjax.scope",
    "dataflow": "varjax.tools.dataflow",
    "dead_params": "varjax.tools.dataflow",
    "dump": "varjax.tools.ir_dump",
    "broadcast": "varjax.transforms",
    "checkpoint": "varjax.transforms",
    "cond": "varjax.transforms",
    "custom_jvp": "varjax.transforms",
    "custom_vjp": "varjax.transforms",
    "fold_rngs": "varjax.transforms",
    "fori_loop": "varjax.transforms",
    "grad": "varjax.transforms",
    "jit": "varjax.transforms",
    "jvp": "varjax.transforms",
    "map_variables": "varjax.transforms",
    "named_call": "varjax.transforms",
    "pmap": "varjax.transforms",
    "remat": "varjax.transforms",
    "remat_scan": "varjax.transforms",
    "scan": "varjax.transforms",
    "shard_map": "varjax.transforms",
    "switch": "varjax.transforms",
    "value_and_grad": "varjax.transforms",
    "vjp": "varjax.transforms",
    "vmap": "varjax.transforms",
    "while_loop": "varjax.transforms",
}
__all__ = list(_API)
_loading = False


def _load() -> None:
    """Import every public name into this module (in ``_API``'s order)."""
    global _loading
    _loading = True
    try:
        for name, module in _API.items():
            value = importlib.import_module(module)
            globals()[name] = value if name in _SUBMODULES else getattr(value, name)
    finally:
        _loading = False


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:   # `from varjax import errors` in varjax's own modules: just that
        return importlib.import_module(f"varjax.{name}")
    if name in _API and not _loading:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'varjax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


class _Package(types.ModuleType):
    """Importing a submodule binds it on its package (``varjax.functionalize`` the module,
    before ``_load``): where a public name is such a module's, that binding is skipped, so
    the name still loads the API (``vj.functionalize`` is the function)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _API and name not in _SUBMODULES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:
    from varjax import errors as errors
    from varjax import passes as passes
    from varjax.axis_metadata import PARTITION_NAME as PARTITION_NAME
    from varjax.caches import clear_caches as clear_caches
    from varjax.caches import set_cache_size as set_cache_size
    from varjax.filters import DenyList as DenyList
    from varjax.functionalize import Functionalized as Functionalized
    from varjax.functionalize import functionalize as functionalize
    from varjax.lift_groups import from_tree as from_tree
    from varjax.lift_groups import to_tree as to_tree
    from varjax.lifting import lift as lift
    from varjax.objects.capture import capture as capture
    from varjax.objects.metadata import transform_metadata as transform_metadata
    from varjax.objects.state import GraphDef as GraphDef
    from varjax.objects.state import merge as merge
    from varjax.objects.state import split as split
    from varjax.objects.state import state as state
    from varjax.objects.state import update as update
    from varjax.printing import pretty as pretty
    from varjax.rngs import Rngs as Rngs
    from varjax.rngs import RngStream as RngStream
    from varjax.rngs import reseed as reseed
    from varjax.scope import Variable as Variable
    from varjax.scope import has_variable as has_variable
    from varjax.scope import is_initializing as is_initializing
    from varjax.scope import is_mutable_collection as is_mutable_collection
    from varjax.scope import make_rng as make_rng
    from varjax.scope import param as param
    from varjax.scope import sow as sow
    from varjax.scope import variable as variable
    from varjax.tools.dataflow import dataflow as dataflow
    from varjax.tools.dataflow import dead_params as dead_params
    from varjax.tools.ir_dump import dump as dump
    from varjax.transforms import broadcast as broadcast
    from varjax.transforms import checkpoint as checkpoint
    from varjax.transforms import cond as cond
    from varjax.transforms import custom_jvp as custom_jvp
    from varjax.transforms import custom_vjp as custom_vjp
    from varjax.transforms import fold_rngs as fold_rngs
    from varjax.transforms import fori_loop as fori_loop
    from varjax.transforms import grad as grad
    from varjax.transforms import jit as jit
    from varjax.transforms import jvp as jvp
    from varjax.transforms import map_variables as map_variables
    from varjax.transforms import named_call as named_call
    from varjax.transforms import pmap as pmap
    from varjax.transforms import remat as remat
    from varjax.transforms import remat_scan as remat_scan
    from varjax.transforms import scan as scan
    from varjax.transforms import shard_map as shard_map
    from varjax.transforms import switch as switch
    from varjax.transforms import value_and_grad as value_and_grad
    from varjax.transforms import vjp as vjp
    from varjax.transforms import vmap as vmap
    from varjax.transforms import while_loop as while_loop
