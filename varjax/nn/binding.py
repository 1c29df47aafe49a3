"""Where a bound module's variables live: roots and scopes.

A bound module has a ``Scope``: its root and its path of names.  The root says
which variables the module sees:

* ``TraceRoot``: made by ``init``/``apply`` for one trace.  Variable operations
  go to that trace's ``TraceContext``; the root remembers the context's origin,
  so a module kept past its ``apply`` is caught (``InvalidScopeError``).
* ``BoundRoot``: made by ``Module.bind``.  It owns concrete variables.  A
  method called from outside any trace runs as a cached ``functionalize`` call
  against them, and the mutable collections it returns are written back.
  While that call traces, the root acts like a ``TraceRoot``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Mapping

from varjax.functionalization.functionalized import Functionalized, normalize_rngs
from varjax.ir import errors, streams
from varjax.ir.primitives import Path
from varjax.ir.protocols import Labelled
from varjax.trace.context import TraceContext, active, current, site
from varjax.trace.rngs import Rngs
from varjax.trace.variable_dicts import unflatten_variables, variable_values


class _Root:
    """What both roots keep for the modules bound to them.

    The roots store modules but never call into them: this file sits below the module
    package (which imports it), so a module is typed by the one contract used here,
    ``protocols.Labelled`` (``Scope.context`` names it in errors)."""

    def __init__(self) -> None:
        # A module's setup is current while its version is the root's.  A lifted body, and
        # the trace of a bound module's call, run under a new version, so setup runs again
        # inside; the modules set up there are recorded in ``lifted_bodies[-1]``
        # ({id: (module, snapshot)}) and put back when the body ends
        # (``Module._varjax_bodies``, ``Module._run_bound``).
        self.version = 0
        self._versions = 0
        self.lifted_bodies: list[dict[int, tuple[Labelled, Any]]] = []
        self.adopted: dict[int, tuple[Labelled, Labelled]] = {}   # see Naming._adopt

    def new_version(self) -> int:
        """A version no module of this root has been set up in."""
        self._versions += 1
        return self._versions


class TraceRoot(_Root):
    """The root of a module tree bound inside one ``init``/``apply`` trace."""

    def __init__(self, ctx: TraceContext, capture: Callable[[Labelled, str], bool] | None):
        super().__init__()
        self.origin = ctx.origin
        self.capture = capture


class BoundRoot(_Root):
    """The root made by ``Module.bind``: owns variables and runs each outside call
    through a cached ``functionalize`` of that method."""

    capture = None

    def __init__(self, variables: Mapping[str, Any], rngs: Any, mutable: Any, passes: tuple = ()):
        super().__init__()
        self.passes = passes    # added to every call's pipeline (``bind(passes=...)``)
        # Where these variables are in the module the passes were given for: () for a
        # module bound by ``bind``; a submodule's path for the copy JAX makes of a submodule
        # passed to a transform alone (``nn.module.objects``), whose passes name it so.
        self.passes_path: Path = ()
        self.variables = unflatten_variables(variable_values(variables))
        # A vj.Rngs is state: every call draws from it and advances it.  Keys are folded
        # with the call index instead (see _next_rngs).
        self.held = rngs if isinstance(rngs, Rngs) else None
        self.rngs = {} if self.held is not None else normalize_rngs(rngs)
        self.mutable = mutable
        self.origin: TraceContext | None = None  # set while one of our calls traces
        # Which variables exist changes only when this moves on: object mode keeps the
        # cells of a module per layout (``varjax.nn.module.as_node``).
        self.layout = 0
        self.cells: dict[Path, tuple[int, list]] = {}
        self.defs: dict[Path, tuple[int, Any]] = {}
        self.calls = 0
        self._fns: dict[Any, Functionalized] = {}
        self._rng_leaf: Any = {}

    @classmethod
    def restore(cls, variables: dict[str, Any], rngs: Any, mutable: Any,
                passes: tuple = (), passes_path: Path = ()) -> "BoundRoot":
        """A root over ``variables`` as they are (a pytree's leaves, maybe not arrays: JAX
        unflattens with placeholders too), without the checks of ``bind``; ``rngs`` is an
        ``Rngs``, ``(keys, calls)``, or anything else for none: ``{}`` as flattened, or what
        a tree map put in its place (Orbax maps an empty dict as a leaf)."""
        root = object.__new__(cls)
        _Root.__init__(root)
        root.variables = variables
        root.held = rngs if isinstance(rngs, Rngs) else None
        keys, calls = rngs if isinstance(rngs, tuple) else ({}, 0)
        root.rngs, root.calls = dict(keys), calls
        # A value a tree map put where the empty ``{}`` was goes back there when the module
        # is flattened again (``rng_children``), as the map's tree must match the module's.
        root._rng_leaf = rngs if root.held is None and not isinstance(rngs, tuple) else {}
        root.mutable, root.passes, root.passes_path = mutable, passes, passes_path
        root.origin, root._fns, root.layout, root.cells, root.defs = None, {}, 0, {}, {}
        return root

    def rng_children(self) -> Any:
        """The RNG part of a bound module's pytree children: the held ``Rngs``, ``(keys,
        calls)``, or for none ``{}`` (or what a tree map put in its place)."""
        if self.held is not None:
            return self.held
        return (dict(self.rngs), self.calls) if self.rngs else self._rng_leaf

    def _next_rngs(self) -> Any:
        """The held ``Rngs``, or the keys with call n >= 1 folding n into every key: either
        way repeated calls draw fresh randomness."""
        if self.held is not None:
            return self.held
        n, self.calls = self.calls, self.calls + 1
        return self.rngs if n == 0 else {s: streams.derive(k, n) for s, k in self.rngs.items()}

    def has_rng(self, name: str) -> bool:
        return name in (self.held if self.held is not None else self.rngs)

    def run(self, key: Hashable | None, name: str, body: Callable[..., Any], args: tuple,
            kwargs: dict) -> Any:
        """Runs ``body(*args, **kwargs)`` through the IR against this root's variables and
        writes the mutable collections it returns back into them.

        The module package calls it for a bound module used from outside any trace
        (``Lifecycle._run_bound``), with a ``body`` that runs setup again and calls the method:
        setup is the module's business, so the root runs the body without looking into
        the module.  The ``functionalize`` of ``body`` is kept under
        ``key`` (None: a one-off call, not kept), named ``name`` in its jaxpr.  While
        ``body`` traces, ``origin`` is that trace, so the root's modules act as under
        ``apply``."""
        functionalized = self._fns.get(key) if key is not None else None
        if functionalized is None:
            def traced(*a: Any, **k: Any) -> Any:
                self.origin = current().origin
                try:
                    return body(*a, **k)
                finally:
                    self.origin = None
            traced.__name__ = name
            functionalized = Functionalized(traced, passes=self.passes)
            if key is not None:
                self._fns[key] = functionalized
        rngs = self._next_rngs()
        with errors.mutability_given_by("bind"):
            if self.mutable is False:
                return functionalized.apply(self.variables, *args, rngs=rngs, **kwargs)
            out, updated = functionalized.apply(self.variables, *args, rngs=rngs,
                                                mutable=self.mutable, **kwargs)
        self.variables.update(updated)
        self.version = self.new_version()     # setup attributes read the new values
        self.layout += 1                      # maybe new variables
        return out

    def read(self, collection: str, path: Path) -> Any:
        node = self.variables.get(collection, {})
        for name in path:
            node = node[name]
        return node

    def has(self, collection: str, path: Path) -> bool:
        try:
            self.read(collection, path)
            return True
        except (KeyError, TypeError):
            return False


@dataclasses.dataclass(frozen=True)
class Scope:
    """Where a bound module lives: its root and its path of names from the root."""

    root: TraceRoot | BoundRoot
    path: Path

    def eager(self) -> bool:
        """Bound by ``bind`` and called from outside any of its traces."""
        return isinstance(self.root, BoundRoot) and self.root.origin is None

    def context(self, module: Labelled, api: str) -> TraceContext:
        """The active trace, which must be the one this scope's root is bound to; ``module``
        (the module calling ``api``) is for the error."""
        ctx = active()
        if ctx is None or ctx.origin is not self.root.origin:
            raise errors.InvalidScopeError(
                f"{api} was called on module {module._label()} after the init/apply that "
                "bound it had ended (or under another one).", **site(about=module),
                fix="do not keep bound modules beyond apply; use Module.bind for a "
                    "long-lived bound module")
        return ctx
