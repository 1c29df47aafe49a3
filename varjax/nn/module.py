"""``Module``: Flax Linen's module system, on varjax's IR.

A module is a frozen dataclass: a template holding construction arguments and
no state.  ``init`` / ``apply`` are ``vj.functionalize`` of a function that
clones the template, binds the clone to the running trace and calls the
method.  A bound module has a ``Scope`` (its root and its path); every
``self.param`` / ``self.variable`` / ``self.make_rng`` is the path-based
operation of ``varjax.scope`` on the active trace, so the variables a module
touches are ordinary ``var_get`` / ``var_set`` equations whose path starts
with the module path (``params:Dense_0/kernel``).  Each wrapped method call also
enters ``jax.named_scope(<module name>)``, so every equation it traces carries
the module in its name stack.

Lifecycle (see ``notes/modules.md``):
  * submodules get their parent from the module whose ``setup`` or ``@compact``
    method is running (a thread-local stack); in ``setup`` they are named by
    the attribute they are assigned to (``layers_0`` for lists), in a compact
    method by class and construction order (``Dense_0``), or by ``name=``;
  * ``setup`` runs lazily, on the first method call or attribute miss of a
    bound module; top-level templates never run it;
  * a module bound by ``init``/``apply`` may be used only under that trace
    (``InvalidScopeError`` afterwards);
  * ``bind`` makes a root that owns concrete variables (``binding.BoundRoot``).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from typing import Any, Callable, Mapping

import jax

from varjax import errors, filters, scope, streams
from varjax.caches import LRU
from varjax.functionalize import Functionalized, flatten_variables, unflatten_variables
from varjax.nn.binding import BoundRoot, BoundVariable, Scope, TraceRoot
from varjax.primitives import Path
from varjax.scope import Variable
from varjax.statics import typed

DEFAULT_INIT_MUTABLE = filters.DenyList(["intermediates"])


class _Unspecified:
    def __repr__(self) -> str:
        return "<parent from context>"


_UNSPECIFIED = _Unspecified()


def compact(fn: Callable) -> Callable:
    """Marks the one method of a class that may define submodules and variables inline."""
    fn.varjax_compact = True
    return fn


def nowrap(fn: Callable) -> Callable:
    """Marks a helper method that must not be wrapped (no setup, no scope, no name)."""
    fn.varjax_nowrap = True
    return fn


# --- per-instance lifecycle state ----------------------------------------------------------

@dataclasses.dataclass
class _State:
    in_setup: bool = False
    setup_done: bool = False
    setup_version: int = -1
    compact_depth: int = 0
    # A bound module's variable operation run from outside any trace (``Module._eager``).
    eager_op: bool = False
    cursor: dict[str, int] = dataclasses.field(default_factory=dict)
    # Reserved names (Linen's reservations): submodule names, and (collection, name) of
    # variables, declared by setup and by the current call of the compact method (which
    # starts from setup's).  A submodule's name is taken in every collection.
    setup_names: set[str] = dataclasses.field(default_factory=set)
    call_names: set[str] = dataclasses.field(default_factory=set)
    setup_vars: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    call_vars: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    setup_attrs: list[str] = dataclasses.field(default_factory=list)
    # Lifted classes (``_varjax_lift_class``) whose transform is running on this instance.
    lifting: set[type] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(frozen=True)
class _SetupSnapshot:
    """What ``setup`` made on one module, kept while a lifted body runs setup again."""

    done: bool
    version: int
    attrs: dict[str, Any]
    order: list[str]
    setup_names: set[str]
    setup_vars: set[tuple[str, str]]
    call_names: set[str]
    call_vars: set[tuple[str, str]]


_local = threading.local()


def _module_stack() -> list["Module"]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _replace_submodules(value: Any, adopt: Callable[["Module", str], "Module"], name: str) -> Any:
    if isinstance(value, Module):
        return adopt(value, name)
    if isinstance(value, (list, tuple)):
        items = [_replace_submodules(x, adopt, f"{name}_{i}") for i, x in enumerate(value)]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict):
        return {k: _replace_submodules(x, adopt, f"{name}_{k}") for k, x in value.items()}
    return value


# Methods of Module itself are never wrapped.
_API_NAMES: set[str] = set()


class Module:
    """Base class of all varjax.nn modules: Flax Linen's ``nn.Module``."""

    parent: Any = dataclasses.field(default=_UNSPECIFIED, kw_only=True, repr=False, compare=False)
    # Lifted transforms close over a leading Module argument (varjax.lifting.is_module).
    _varjax_module = True
    name: str | None = dataclasses.field(default=None, kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(cls, repr=False, eq=True, unsafe_hash="__hash__" not in cls.__dict__)
        compacts = [n for n in dir(cls) if getattr(getattr(cls, n, None), "varjax_compact", False)]
        if len(compacts) > 1:
            raise errors.ModuleError(
                f"{cls.__name__} has more than one @compact method ({', '.join(compacts)}).",
                module=f"{cls.__name__} (unbound)", source=errors.source_text(),
                fix="keep one @compact method; define submodules for the others in setup")
        for attr, fn in list(cls.__dict__.items()):
            if _wrappable(attr, fn):
                setattr(cls, attr, _wrap_method(fn))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_state", _State())
        object.__setattr__(self, "scope", None)
        parent = self.parent
        if parent is _UNSPECIFIED:
            stack = _module_stack()
            parent = stack[-1] if stack else None
            object.__setattr__(self, "parent", parent)
        if isinstance(parent, (TraceRoot, BoundRoot)):
            object.__setattr__(self, "scope", Scope(parent, ()))
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
                    "setup() and outside an @compact method.", **scope.where(about=parent),
                    fix="construct submodules in setup(), or decorate the method with @nn.compact")

    # -- naming and registration ----------------------------------------------------------
    def _label(self) -> str:
        """The module in error messages: its scope as JAX's name stack shows it (the root's
        class, then submodule names) and its class, ``MLP/hidden (Dense)``; the root is
        ``MLP``, a module that is not bound ``Dense (unbound)`` (see ``varjax.errors``)."""
        if self.scope is None:
            return f"{type(self).__name__} (unbound)"
        root = self
        while root.scope.path and isinstance(root.parent, Module) and root.parent.scope is not None:
            root = root.parent
        head = () if root.scope.path else (root._scope_name(),)
        text = "/".join(head + self.scope.path)
        return f"{text} ({type(self).__name__})" if self.scope.path else text

    def _autoname(self, cls: type) -> str:
        prefix = cls.__name__
        n = self._state.cursor.get(prefix, 0)
        self._state.cursor[prefix] = n + 1
        return f"{prefix}_{n}"

    def _register_child(self, child: "Module", name: str) -> None:
        if self.scope is None:
            raise errors.UnboundModuleError(
                f"submodule {name} cannot be added to {self._label()}, which is not bound.",
                **scope.where(about=self),
                fix="call the module through init/apply/bind")
        state = self._state
        if name in state.call_names:
            raise errors.NameInUseError(
                f"the name '{name}' is used by two submodules of {self._label()}.",
                path=self.scope.path + (name,), **scope.where(about=self),
                fix="give the submodules distinct name= arguments")
        taken = sorted(c for c, n in state.call_vars if n == name)
        if taken:
            raise errors.NameInUseError(
                f"submodule '{name}' of {self._label()} has the name of a variable in "
                f"collection '{taken[0]}'.", collection=taken[0], path=self.scope.path + (name,),
                **scope.where(about=self), fix="rename the submodule or the variable")
        state.call_names.add(name)
        if state.in_setup:
            state.setup_names.add(name)
        object.__setattr__(child, "name", name)
        object.__setattr__(child, "scope", Scope(self.scope.root, self.scope.path + (name,)))

    def _reserve_variable(self, what: str, collection: str, name: str, anywhere: bool = False) -> None:
        """Takes variable ``name`` of ``collection`` for this call, as Linen's reservations do:
        declaring it twice, under a submodule's name, or (unless ``anywhere``: ``sow``)
        outside setup and compact methods raises (one declaration would silently win
        otherwise)."""
        state = self._state
        path = self._path(name)
        if not (anywhere or state.in_setup or state.compact_depth or state.eager_op):
            raise errors.ModuleError(
                f"{what} '{name}' of {self._label()} is declared outside setup() and outside an "
                "@compact method.", collection=collection, path=path, **scope.where(about=self),
                fix="declare it in setup(), or decorate the method with @nn.compact")
        if name in state.call_names:
            raise errors.NameInUseError(
                f"{what} '{name}' of {self._label()} has the name of a submodule.",
                collection=collection, path=path, **scope.where(about=self),
                fix=f"rename the {what} or the submodule")
        key = (collection, name)
        if key in state.call_vars:
            raise errors.NameInUseError(
                f"{what} '{name}' of {self._label()} is declared twice in collection "
                f"'{collection}'" + (" (in setup and again in the call)."
                                     if key in state.setup_vars and not state.in_setup else "."),
                collection=collection, path=path, **scope.where(about=self),
                fix="declare it once and keep the value (or handle) the declaration returns, "
                    "or give the second one another name")
        state.call_vars.add(key)
        if state.in_setup:
            state.setup_vars.add(key)

    def _adopt(self, child: "Module", name: str) -> "Module":
        """A module held by a field or assigned in setup becomes a child named ``name``."""
        if child.scope is not None:
            return child                      # already bound elsewhere: shared, not copied
        if child.parent is self:              # constructed in our setup without name=
            self._register_child(child, name)
            return child
        # One unbound instance held in several places is adopted once, where it is first
        # met, and shared after that (Linen's sharing by reference).  The field's name wins
        # over a name= the instance was built with, as in Linen.
        adopted = self.scope.root.adopted
        hit = adopted.get(id(child))
        if hit is not None and hit[0] is child:
            return hit[1]
        clone = dataclasses.replace(child, parent=self, name=name)
        if clone.scope is None:
            self._register_child(clone, clone.name)
        adopted[id(child)] = (child, clone)
        return clone

    def __setattr__(self, attr: str, value: Any) -> None:
        state = self.__dict__.get("_state")
        if state is None:                     # the dataclass constructor
            object.__setattr__(self, attr, value)
            return
        if not state.in_setup:
            raise errors.FrozenModuleError(
                f"cannot set attribute '{attr}' of {self._label()}: modules are frozen "
                "dataclasses outside setup().", **scope.where(about=self),
                fix="assign attributes in setup(), or make it a dataclass field")
        value = _replace_submodules(value, self._adopt, attr)
        object.__setattr__(self, attr, value)
        state.setup_attrs.append(attr)

    def __getattr__(self, attr: str) -> Any:
        # Only called when normal lookup fails: run setup once, then look again.
        state = self.__dict__.get("_state")
        if (attr.startswith("__") or state is None or self.__dict__.get("scope") is None
                or state.in_setup):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{attr}'")
        self._try_setup()
        if attr in self.__dict__:
            return self.__dict__[attr]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{attr}'")

    # -- setup --------------------------------------------------------------------------
    def setup(self) -> None:
        """Override to define submodules and variables; runs lazily once bound."""

    def _try_setup(self) -> None:
        state = self._state
        if self.scope is None or state.in_setup:
            return
        root = self.scope.root
        if state.setup_done and state.setup_version == root.version:
            return
        if root.lifted_bodies:        # inside a lifted body: put things back when it ends
            kept = root.lifted_bodies[-1]
            if id(self) not in kept:
                kept[id(self)] = (self, self._snapshot_setup())
        self._reset_setup()
        state.in_setup = True
        stack = _module_stack()
        stack.append(self)
        try:
            for field in dataclasses.fields(self):
                if field.name not in ("parent", "name"):
                    value = getattr(self, field.name)
                    adopted = _replace_submodules(value, self._adopt, field.name)
                    if adopted is not value:
                        object.__setattr__(self, field.name, adopted)
            # Errors name this module while its setup runs (also when a parent's attribute
            # access runs it lazily).
            ctx = scope.active()
            previous_module = ctx.module if ctx is not None else None
            if ctx is not None:
                ctx.module = self
            try:
                with jax.named_scope(self._scope_name()):
                    self.setup()
            finally:
                if ctx is not None:
                    ctx.module = previous_module
        finally:
            stack.pop()
            state.in_setup = False
            state.setup_done = True
            state.setup_version = self.scope.root.version

    def _reset_setup(self) -> None:
        """Forget what setup made, so it runs again (a new trace, or new bound variables)."""
        state = self._state
        for attr in state.setup_attrs:
            self.__dict__.pop(attr, None)
        state.setup_attrs = []
        state.setup_names, state.call_names = set(), set()
        state.setup_vars, state.call_vars = set(), set()
        state.setup_done = False

    def _snapshot_setup(self) -> _SetupSnapshot:
        state = self._state
        return _SetupSnapshot(state.setup_done, state.setup_version,
                              {a: self.__dict__[a] for a in state.setup_attrs if a in self.__dict__},
                              list(state.setup_attrs), set(state.setup_names),
                              set(state.setup_vars), set(state.call_names), set(state.call_vars))

    def _restore_setup(self, snap: _SetupSnapshot) -> None:
        """Back to ``snap``: the attributes, names and version setup had before a lifted body
        ran it again (so no value traced inside the body stays behind on the module)."""
        state = self._state
        for attr in state.setup_attrs:
            self.__dict__.pop(attr, None)
        self.__dict__.update(snap.attrs)
        state.setup_attrs = list(snap.order)
        state.setup_done, state.setup_version = snap.done, snap.version
        state.setup_names, state.setup_vars = set(snap.setup_names), set(snap.setup_vars)
        state.call_names, state.call_vars = set(snap.call_names), set(snap.call_vars)

    def _scope_name(self) -> str:
        return self.name or type(self).__name__

    # -- wrapped method calls --------------------------------------------------------------
    def _call_wrapped(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        is_compact = getattr(fn, "varjax_compact", False)
        sc = self.scope
        if sc is None:
            if is_compact:
                raise errors.UnboundModuleError(
                    f"the @compact method {fn.__name__} was called on {self._label()}.",
                    **scope.where(about=self),
                    fix="call it through module.init / module.apply (or module.bind)")
            return fn(self, *args, **kwargs)
        if sc.eager():
            return sc.root.run(self, fn, args, kwargs)
        ctx = sc.context(self, f"{type(self).__name__}.{fn.__name__}")
        previous_module, ctx.module = ctx.module, self
        if not getattr(fn, "varjax_lifted", False):   # a lifted one sets up in its body
            self._try_setup()
        state = self._state
        if is_compact and state.compact_depth == 0:
            state.cursor.clear()
            state.call_names, state.call_vars = set(state.setup_names), set(state.setup_vars)
        stack = _module_stack()
        stack.append(self)
        state.compact_depth += is_compact
        label = self._scope_name() if fn.__name__ == "__call__" else f"{self._scope_name()}.{fn.__name__}"
        try:
            with jax.named_scope(label):
                out = fn(self, *args, **kwargs)
        finally:
            stack.pop()
            state.compact_depth -= is_compact
            ctx.module = previous_module
        capture = sc.root.capture
        if capture is not None and capture(self, fn.__name__):
            self.sow("intermediates", fn.__name__, out)
        return out

    # -- lifted transforms (the hooks varjax.lifting and varjax.transforms call) ------------
    def _varjax_bodies(self, bodies: tuple[Callable, ...]) -> tuple[Callable, ...]:
        """``body(self, ...)`` for each body of one lifted call.

        Each body starts by running setup, under a version of the root no module has been
        set up in, as a method call on Linen's clone of the module inside the transform
        does: setup's variables exist even when the body touches no attribute, and they
        have their lifted shapes.  Names reserved inside start from setup's.  When the body
        ends, every module that ran setup inside it gets back the attributes, reserved
        names and version it had before (no value traced in the body stays behind), and
        this module gets back the caller's reservations.

        A body may be traced more than once (a peeled scan step), and a call may have
        several bodies (the branches of a cond); every trace starts from the naming state
        the first one saw, so inline submodules get the same names in each."""
        state = self._state
        first: list[tuple] = []

        def bind(body: Callable) -> Callable:
            def run(*args: Any, **kwargs: Any) -> Any:
                in_setup = state.in_setup      # a lifted call inside setup shares its names
                caller = (set(state.call_names), set(state.call_vars))
                if first:
                    cursor, names = first[0]
                    state.cursor = dict(cursor)
                    if in_setup:
                        state.call_names, state.call_vars, state.setup_names, state.setup_vars = (
                            set(x) for x in names)
                else:
                    first.append((dict(state.cursor), (*caller, set(state.setup_names),
                                                      set(state.setup_vars))))
                root = self.scope.root
                version = root.version
                root.version = root.new_version()
                root.lifted_bodies.append({})
                try:
                    if not in_setup:
                        self._try_setup()
                        state.call_names = set(state.setup_names)
                        state.call_vars = set(state.setup_vars)
                    return body(self, *args, **kwargs)
                finally:
                    for module, snap in reversed(list(root.lifted_bodies.pop().values())):
                        module._restore_setup(snap)
                    root.version = version
                    if not in_setup:
                        state.call_names, state.call_vars = caller
            run.__name__ = getattr(body, "__name__", "body")
            return run
        return tuple(bind(b) for b in bodies)

    @classmethod
    def _varjax_lift_class(cls, transform: str, lift_method: Callable[[Callable], Callable],
                           methods: Any = None) -> type:
        """``{Transform}{Class}`` (Linen's name, so checkpoints line up): a subclass whose
        ``methods`` (default ``__call__``) run through ``lift_method``.

        Inside the transform the methods are the original class's, as in Linen: a lifted
        ``__call__`` calling the lifted ``encode`` does not apply the transform twice."""
        names = ["__call__"] if methods is None else list(methods)
        attrs: dict[str, Any] = {}
        lifted_cls: list[type] = []
        for name in names:
            method = getattr(cls, name, None)
            if method is None:
                raise errors.ModuleError(
                    f"{cls.__name__} has no method '{name}' to lift with {transform}.",
                    module=f"{cls.__name__} (unbound)", source=errors.source_text(),
                    fix="list existing method names in methods=")
            attrs[name] = _lifted_method(getattr(method, "__wrapped__", method), lift_method,
                                         lifted_cls)
        lifted_cls.append(type(transform.capitalize() + cls.__name__, (cls,), attrs))
        return lifted_cls[0]

    # -- variables ------------------------------------------------------------------------
    def _ctx(self, api: str) -> scope.TraceContext:
        if self.scope is None:
            raise errors.UnboundModuleError(
                f"{api} needs a bound module, but {self._label()} is not bound.",
                **scope.where(about=self),
                fix="call the module through init / apply, or use module.bind(variables)")
        return self.scope.context(self, api)

    def _path(self, name: str) -> Path:
        return self.scope.path + (name,)

    def _eager(self, op: Callable[["Module"], Any]) -> Any:
        """Runs a variable operation of a ``bind`` module from outside any trace."""
        def run(m: Module) -> Any:
            m._state.eager_op = True          # declared from outside, not in a method
            try:
                return op(m)
            finally:
                m._state.eager_op = False
        return self.scope.root.run(self, run, (), {}, method=False)

    def param(self, name: str, init_fn: Callable[..., Any], *init_args: Any) -> Any:
        """Parameter ``name`` of this module, created with ``init_fn(key, *init_args)``.

        An existing parameter is checked against ``init_fn``'s abstract output.
        """
        if self.scope is not None and self.scope.eager():
            if self.scope.root.has("params", self._path(name)):
                value = self.scope.root.read("params", self._path(name))
                scope.check_type("params", self._path(name), scope.VarType.of(value),
                                 scope.expected_type(init_fn, init_args, True), self)
                return value
            return self._eager(lambda m: m.param(name, init_fn, *init_args))
        ctx = self._ctx("Module.param")
        self._reserve_variable("parameter", "params", name)
        return scope.param_at(ctx, self._path(name), init_fn, init_args)

    def variable(self, collection: str, name: str, init_fn: Callable[..., Any] | None = None,
                 *init_args: Any) -> Variable:
        """A handle (``.value``) on variable ``name`` of ``collection`` in this module."""
        if self.scope is not None and self.scope.eager():
            if not self.scope.root.has(collection, self._path(name)):
                self._eager(lambda m: m.variable(collection, name, init_fn, *init_args))
            return BoundVariable(self.scope.root, collection, self._path(name))
        ctx = self._ctx("Module.variable")
        self._reserve_variable("variable", collection, name)
        return scope.variable_at(ctx, collection, self._path(name), init_fn, init_args)

    def has_variable(self, collection: str, name: str) -> bool:
        if self.scope is not None and self.scope.eager():
            return self.scope.root.has(collection, self._path(name))
        return scope.has_at(self._ctx("Module.has_variable"), collection, self._path(name))

    def get_variable(self, collection: str, name: str, default: Any = None) -> Any:
        if not self.has_variable(collection, name):
            return default
        if self.scope.eager():
            return self.scope.root.read(collection, self._path(name))
        return scope.read_at(self._ctx("Module.get_variable"), collection, self._path(name))

    def put_variable(self, collection: str, name: str, value: Any) -> None:
        if self.scope is not None and self.scope.eager():
            return self._eager(lambda m: m.put_variable(collection, name, value))
        scope.write_at(self._ctx("Module.put_variable"), collection, self._path(name), value)

    def sow(self, collection: str, name: str, value: Any,
            reduce_fn: Callable[[Any, Any], Any] = scope._append,
            init_fn: Callable[[], Any] = tuple) -> bool:
        """Store ``value`` if ``collection`` is mutable (Linen's ``sow``); False if not."""
        if self.scope is not None and self.scope.eager():
            return self._eager(lambda m: m.sow(collection, name, value, reduce_fn, init_fn))
        ctx = self._ctx("Module.sow")
        if ctx.is_mutable(collection) and not scope.has_at(ctx, collection, self._path(name)):
            self._reserve_variable("sown variable", collection, name, anywhere=True)
        return scope.sow_at(ctx, collection, self._path(name), value, reduce_fn, init_fn)

    def perturb(self, name: str, value: Any, collection: str = "perturbations") -> Any:
        """``value`` plus a zero-initialized variable, whose gradient is d loss / d value."""
        if self.is_mutable_collection(collection) and not self.has_variable(collection, name):
            self.put_variable(collection, name, jax.numpy.zeros_like(value))
        if self.has_variable(collection, name):
            return value + self.get_variable(collection, name)
        return value

    def make_rng(self, name: str = streams.PARAMS) -> jax.Array:
        """A fresh key from stream ``name``; every call gives a different key.  A stream that
        was not given falls back to ``default`` (a ``vj.Rngs`` seed, as in NNX), then to
        ``params`` (as in Linen, so ``init(key, x, train=True)`` works); with none of them,
        ``MissingRngError``."""
        if self.scope is not None and self.scope.eager():
            return self._eager(lambda m: m.make_rng(name))
        ctx = self._ctx("Module.make_rng")
        return scope.draw_at(ctx, name, self.scope.path, (streams.DEFAULT, streams.PARAMS))

    def has_rng(self, name: str) -> bool:
        if self.scope is not None and self.scope.eager():
            return self.scope.root.has_rng(name)
        return name in self._ctx("Module.has_rng").rng_streams

    def is_mutable_collection(self, collection: str) -> bool:
        if self.scope is not None and self.scope.eager():
            return filters.matches(self.scope.root.mutable, collection)
        return self._ctx("Module.is_mutable_collection").is_mutable(collection)

    def is_initializing(self) -> bool:
        if self.scope is not None and self.scope.eager():
            return False
        return self._ctx("Module.is_initializing").initializing

    @property
    def path(self) -> Path:
        """The names from the root module to this one (``()`` for the root)."""
        if self.scope is None:
            raise errors.UnboundModuleError(
                f"{self._label()} has no path: it is not bound.", **scope.where(about=self),
                fix="read .path inside a method called through init/apply, or on a module made by bind")
        return self.scope.path

    @property
    def variables(self) -> dict[str, Any]:
        """This module's variables as ``{collection: {name: value}}`` (current values)."""
        prefix = self.path
        if self.scope.eager():
            flat = {k: jax.tree.unflatten(t, ls)
                    for k, (t, ls) in flatten_variables(self.scope.root.variables).items()}
        else:
            ctx = self._ctx("Module.variables")
            flat = {k: scope.read_at(ctx, *k) for k in ctx.variables if k[1][:len(prefix)] == prefix}
        return unflatten_variables({(c, p[len(prefix):]): v for (c, p), v in flat.items()
                                    if p[:len(prefix)] == prefix and len(p) > len(prefix)})

    # -- cloning, binding, init/apply -------------------------------------------------------
    def clone(self, *, parent: Any = None, **updates: Any) -> "Module":
        """A new module with the same fields (plus ``updates``) and the given parent."""
        return dataclasses.replace(self, parent=parent, **updates)

    def bind(self, variables: Mapping[str, Any], *, rngs: Any = None, mutable: Any = False) -> "Module":
        """A bound clone with unlimited lifetime; mutable collections are updated in place."""
        return self.clone(parent=BoundRoot(variables, rngs, mutable), name=None)

    def unbind(self) -> tuple["Module", dict[str, Any]]:
        """``(unbound clone, variables)`` of a module made by ``bind``."""
        if self.scope is None or not isinstance(self.scope.root, BoundRoot) or self.scope.path:
            raise errors.UnboundModuleError(
                f"unbind() needs the root module returned by bind(); got {self._label()}.",
                **scope.where(about=self), fix="call unbind on the module that bind() returned")
        return self.clone(parent=None), self.scope.root.variables

    def functionalize(self, method: Any = None, capture_intermediates: Any = False) -> Functionalized:
        """The ``vj.functionalize`` object behind ``init``/``apply`` for ``method``: use it
        for ``.jaxpr(...)`` / ``.functional_jaxpr(...)`` / ``.traced(...)`` of a module call.

        Cached on the module, so repeated ``apply`` calls reuse its traces."""
        capture = capture_intermediates
        fn = _resolve_method(self, method)
        cache = self.__dict__.setdefault("_varjax_functionalized", {})
        key = (fn, capture)
        found = cache.get(key)
        if found is None:
            found = cache[key] = _shared_functionalized(self, key)
        return found

    def _new_functionalized(self, fn: Callable, capture: Any) -> Functionalized:
        capture_fn = _capture_filter(capture)

        def bound_call(*args: Any, **kwargs: Any) -> Any:
            root = TraceRoot(scope.current(), capture_fn)
            return fn(self.clone(parent=root, name=None), *args, **kwargs)
        bound_call.__name__ = f"{type(self).__name__}.{getattr(fn, '__name__', 'method')}"
        return Functionalized(bound_call)

    def init_with_output(self, rngs: Any, *args: Any, method: Any = None,
                         mutable: Any = DEFAULT_INIT_MUTABLE, capture_intermediates: Any = False,
                         **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        return self.functionalize(method, capture_intermediates).init_with_output(
            rngs, *args, mutable=mutable, **kwargs)

    def init(self, rngs: Any, *args: Any, method: Any = None, mutable: Any = DEFAULT_INIT_MUTABLE,
             capture_intermediates: Any = False, **kwargs: Any) -> dict[str, Any]:
        """All variables the method creates: ``apply({}, ..., mutable=True)[1]`` with the
        ``params`` stream given, minus ``intermediates`` (Linen's default)."""
        return self.init_with_output(rngs, *args, method=method, mutable=mutable,
                                     capture_intermediates=capture_intermediates, **kwargs)[1]

    def apply(self, variables: Mapping[str, Any], *args: Any, rngs: Any = None, method: Any = None,
              mutable: Any = False, capture_intermediates: Any = False, **kwargs: Any) -> Any:
        """Runs ``method`` (default ``__call__``) of a bound clone; returns ``out`` or
        ``(out, updated_collections)`` when anything is mutable."""
        return self.functionalize(method, capture_intermediates).apply(
            variables, *args, rngs=rngs, mutable=mutable, **kwargs)

    def __repr__(self) -> str:
        fields = [f for f in dataclasses.fields(self) if f.repr and f.name != "name"]
        inner = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields)
        if self.name is not None:
            inner = f"{inner}, name={self.name!r}" if inner else f"name={self.name!r}"
        return f"{type(self).__name__}({inner})"


dataclasses.dataclass(Module, repr=False, eq=True, unsafe_hash=True)
_API_NAMES.update(n for n in vars(Module) if not n.startswith("__"))


def _wrappable(attr: str, fn: Any) -> bool:
    if not inspect.isfunction(fn) or getattr(fn, "varjax_nowrap", False):
        return False
    if getattr(fn, "varjax_wrapped", False) or attr in _API_NAMES or attr == "setup":
        return False
    return attr == "__call__" or not attr.startswith("__")   # private methods too, as in Linen


def _lifted_method(raw: Callable, lift_method: Callable[[Callable], Callable],
                   owner: list[type]) -> Callable:
    """A method of the lifted class ``owner[0]``: the transform around ``raw``, or ``raw``
    itself when that class's transform is already running on this instance."""
    lifted = lift_method(raw)

    @functools.wraps(raw)
    def method(self: Module, *args: Any, **kwargs: Any) -> Any:
        running = self._state.lifting
        if owner[0] in running:
            return raw(self, *args, **kwargs)
        running.add(owner[0])
        try:
            return lifted(self, *args, **kwargs)
        finally:
            running.discard(owner[0])
    method.varjax_lifted = True
    return method


def _wrap_method(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(self: Module, *args: Any, **kwargs: Any) -> Any:
        return self._call_wrapped(fn, args, kwargs)
    wrapped.varjax_wrapped = True
    return wrapped


# Equal modules (same class and fields) share their Functionalized, so building a new but
# equal model object -- as code that constructs its model per step does -- neither retraces
# nor recompiles.  Fields compare by type and value (``statics.typed``), down through
# submodules, tuples and dicts: ``Fill(1)``, ``Fill(1.0)`` and ``Fill(True)`` are equal
# dataclasses, but ``jnp.full((2,), v)`` traces to three dtypes.  Bounded, and released
# by ``jax.clear_caches()`` (``varjax.caches``).
_SHARED = LRU()


def _shared_functionalized(module: Module, key: tuple) -> Functionalized:
    try:
        # ``typed`` would key a list field too, but the list may change after this call.
        hash(module)
        shared_key = typed((module, *key))
        found = _SHARED.get(shared_key)
    except TypeError:                 # a field is unhashable: this instance only
        return module._new_functionalized(*key)
    if found is None:
        found = _SHARED[shared_key] = module._new_functionalized(*key)
    return found


def _resolve_method(module: Module, method: Any) -> Callable:
    if method is None:
        method = "__call__"
    if isinstance(method, str):
        fn = getattr(type(module), method, None)
        if fn is None or not callable(fn):
            raise errors.ModuleError(
                f"{type(module).__name__} has no method '{method}'.", **scope.where(about=module),
                fix="pass method= the name of a method of the module")
        return fn
    if not callable(method):
        raise errors.ModuleError(
            f"method= must be a method name or a callable taking the module first, got "
            f"{type(method).__name__}.", **scope.where(about=module),
            fix="pass e.g. method=Model.encode or method='encode'")
    return method


def _capture_filter(capture: Any) -> Callable[[Module, str], bool] | None:
    if capture is False or capture is None:
        return None
    if capture is True:
        return lambda module, method_name: method_name == "__call__"
    return capture


def apply(fn: Callable[..., Any], module: Module, mutable: Any = False,
          capture_intermediates: Any = False) -> Callable[..., Any]:
    """Linen's ``nn.apply``: ``fn(bound_module, *args)`` as ``(variables, *args, rngs=)``."""
    def applied(variables: Mapping[str, Any], *args: Any, rngs: Any = None, **kwargs: Any) -> Any:
        return module.apply(variables, *args, rngs=rngs, method=fn, mutable=mutable,
                            capture_intermediates=capture_intermediates, **kwargs)
    return applied


def init_with_output(fn: Callable[..., Any], module: Module, mutable: Any = DEFAULT_INIT_MUTABLE,
                     capture_intermediates: Any = False) -> Callable[..., Any]:
    def initialized(rngs: Any, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        return module.init_with_output(rngs, *args, method=fn, mutable=mutable,
                                       capture_intermediates=capture_intermediates, **kwargs)
    return initialized


def init(fn: Callable[..., Any], module: Module, mutable: Any = DEFAULT_INIT_MUTABLE,
         capture_intermediates: Any = False) -> Callable[..., Any]:
    """Linen's ``nn.init``: ``fn(bound_module, *args)`` as ``(rngs, *args) -> variables``."""
    with_output = init_with_output(fn, module, mutable, capture_intermediates)
    return lambda rngs, *args, **kwargs: with_output(rngs, *args, **kwargs)[1]
