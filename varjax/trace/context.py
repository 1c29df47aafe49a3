"""The trace context: the variable view of one functionalize trace, while user code runs.

While ``functionalize`` traces a function, a ``TraceContext`` is active.  It knows, at
trace time, which variables exist and with which types, which collections are mutable and
which RNG streams were given.  ``varjax.trace.variable_api`` (the variable API) consults it; it never
holds values, so the same code traces for ``init`` and ``apply``.

Two things vary between contexts, and each is a strategy object rather than a branch:

* the **store** -- where reads, writes and draws go.  ``IR_STORE`` binds ``var_get`` /
  ``var_set`` / ``rng_draw``: the normal case.  The lifting layer supplies a dictionary
  store for bodies it runs directly in its transform's trace (``varjax.lifting.body``);
* the **access policy** -- what the code may touch.  A top-level trace may touch
  anything; the body of a lifted transform only what the transform lifted
  (``varjax.lifting.body.Lifted``).

Every variable access passes one guard, ``TraceContext.guard``: the store observes the
access (the jit-key switch of ``varjax.trace.fingerprint``) and the policy checks it.

Existence is tracked in trace order.  Code under raw JAX control flow is traced once per
branch/body, so a variable created in branch 0 of a raw ``lax.cond`` is seen as existing
by branch 1; the discharge pass then reports which branch failed to create it.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence

import jax

from varjax import _jax
from varjax.ir import errors, filters
from varjax.ir.primitives import Key, Path, VarType, bind_draw, bind_get, bind_set, var_set_p
from varjax.ir.protocols import Labelled
from varjax.trace import fingerprint


class AccessPolicy(Protocol):
    """What the code under a context may touch; consulted before every access.

    Implemented by the lifting layer (``varjax.lifting.body.Lifted``); hashable, since it
    is part of the context's jit-cache fingerprint."""

    name: str

    def check(self, ctx: "TraceContext", collection: str, path: Path) -> None:
        """Raise if variable ``(collection, path)`` may not be touched here."""

    def check_stream(self, ctx: "TraceContext", stream: str, where_: Path) -> None:
        """Raise if RNG stream ``stream`` may not be drawn from here."""


class Store(Protocol):
    """Where the variable operations of a context go."""

    # A constant jit-cache key for every context using this store, or None for the
    # context's own fingerprint.
    jit_key: tuple | None

    def observe(self, ctx: "TraceContext") -> None:
        """Called before every variable operation, with ``ctx`` active."""

    def read(self, ctx: "TraceContext", collection: str, path: Path, vt: VarType) -> Any:
        """The value of an existing variable of type ``vt``."""

    def write(self, ctx: "TraceContext", collection: str, path: Path, leaves: list, tree: Any) -> None:
        """Store a value (its type already recorded with ``ctx.set_type``)."""

    def draw(self, ctx: "TraceContext", stream: str) -> Any:
        """A fresh key from a given stream."""


class IRStore:
    """Variable operations become ``var_get`` / ``var_set`` / ``rng_draw`` equations."""

    jit_key = None

    def observe(self, ctx: "TraceContext") -> None:
        # The first variable operation inside an inner JAX trace (a jitted helper, a loop
        # body...) makes fingerprints strict (see varjax.trace.fingerprint).
        if not fingerprint.is_strict() and _jax.current_trace() is not ctx.top_trace:
            fingerprint.make_strict(lambda: ctx.fingerprint)

    def read(self, ctx: "TraceContext", collection: str, path: Path, vt: VarType) -> Any:
        return jax.tree.unflatten(vt.tree, bind_get(collection, path, vt.tree, vt.avals))

    def write(self, ctx: "TraceContext", collection: str, path: Path, leaves: list, tree: Any) -> None:
        bind_set(collection, path, leaves, tree)

    def draw(self, ctx: "TraceContext", stream: str) -> Any:
        return bind_draw(stream, ctx.rng_streams[stream])


IR_STORE = IRStore()


