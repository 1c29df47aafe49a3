"""varjax: neural-network variables as effects in the jaxpr.

Every variable read, write and RNG draw of a model is a primitive in its jaxpr; passes
rewrite that program, and functionalization turns it into a pure JAX function per
collection.  Where to start, by task:

- **Port a Flax Linen model**: ``import varjax.nn as nn`` in place of ``flax.linen``
  (`varjax.nn`).  The same layers and ``init``/``apply``; parameters are bitwise Flax's
  from the same seed.
- **Port a Flax NNX model**: ``from varjax import nnx`` in place of ``from flax import nnx``
  (`varjax.nnx`).
- **Train with objects instead of variable dicts** (object mode): a Linen module bound with
  ``bind(variables, rngs=vj.Rngs(dropout=1), mutable=True)``, or objects holding `Variable`
  and `Rngs`.  `jit`, `grad`, `value_and_grad`, `vmap`, `scan`, `cond`, ... take such
  objects as arguments and write their updates back; `split`, `merge`, `state` and
  `update` move between an object and its arrays.  Called inside a Linen module, the same
  transforms are Linen's lifted ones (``nn.jit`` is `jit`).
- **Rewrite what a model computes**: a pass of `varjax.passes` (`varjax.passes.Lora`,
  `varjax.passes.CastParams`, `varjax.passes.FakeQuant`, `varjax.passes.StopGradient`,
  `varjax.passes.Tie`, or one you write) runs on the program when given as ``passes=`` to
  ``init``/``apply``, `functionalize` or a transform.
- **Write a model as a plain function**: `param`, `variable`, `make_rng` and `sow` in a
  function wrapped by `functionalize` give it Linen's ``init``/``apply``.
- **See the program**: `pretty` and `dump` print its IR, `dataflow` and `dead_params`
  say which variables feed what; ``python -m varjax dump`` does it from the shell.
- **Read a signature**: an annotation names what a parameter takes; the kinds that are no
  single class (``PyTree``, ``Dtype``, ``CollectionFilter``, ``Passes``, ``Filter``, ...) are
  aliases of ``varjax.typing`` (its page: `varjax.ir.typing`), each saying what to pass.
- **Read an error**: every error is a class of ``varjax.errors`` (its page:
  `varjax.ir.errors`) and names the variable's collection and path and the line of yours
  that caused it.

The guides are the ``notes/`` folder of the repository (``notes/object-mode.md``,
``notes/writing-passes.md``, ``notes/linen-parity.md``, ``notes/nnx.md``).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

# The names below are imported on first use (PEP 562), all at once and in this order, so that
# ``import varjax`` costs nothing until one is touched: ``python -m varjax --help`` answers
# without importing JAX.  ``_API`` is the list the interpreter uses; the ``TYPE_CHECKING``
# block spells the same imports out for type checkers and editors
# (``tests/tools/test_lazy_import.py`` checks that the two agree).
#
# public name -> the module it comes from; ``_SUBMODULES`` are modules themselves
_SUBMODULES = ("errors", "passes", "typing")
_API: dict[str, str] = {
    "errors": "varjax.ir.errors",
    "passes": "varjax.passes",
    "typing": "varjax.ir.typing",
    "PARTITION_NAME": "varjax.ir.axis_metadata",
    "clear_caches": "varjax.ir.caches",
    "set_cache_size": "varjax.ir.caches",
    "DenyList": "varjax.ir.filters",
    "Functionalized": "varjax.functionalization.functionalized",
    "functionalize": "varjax.functionalization.functionalized",
    "group_to_variables": "varjax.lifting.groups",
    "lift": "varjax.lifting.region",
    "variables_to_group": "varjax.lifting.groups",
    "capture": "varjax.objects.capture",
    "transform_metadata": "varjax.objects.metadata",
    "GraphDef": "varjax.objects.split_merge",
    "merge": "varjax.objects.split_merge",
    "split": "varjax.objects.split_merge",
    "state": "varjax.objects.split_merge",
    "update": "varjax.objects.split_merge",
    "pretty": "varjax.ir.printing",
    "tracing_only": "varjax.trace.raw_writes",
    "Rngs": "varjax.trace.rngs",
    "RngStream": "varjax.trace.rngs",
    "reseed": "varjax.trace.rngs",
    "Variable": "varjax.trace.variable",
    "has_variable": "varjax.trace.variable_api",
    "is_initializing": "varjax.trace.variable_api",
    "is_mutable_collection": "varjax.trace.variable_api",
    "make_rng": "varjax.trace.variable_api",
    "param": "varjax.trace.variable_api",
    "sow": "varjax.trace.variable_api",
    "variable": "varjax.trace.variable_api",
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
        return importlib.import_module(_API[name])
    if name in _API and not _loading:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'varjax' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The API and the module's dunders: not the helpers this file imports (``sys``,
    ``importlib``) nor the submodules importing binds here (``varjax.ir``, ...)."""
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__") and n.endswith("__")})


