"""``Module``, assembled from the concerns of this package, and the dataclass transform.

Every subclass becomes a dataclass (hash and equality over its fields, as in
Linen) and gets its methods wrapped (``Lifecycle._call_wrapped``).  A new module
takes its parent from the running module and is named and bound on the spot
(``__post_init__``).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

from varjax.ir import errors
from varjax.nn.binding import BoundRoot, Scope, TraceRoot
from varjax.nn.module.as_node import register_pytree
from varjax.nn.module.lifecycle import compact, module_stack
from varjax.nn.module.lifecycle_state import UNSPECIFIED, ModuleState
from varjax.nn.module.lifted import LiftHooks
from varjax.nn.module.tabulation import Tabulation
from varjax.nn.module.variables import VariableAPI
from varjax.trace.context import site


class Module(VariableAPI, LiftHooks, Tabulation):
    """Base class of all varjax.nn modules: Flax Linen's ``nn.Module``.

    Implements ``varjax.ir.protocols.Labelled``, ``LiftableModule`` and ``LiftableModuleClass``."""

    # The generated ``__init__`` of a subclass resolves this annotation in the subclass's
    # module (pdoc does that): every module defining a layer imports ``Module``.  Besides a
    # Module or None, ``bind``/``init``/``apply`` pass a root of ``binding`` here; no user does.
    parent: Module | None = dataclasses.field(default=UNSPECIFIED, kw_only=True, repr=False,
                                              compare=False)
    """The module this one is a child of; set by the parent's ``setup`` or ``@compact`` method
    (or ``None`` for a top-level module), as in Linen: not given by hand."""
    # The marker by which varjax.lifting.region recognises a module (``protocols.LiftableModule``):
    # lifted transforms close over a leading Module argument.
    _varjax_module = True
    name: str | None = dataclasses.field(default=None, kw_only=True)
    """The child's name in its parent (its path segment, ``Dense_0`` when not given)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A field with init=False is set in setup: it does not exist on a template, so it
        # cannot take part in equality, hashing or repr (as in Linen).
        for attr in cls.__dict__.get("__annotations__", {}):
            spec = cls.__dict__.get(attr)
            if isinstance(spec, dataclasses.Field) and not spec.init:
                spec.compare, spec.hash, spec.repr = False, False, False
        dataclasses.dataclass(cls, repr=False, eq=True, unsafe_hash="__hash__" not in cls.__dict__)
        register_pytree(cls)
        # What setup adopts submodules from, per class: fields() rebuilds its tuple per call.
        cls._varjax_adoptable_fields = tuple(
            f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("parent", "name"))
        cls._varjax_name_scope_methods = tuple(
            n for n in dir(cls) if hasattr(getattr(cls, n, None), "varjax_name_scope"))
        for attr, fn in list(cls.__dict__.items()):
            if _wrappable(attr, fn):
                setattr(cls, attr, _wrap_method(fn))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_state", ModuleState())
        object.__setattr__(self, "scope", None)
        parent = self.parent
        if parent is UNSPECIFIED:
            stack = module_stack()
            parent = stack[-1] if stack else None
            object.__setattr__(self, "parent", parent)
        if isinstance(parent, (TraceRoot, BoundRoot)):
            object.__setattr__(self, "scope", Scope(parent, ()))
            self._adopt_fields()
        elif isinstance(parent, Module):
            pstate = parent._state
            if pstate.in_setup:
                if self.name is not None:
                    parent._register_child(self, self.name)
            elif pstate.compact_depth > 0:
                name = self.name if self.name is not None else parent._autoname(type(self))
                parent._register_child(self, name)
            else:
                raise errors.AssignSubModuleError(
                    f"submodule {type(self).__name__} of {parent._label()} was constructed outside "
                    "setup() and outside an @compact method.", **site(about=parent),
                    fix="construct submodules in setup(), or decorate the method with @nn.compact")

    def _has_setup(self) -> bool:
        return super()._has_setup() or bool(type(self)._varjax_name_scope_methods)

    def _run_setup(self) -> None:
        super()._run_setup()
        names = type(self)._varjax_name_scope_methods
        if names:
            # One child per compact_name_scope method, named after it (a setup attribute,
            # so it is made again with setup).
            self._varjax_name_scopes = {
                n: CompactNameScope(getattr(type(self), n).varjax_name_scope, _returns(self), name=n)
                for n in names}


dataclasses.dataclass(Module, repr=False, eq=True, unsafe_hash=True)
register_pytree(Module)
Module._varjax_name_scope_methods = ()


# Methods of Module itself, from every class it is assembled from, are never wrapped.
_API_NAMES: frozenset[str] = frozenset(
    n for klass in Module.__mro__[:-1] for n in vars(klass) if not n.startswith("__"))


def _wrappable(attr: str, fn: Any) -> bool:
    if not inspect.isfunction(fn) or getattr(fn, "varjax_nowrap", False):
        return False
    if getattr(fn, "varjax_wrapped", False) or attr in _API_NAMES or attr == "setup":
        return False
    return attr == "__call__" or not attr.startswith("__")   # private methods too, as in Linen


def _wrap_method(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(self: Module, *args: Any, **kwargs: Any) -> Any:
        return self._call_wrapped(fn, args, kwargs)
    wrapped.varjax_wrapped = True
    return wrapped


class CompactNameScope(Module):
    """The scope of a ``compact_name_scope`` method ``fn``: calling it runs ``fn`` on the
    module ``module_fn()`` returns, with this compact child as the parent of the
    submodules ``fn`` makes inline."""

    fn: Callable[..., Any]
    module_fn: Callable[[], Module]

    @compact
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(self.module_fn(), *args, **kwargs)


def _returns(module: Module) -> Callable[[], Module]:
    return lambda: module