class TraceContext:
    """The variable view of one functionalize trace."""

    def __init__(self, variables: dict[Key, VarType], mutable: Any, rng_streams: dict[str, Any],
                 initializing: bool, policy: AccessPolicy | None = None, store: Store = IR_STORE):
        self.variables = dict(variables)
        self.policy = policy
        self.store = store
        self.mutable = mutable
        self.rng_streams = dict(rng_streams)
        self.initializing = initializing
        self.path_prefix: Path = ()
        self.given = dict(variables)
        # Given variables whose shape differs from what their init_fn makes, in a mutable
        # collection: an error unless a later write keeps the given shape (see
        # scope.expect_given); raised when the context is left.
        self.pending: dict[Key, errors.VariableShapeError] = {}
        # Snapshots share their origin: a module bound in this trace may be used under
        # any of them (custom rules traced lazily), and under no other trace.
        self.origin = self
        # The Module whose method is running, for error messages (not part of the fingerprint).
        self.module: Labelled | None = None
        # The JAX trace the function runs in; a variable operation under any other trace
        # runs inside an inner transformation (see IRStore.observe).
        self.top_trace: Any = None
        # The passes the program's pipeline adds to the defaults, and what they declare
        # (see ``use_passes``).
        self.use_passes(())
        # On the origin: the supplied variables the code asked for, lifted bodies included
        # (whose own pipelines replace their reads), for ``PassContext.asked``.
        self.asked: set[Key] = set()
        # Pass variables a lift created in this trace just before its transform
        # (``pass_scopes.CreateOutside``): how each was made (``pass_scopes.Creation``), for
        # this trace's pass to make it again where its rewrite reaches it; in the pass's
        # copy, True once the pass created one at an earlier read instead (see ``declare``).
        self.created_outside: dict[Key, Any] = {}
        base = (filters.freeze(mutable), tuple(sorted(self.rng_streams.items())), initializing, policy)
        self._fingerprint = fingerprint.Fingerprint(base, initializing or mutable is not False,
                                                    self.variables)

    @property
    def fingerprint(self) -> tuple:
        """Everything a trace made under this context can depend on, hashed: equal
        fingerprints mean an inner ``jax.jit`` trace can be reused (``varjax.trace.fingerprint``)."""
        return self.store.jit_key or self._fingerprint.key(self.path_prefix)

    def guard(self, collection: str, path: Path) -> None:
        """The check before every variable access: the store observes it, the policy
        (if any) allows it."""
        self.store.observe(self)
        if self.policy is not None:
            self.policy.check(self, collection, path)

    def snapshot(self, variables: dict[Key, VarType]) -> "TraceContext":
        """A copy that sees the given variables plus ``variables`` as they are at one point
        of the program (variables created later are not visible).

        Passes re-trace user code after the trace has ended (custom_jvp/vjp rules are
        traced lazily); they must see variable types as of the call site, not the end.
        """
        ctx = TraceContext({**self.given, **variables}, self.mutable, self.rng_streams,
                           self.initializing, self.policy)
        ctx.path_prefix = self.path_prefix
        ctx.origin = self.origin
        return ctx

    def region(self, variables: dict[Key, VarType], rng_streams: dict[str, Any],
               policy: AccessPolicy, store: Store = IR_STORE) -> "TraceContext":
        """The context a lifted region's body traces under: same modules (origin), scope,
        mutability and init flag as this one; the variables and streams it was handed."""
        ctx = TraceContext(variables, self.mutable, rng_streams, self.initializing, policy, store)
        ctx.path_prefix = self.path_prefix
        ctx.origin = self.origin
        ctx.module = self.module
        return ctx

    def use_passes(self, passes: tuple) -> None:
        """The passes the program's pipeline adds to the defaults (``passes=``): lifted
        bodies traced under this context run them too.  What they declare is kept beside
        them, since variable accesses consult it: ``lifted_like`` maps a collection such a
        pass creates to the one whose lifting it follows (``Pass.lifted_like``), and
        ``supplied`` names the variables they provide themselves (``Pass.supplies``):
        outside init, the model code's ``param``/``variable`` of a missing one reads it,
        for the pass to replace the read, instead of failing."""
        self.passes = tuple(passes)
        self.lifted_like: dict[str, str] = lifted_like(self.passes)
        self.supplied: frozenset[Key] = frozenset().union(*(p.supplies() for p in self.passes))

    def set_type(self, key: Key, vt: VarType) -> None:
        """Record a variable's new type; inner jit traces made before must not be reused."""
        old = self.variables.get(key)
        if old == vt:
            return
        self.variables[key] = vt
        self._fingerprint.retype(key, old, vt, lambda: self.fingerprint)

    def is_mutable(self, collection: str) -> bool:
        return filters.matches(self.mutable, collection)

    def full_path(self, name: str | Sequence[str]) -> Path:
        tail = (name,) if isinstance(name, str) else tuple(name)
        return self.path_prefix + tail


def lifted_like(passes: tuple) -> dict[str, str]:
    """The collections ``passes`` create, each with the collection whose lifting it follows."""
    return {c: like for p in passes for c, like in p.lifted_like().items()}


# --- the active context -----------------------------------------------------------------

class _Local(threading.local):
    """Each thread's stack of active contexts (``__init__`` runs once per thread)."""

    def __init__(self) -> None:
        self.stack: list[TraceContext | None] = []
        # While a pass's rule rewrites an equation (``in_rule``): the stack's depth then, and
        # the rule.  Model code at that depth or below is the rule's own, refused by
        # ``current``; a context entered on top (``PassContext.in_module``) is not.
        self.rule_depth: int = -1
        self.rule: object = None


_local = _Local()


def _stack() -> list[TraceContext | None]:
    return _local.stack


