"""The hooks through which lifted transforms (``nn.vmap``, ``nn.scan``, ...) see a module.

``varjax.lifting.region`` sits below ``varjax.nn`` and never imports it: it recognises a
module by ``_varjax_module`` and calls ``_varjax_bodies`` on it, and
``varjax.transforms`` calls ``_varjax_lift_class`` on a module class.  These are the
protocols ``varjax.ir.protocols.LiftableModule`` and ``LiftableModuleClass``; this file
implements them.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

from varjax.ir import errors
from varjax.nn.module.lifecycle import Lifecycle
from varjax.trace.context import site


class LiftHooks(Lifecycle):
    """A module's side of ``vj.lift``: its bodies re-run setup, its class can be lifted."""

    def _varjax_run_eager(self, fn: Callable[..., Any], args: tuple) -> Any:
        """A lifted transform's direct form given this ``bind`` module outside any trace:
        the call runs in the bound scope (``_run_bound``), as Linen's does in the module's
        scope, so its RNG draws and variable updates are those of the bound module."""
        if self.scope is None or not self.scope.eager():
            raise errors.UnboundModuleError(
                f"a lifted transform was given {self._label()} outside init/apply, and it "
                "is not bound.", **site(about=self),
                fix="call it inside init/apply, or bind the module first")
        return self._run_bound(fn, args, {}, method=False)

    def _varjax_bodies(self, bodies: tuple[Callable[..., Any], ...]) -> tuple[Callable[..., Any], ...]:
        """``body(self, ...)`` for each body of one lifted call.

        Each body starts by running setup, under a version of the root no module has been
        set up in, as a method call on Linen's clone of the module inside the transform
        does: setup's variables exist even when the body touches no attribute, and they
        have their lifted shapes.  Names reserved inside start from setup's, and, for a
        transformed method called from a method of the module, from the submodule names
        that call reserved (a name the caller used is taken inside, as in Linen; a direct
        transform's bodies, which Linen runs on a clone, may use it again).  When the body
        ends, every module that ran setup inside it gets back the attributes, reserved
        names and version it had before (no value traced in the body stays behind), and
        this module gets back the caller's reservations.

        A body may be traced more than once (a peeled scan step), and a call may have
        several bodies (the branches of a cond); every trace starts from the naming state
        the first one saw, so inline submodules get the same names in each.

        A body may also run after the method that made the call has returned: JAX traces a
        custom derivative rule only when something differentiates it.  It still declares
        variables as the call it belongs to could (``declares``), in setup or in a compact
        method, not as code outside both, which Linen's rule forbids."""
        state = self._state
        first: list[tuple] = []
        declares = state.in_setup or state.compact_depth > 0
        method_lift, state.method_lift = state.method_lift, False

        def bind(body: Callable) -> Callable:
            def run(*args: Any, **kwargs: Any) -> Any:
                in_setup = state.in_setup      # a lifted call inside setup shares its names
                caller = (set(state.call_names), set(state.call_vars))
                # a transformed method called from a method of this module: the submodule
                # names that call reserved stay reserved inside, as in Linen (a direct
                # transform's bodies, like its variables, may declare them again)
                inside_call = method_lift and state.compact_depth > 0
                late = int(declares and not (in_setup or state.compact_depth))
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
                state.compact_depth += late
                try:
                    if not in_setup:
                        self._try_setup()
                        state.call_names = set(state.setup_names)
                        state.call_vars = set(state.setup_vars)
                        if inside_call:
                            state.call_names |= caller[0]
                    return body(self, *args, **kwargs)
                finally:
                    for module, snap in reversed(list(root.lifted_bodies.pop().values())):
                        module._restore_setup(snap)
                    root.version = version
                    if not in_setup:
                        state.call_names, state.call_vars = caller
                    state.compact_depth -= late
            run.__name__ = getattr(body, "__name__", "body")
            return run
        return tuple(bind(b) for b in bodies)

    @classmethod
    def _varjax_lift_class(cls, transform: str, lift_method: Callable[[Callable], Callable],
                           methods: Iterable[str] | None = None) -> type:
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


def _lifted_method(raw: Callable, lift_method: Callable[[Callable], Callable],
                   owner: list[type]) -> Callable:
    """A method of the lifted class ``owner[0]``: the transform around ``raw``, or ``raw``
    itself when that class's transform is already running on this instance."""
    lifted = lift_method(raw)

    @functools.wraps(raw)
    def method(self: LiftHooks, *args: Any, **kwargs: Any) -> Any:
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