# Modules that moved into the layer folders, at the import paths the notes once showed:
# the old path loads the module itself (one object under two names).
_MOVED = {
    "varjax.errors": "varjax.ir.errors",
    "varjax.primitives": "varjax.ir.primitives",
    "varjax.nested": "varjax.ir.nested",
    "varjax.streams": "varjax.ir.streams",
    "varjax.passes.cast_params": "varjax.passes.library.cast_params",
    "varjax.passes.lora": "varjax.passes.library.lora",
    "varjax.passes.options": "varjax.passes.framework.options",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of ``_MOVED`` and answers it with the module at the new one."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.util.spec_from_loader(name, self) if name in _MOVED else None

    def create_module(self, spec: Any) -> types.ModuleType:
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.append(_Moved())


if TYPE_CHECKING:
    from varjax import passes as passes
    from varjax.functionalization.functionalized import Functionalized as Functionalized
    from varjax.functionalization.functionalized import functionalize as functionalize
    from varjax.ir import errors as errors
    from varjax.ir import typing as typing
    from varjax.ir.axis_metadata import PARTITION_NAME as PARTITION_NAME
    from varjax.ir.caches import clear_caches as clear_caches
    from varjax.ir.caches import set_cache_size as set_cache_size
    from varjax.ir.filters import DenyList as DenyList
    from varjax.ir.printing import pretty as pretty
    from varjax.lifting.groups import group_to_variables as group_to_variables
    from varjax.lifting.groups import variables_to_group as variables_to_group
    from varjax.lifting.region import lift as lift
    from varjax.objects.capture import capture as capture
    from varjax.objects.metadata import transform_metadata as transform_metadata
    from varjax.objects.split_merge import GraphDef as GraphDef
    from varjax.objects.split_merge import merge as merge
    from varjax.objects.split_merge import split as split
    from varjax.objects.split_merge import state as state
    from varjax.objects.split_merge import update as update
    from varjax.tools.dataflow import dataflow as dataflow
    from varjax.tools.dataflow import dead_params as dead_params
    from varjax.tools.ir_dump import dump as dump
    from varjax.trace.raw_writes import tracing_only as tracing_only
    from varjax.trace.rngs import Rngs as Rngs
    from varjax.trace.rngs import RngStream as RngStream
    from varjax.trace.rngs import reseed as reseed
    from varjax.trace.variable import Variable as Variable
    from varjax.trace.variable_api import has_variable as has_variable
    from varjax.trace.variable_api import is_initializing as is_initializing
    from varjax.trace.variable_api import is_mutable_collection as is_mutable_collection
    from varjax.trace.variable_api import make_rng as make_rng
    from varjax.trace.variable_api import param as param
    from varjax.trace.variable_api import sow as sow
    from varjax.trace.variable_api import variable as variable
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
