"""Lifecycle: frozen attributes, lazy ``setup``, and the work around every wrapped call.

A module's attributes can be set only in ``setup``, which runs lazily on the first
wrapped call or attribute miss of a bound module, and runs again whenever its
root's version moves on (a new trace, new bound variables, a lifted body).  Every
method ``core.Module`` wraps goes through ``_call_wrapped``: set up, enter the
module's named scope, count compact-method names, capture intermediates.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable, Self

from varjax.ir import errors
from varjax.nn.module.interception import cache_key, run_intercepted, scope
from varjax.nn.module.lifecycle_state import UNSPECIFIED, SetupSnapshot
from varjax.nn.module.naming import Naming, adopt_submodules
from varjax.trace.context import active, site


def compact(fun: Callable) -> Callable:
    """Marks a method that may define submodules and variables inline (a class may have
    several; one called from another shares its auto-names, as in Linen)."""
    fun.varjax_compact = True
    return fun


def nowrap(fun: Callable) -> Callable:
    """Marks a helper method that must not be wrapped (no setup, no scope, no name)."""
    fun.varjax_nowrap = True
    return fun


def compact_name_scope(fun: Callable) -> Callable:
    """Marks a method whose inline submodules live under a scope named after it (Linen's
    ``nn.compact_name_scope``, for porting Haiku code): ``Dense_0`` made in ``up`` is
    ``up/Dense_0``.  The method runs on the module as ``self``; its submodules' parent is
    a ``CompactNameScope`` child that setup makes for each such method."""
    @functools.wraps(fun)
    def call(self: Lifecycle, *args: Any, **kwargs: Any) -> Any:
        if self.scope is None:
            raise errors.UnboundModuleError(
                f"the compact_name_scope method {fun.__name__} was called on {self._label()}.",
                **site(about=self), fix="call it through module.init / module.apply (or bind)")
        self._try_setup()
        scopes = self.__dict__.get("_varjax_name_scopes")
        if scopes is None:
            raise errors.ModuleError(
                f"the compact_name_scope method {fun.__name__} of {self._label()} was called "
                "from setup(), before its scope exists.", **site(about=self),
                fix="call it from another method, or make it a plain method")
        return scopes[fun.__name__](*args, **kwargs)
    call.varjax_nowrap = True
    call.varjax_name_scope = fun
    return call


_local = threading.local()


def module_stack() -> list[Lifecycle]:
    """The modules whose ``setup`` or wrapped method is running in this thread, innermost
    last: a module constructed meanwhile takes the last one as its parent."""
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


class Lifecycle(Naming):
    """The lifecycle half of a module: when ``setup`` runs, and what a wrapped call does."""

    def __setattr__(self, attr: str, value: Any) -> None:
        state = self.__dict__.get("_state")
        if state is None:                     # the dataclass constructor
            object.__setattr__(self, attr, value)
            return
        if not state.in_setup:
            raise errors.FrozenModuleError(
                f"cannot set attribute '{attr}' of {self._label()}: modules are frozen "
                "dataclasses outside setup().", **site(about=self),
                fix="assign attributes in setup(), or make it a dataclass field")
        spec = self.__dataclass_fields__.get(attr)
        if spec is not None and spec.init:
            # It would be gone when setup runs again (its attributes are reset), as Linen's
            # SetAttributeInModuleSetupError says.
            raise errors.FrozenModuleError(
                f"cannot set field '{attr}' of {self._label()} in setup(): the fields are the "
                "module's construction arguments.", **site(about=self),
                fix=f"give '{attr}' as an argument, assign another attribute in setup(), or "
                    "declare the field with dataclasses.field(init=False)")
        value = adopt_submodules(value, self._adopt, attr)
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
        """Runs ``setup`` unless it already ran under the root's current version."""
        state = self._state
        if self.scope is None or state.in_setup:
            return
        root = self.scope.root
        if state.setup_done and state.setup_version == root.version:
            return
        if root.lifted_bodies:        # in a lifted body or a bound call: put back at its end
            kept = root.lifted_bodies[-1]
            if id(self) not in kept:
                kept[id(self)] = (self, self._snapshot_setup())
        self._reset_setup()
        state.in_setup = True
        stack = module_stack()
        stack.append(self)
        try:
            self._adopt_fields()
            if not self._has_setup():
                return                # nothing to run: no scope to enter for it
            # Errors name this module while its setup runs (also when a parent's attribute
            # access runs it lazily).
            ctx = active()
            previous_module = ctx.module if ctx is not None else None
            if ctx is not None:
                ctx.module = self
            try:
                with scope(self._scope_name()):
                    self._run_setup()
            finally:
                if ctx is not None:
                    ctx.module = previous_module
        finally:
            stack.pop()
            state.in_setup = False
            state.setup_done = True
            state.setup_version = self.scope.root.version

    def _run_setup(self) -> None:
        """The user's ``setup``, through the active interceptors (as Linen's wrapped setup;
        a class that defines no setup has none to intercept)."""
        setup = type(self).setup
        if setup is Lifecycle.setup:
            return
        run_intercepted(setup, self, (), {})

    def _has_setup(self) -> bool:
        """Whether ``_run_setup`` has anything to do (most layers define no setup)."""
        return type(self).setup is not Lifecycle.setup

    def _reset_setup(self) -> None:
        """Forget what setup made, so it runs again (a new trace, or new bound variables)."""
        state = self._state
        for attr in state.setup_attrs:
            self.__dict__.pop(attr, None)
        state.setup_attrs = []
        state.setup_names, state.call_names = set(), set()
        state.setup_vars, state.call_vars = set(), set()
        state.setup_done = False

    def _snapshot_setup(self) -> SetupSnapshot:
        state = self._state
        return SetupSnapshot(state.setup_done, state.setup_version,
                             {a: self.__dict__[a] for a in state.setup_attrs if a in self.__dict__},
                             list(state.setup_attrs), set(state.setup_names),
                             set(state.setup_vars), set(state.call_names), set(state.call_vars))

    def _restore_setup(self, snap: SetupSnapshot) -> None:
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

    # -- wrapped method calls --------------------------------------------------------------
    def _call_wrapped(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """``fn(self, *args, **kwargs)`` for a wrapped method ``fn``: set up, inside the
        module's named scope, with this module as the parent of modules constructed there."""
        is_compact = getattr(fn, "varjax_compact", False)
        sc = self.scope
        if sc is None:
            if is_compact:
                raise errors.UnboundModuleError(
                    f"the @compact method {fn.__name__} was called on {self._label()}.",
                    **site(about=self),
                    fix="call it through module.init / module.apply (or module.bind)")
            return run_intercepted(fn, self, args, kwargs)
        if sc.eager():
            return self._run_bound(fn, args, kwargs, method=True)
        ctx = sc.context(self, f"{type(self).__name__}.{fn.__name__}")
        previous_module, ctx.module = ctx.module, self
        if not getattr(fn, "varjax_lifted", False):   # a lifted one sets up in its body
            self._try_setup()
        state = self._state
        if is_compact and state.compact_depth == 0:
            state.cursor.clear()
            state.call_names, state.call_vars = set(state.setup_names), set(state.setup_vars)
        stack = module_stack()
        stack.append(self)
        state.compact_depth += is_compact
        # a transformed method: the lift it calls keeps its caller's submodule names
        # (``LiftHooks._varjax_bodies`` reads and clears this)
        state.method_lift = getattr(fn, "varjax_lifted", False)
        label = self._scope_name() if fn.__name__ == "__call__" else f"{self._scope_name()}.{fn.__name__}"
        try:
            with scope(label):
                out = run_intercepted(fn, self, args, kwargs)
        finally:
            stack.pop()
            state.compact_depth -= is_compact
            state.method_lift = False       # a call that lifted nothing leaves it set
            ctx.module = previous_module
        capture = sc.root.capture
        if capture is not None and capture(self, fn.__name__):
            self.sow("intermediates", fn.__name__, out)
        return out

    def _run_bound(self, fn: Callable, args: tuple, kwargs: dict, *, method: bool) -> Any:
        """``fn(self, *args, **kwargs)`` on a module made by ``bind``, called from outside any
        trace: run through the IR by its ``BoundRoot`` (``binding.BoundRoot.run``).

        ``method``: ``fn`` is a wrapped method, whose ``functionalize`` the root keeps per
        (module path, method); otherwise a one-off variable operation (``VariableAPI._eager``).
        The call runs under a root version no module has been set up in, so setup runs
        again under the trace (no concrete attribute is baked into it); afterwards every
        module gets back the setup attributes it had, so no traced value stays behind and
        setup does not run again on the next attribute access (as in Linen, once per bound
        instance, until the root's variables change)."""
        root = self.scope.root

        def body(*a: Any, **k: Any) -> Any:
            version = root.version
            root.version = root.new_version()
            root.lifted_bodies.append({})
            try:
                return self._call_wrapped(fn, a, k) if method else fn(self, *a, **k)
            finally:
                for module, snap in reversed(list(root.lifted_bodies.pop().values())):
                    module._restore_setup(snap)
                root.version = version
        key = (self.scope.path, fn, cache_key()) if method else None
        name = f"{type(self).__name__}.{getattr(fn, '__name__', 'fn')}"
        return root.run(key, name, body, args, kwargs)

    # -- copies and printing ---------------------------------------------------------------
    def clone(self, *, parent: Lifecycle | None = None, **updates: Any) -> Self:
        """A new module with the same fields (plus ``updates``) and the given parent (a
        ``Module``, or None: unbound)."""
        return dataclasses.replace(self, parent=parent, **updates)

    def copy(self, *, parent: Lifecycle | None = UNSPECIFIED, name: str | None = None,
             **updates: Any) -> Self:
        """A copy with the given fields replaced (Linen's ``copy``): by default its parent is
        the running module, so in a compact method it is a new auto-named child.  Submodules
        held by fields are copied too, detached, and one module held twice is copied once."""
        copies: dict[int, Lifecycle] = {}

        def detached(module: Lifecycle, _name: str) -> Lifecycle:
            if id(module) not in copies:
                copies[id(module)] = module._copy_fields({}, parent=None, name=module.name,
                                                         detach=detached)
            return copies[id(module)]
        return self._copy_fields(updates, parent=parent, name=name, detach=detached)

    def _copy_fields(self, updates: dict[str, Any], *, parent: Any, name: str | None,
                     detach: Callable[[Lifecycle, str], Lifecycle]) -> Self:
        attrs = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.init and f.name not in ("parent", "name")}
        attrs.update(updates)
        attrs = {k: adopt_submodules(v, detach, k) for k, v in attrs.items()}
        return type(self)(**attrs, parent=parent, name=name)

    def __repr__(self) -> str:
        fields = [f for f in dataclasses.fields(self) if f.repr and f.name != "name"]
        inner = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields)
        if self.name is not None:
            inner = f"{inner}, name={self.name!r}" if inner else f"name={self.name!r}"
        return f"{type(self).__name__}({inner})"