def current(api: str = "this function") -> TraceContext:
    """The active context; ``ScopeError`` naming ``api`` outside a trace, inside an init
    function, or inside a pass's rule (``in_rule``)."""
    stack = _local.stack
    if len(stack) <= _local.rule_depth:
        raise _in_rule_error(api, _local.rule)
    if not stack:
        raise errors.ScopeError(
            f"{api} was called outside a functionalized function: there is no variable "
            "store to read from or write to.", **errors.where(),
            fix="decorate the enclosing function with @vj.functionalize and call .init/.apply")
    ctx = stack[-1]
    if ctx is None:
        # The trace running the init function knows the module that called it.
        owner = next((c for c in reversed(stack) if c is not None), None)
        raise errors.ScopeError(
            f"{api} was called inside an init function; init functions compute a value "
            "from their arguments and cannot use variables or RNG streams.",
            **site(owner), fix="pass what the init function needs as init_args")
    return ctx


def _in_rule_error(api: str, rule: object) -> errors.ScopeError:
    """Model code run by a pass's rule on its own: the pass runs after the trace, so no
    module is active, and the trace's context (or an enclosing one, for a lifted body's
    pipeline) would draw keys no module owns.  The fix is the API that stands in for the
    module that traced the equation."""
    return errors.ScopeError(
        f"{api} was called in {type(rule).__qualname__}.rewrite, a rule of a pass: passes "
        "run after the model was traced, outside every module, so there is no module for "
        "it to draw keys or make variables as.",
        # The rule's line (the Python caller), not the equation's, which the rewriter set
        # as the current source; ``module`` is still the equation's.
        **{**errors.where(), "source": _jax.python_user_frame_text() or errors.source_text()},
        fix="run it as the module that traced the equation: `with region.ctx.in_module(eqn): "
            "...` (its keys are that module's next draws); declare the pass before = "
            "('lower-rng', ...) and see 'A pass that draws randomness' in "
            "notes/writing-passes.md")


class _Rule:
    """``with in_rule(rule):`` -- see ``_Local.rule_depth``."""

    def __init__(self, rule: object):
        self.rule = rule

    def __enter__(self) -> None:
        self.previous = _local.rule_depth, _local.rule
        _local.rule_depth, _local.rule = len(_local.stack), self.rule

    def __exit__(self, *exc: object) -> None:
        _local.rule_depth, _local.rule = self.previous


def in_rule(rule: object) -> _Rule:
    """``with in_rule(rule):`` the rewriter runs ``rule.rewrite``: model code (``vj.param``,
    ``vj.make_rng``) is an error naming the rule and ``PassContext.in_module``, unless run
    inside a context entered within the rule, which is what ``in_module`` does."""
    return _Rule(rule)


def active() -> TraceContext | None:
    stack = _local.stack      # not _stack(): every object-mode call asks, so one call less
    return stack[-1] if stack else None


def site(ctx: TraceContext | None = None, about: Labelled | None = None) -> dict[str, Any]:
    """``errors.where()`` while tracing: the user's line, and the label of the module
    whose method is running under ``ctx`` (the active context if not given) -- else of
    ``about``, the Module the error is about (``MLP/hidden (Dense)``, see ``errors``)."""
    ctx = active() if ctx is None else ctx
    module = ctx.module if ctx is not None and ctx.module is not None else about
    return errors.where(module=module._label() if module is not None else None)


def run_init(init_fn: Callable[..., Any], *args: Any) -> Any:
    """``init_fn(*args)`` as a pure function: under a constant jit key
    (``fingerprint.INIT_KEY``), and with a stack marker that makes any variable use an
    error."""
    stack = _stack()
    stack.append(None)
    previous = fingerprint.swap(fingerprint.INIT_KEY)
    try:
        return init_fn(*args)
    finally:
        stack.pop()
        fingerprint.restore(previous)


class _Activation:
    def __init__(self, ctx: TraceContext):
        self.ctx = ctx

    def __enter__(self) -> TraceContext:
        _stack().append(self.ctx)
        self.previous_key = fingerprint.swap(self.ctx.fingerprint)
        return self.ctx

    def __exit__(self, exc_type, *exc) -> None:
        _stack().pop()
        fingerprint.restore(self.previous_key)
        if exc_type is None and self.ctx.pending:
            pending = self.ctx.pending
            self.ctx.pending = {}
            raise next(iter(pending.values()))


def activate(ctx: TraceContext) -> _Activation:
    """``with activate(ctx):`` user code runs with ``ctx`` as the active context."""
    return _Activation(ctx)


# --- raw jax.vmap over a write ------------------------------------------------------------

def _set_batch(args, dims, *, collection, path, tree, lift):
    raise errors.TransformError(
        "a batched value is written to a variable under raw jax.vmap; a variable has one "
        "value, so varjax cannot tell which batch member should win.",
        collection=collection, path=path, **site(),
        fix="use the lifted vj.vmap (nn.vmap) with variable_axes={'%s': 0}, which keeps one "
            "copy per batch member along a variable axis" % collection)


# Registered here, not beside the primitive: the message names the running module, which
# only the tracing layer knows.
_jax.primitive_batchers[var_set_p] = _set_batch
