"""Tracing: turning ``vj.param`` / ``vj.variable`` / ``vj.make_rng`` / ``vj.sow``
into variable effects in the jaxpr being traced.

While ``functionalize`` traces a function, a ``TraceContext`` is active.  It
knows, at trace time, which variables exist and with which structure and
avals, which collections are mutable and which RNG streams were given.  The
free functions below consult it and bind ``var_get`` / ``var_set`` /
``rng_draw``; they never hold values, so the same code traces for ``init`` and
``apply``.

Existence is tracked in trace order.  Code under raw JAX control flow is traced
once per branch/body, so a variable created in branch 0 of a raw ``lax.cond``
is seen as existing by branch 1; the discharge pass then reports which branch
failed to create it.

The context's fingerprint (a hash of variable types, mutability, streams,
init flag and scope) goes into JAX's jit cache key (see
``_jax.jit_key_state``), so an inner ``jax.jit`` function is re-traced exactly
when the variables it could see have changed, and reused otherwise.

Sharp edges:
  * ``param`` on an existing variable evaluates ``init_fn`` abstractly
    (``jax.eval_shape``) to check the shape, as Flax does; a slow init function
    costs trace time once per cache miss.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any, Callable, Mapping, Sequence

import jax

from varjax import _jax, errors, filters, streams
from varjax.caches import LRU
from varjax.primitives import Key, Path, VarType, bind_draw, bind_get, bind_set, is_internal
from varjax.statics import typed


@dataclasses.dataclass(frozen=True)
class Lifted:
    """What the body of a lifted transform may touch (see ``varjax.lifting``): variables
    whose collection matches one of ``groups``, and the RNG streams it was given.
    ``hidden`` are the enclosing trace's streams that were not lifted; ``fix`` tells
    the user how to lift a collection (``{collection}`` is filled in)."""

    name: str
    groups: tuple
    hidden: frozenset
    fix: str
    # Variables of the enclosing trace (or of any enclosing lifted region) that match a
    # filter but were not handed in, because they are outside the lifted module: touching
    # one raises ``LiftRetry`` and the lift runs again with it handed in.
    outside: frozenset = frozenset()
    # Variables the transform was given but did not hand to this body (it set them aside,
    # e.g. a variable without the mapped axis): touching one is an error, not a creation.
    withheld: frozenset = frozenset()

    def check(self, ctx: "TraceContext", collection: str, path: Path) -> None:
        key = (collection, path)
        if key in self.outside and key not in ctx.variables:
            raise LiftRetry(key)
        if key in self.withheld and key not in ctx.variables:
            raise errors.TransformError(
                f"variable {errors.format_path(path)} of collection '{collection}' is used inside "
                f"vj.{self.name}, which did not hand it to the body: its value does not fit the "
                "transform (for example, it lacks the mapped or scanned axis).",
                collection=collection, path=path, **where(ctx),
                fix=f"give it that axis, or lift '{collection}' without one (variable_axes "
                    "None, variable_broadcast)")
        if is_internal(collection) or any(filters.matches(f, collection) for f in self.groups):
            return
        raise errors.TransformError(
            f"variable {errors.format_path(path)} of collection '{collection}' is used inside "
            f"vj.{self.name}, but '{collection}' matches none of its variable filters, so the "
            "transform does not know how to lift it.", collection=collection, path=path,
            **where(ctx), fix=self.fix.format(collection=collection))


class LiftRetry(Exception):
    """A lifted body touched a variable outside the lifted module (a closure): not an error,
    the lift catches it and traces again with the variable handed in."""

    def __init__(self, key: Key):
        super().__init__(key)
        self.key = key


class DirectFallback(Exception):
    """A lifted body running directly (``Direct``) used a variable inside an inner JAX
    trace (a raw ``jit``/``scan`` body): the lift runs it again through the IR."""


class Direct:
    """The store of a lifted body that runs directly in its transform's trace: reads and
    writes are dictionary operations on the values handed in, and draws fold a static,
    order-based counter into the handed key, exactly as ``lower-rng`` would."""

    def __init__(self, values: dict[Key, Any], keys: Mapping[str, Any]):
        self.values = values
        self.keys = keys
        self.counters: dict[str, int] = {}
        self.written: set[Key] = set()


class TraceContext:
    """The variable view of one functionalize trace."""

    def __init__(self, variables: dict[Key, VarType], mutable: Any,
                 rng_streams: dict[str, Any], initializing: bool, lift: Lifted | None = None):
        self.variables = dict(variables)
        # Set in the body of a lifted transform: which collections it may touch.
        self.lift = lift
        # Set when a lifted body runs directly in its transform's trace (see Direct).
        self.direct: Direct | None = None
        self.mutable = mutable
        self.rng_streams = dict(rng_streams)
        self.initializing = initializing
        self.path_prefix: Path = ()
        self.given = dict(variables)
        # Given variables whose shape differs from what their init_fn makes, in a mutable
        # collection: an error unless a later write keeps the given shape (see _expect).
        self.pending: dict[Key, errors.VariableShapeError] = {}
        # Snapshots share their origin: a module bound in this trace may be used under
        # any of them (custom rules traced lazily), and under no other trace.
        self.origin = self
        # The Module whose method is running, for error messages (not part of the fingerprint).
        self.module: Any = None
        # The JAX trace the function runs in; a variable operation under any other trace
        # runs inside an inner transformation (see _observe).
        self.top_trace: Any = None
        # A trace that may create or retype variables changes the context inside inner
        # jax.jit bodies -- Python that a cache hit would skip.  Under strict fingerprints
        # such traces never share inner traces with other functionalize traces (a nonce);
        # fully immutable ones can.
        base = (filters.freeze(mutable), tuple(sorted(self.rng_streams.items())), initializing, lift)
        nonce = next(_nonces) if (initializing or mutable is not False) else None
        self._base = hash(base)
        self._strict_base = hash((base, nonce))
        self._vars_hash = 0
        for item in self.variables.items():
            self._vars_hash ^= hash(item)

    @property
    def fingerprint(self) -> tuple:
        """Everything a trace made under this context can depend on, hashed.

        Equal fingerprints mean an inner ``jax.jit`` trace can be reused safely, so
        JAX's caches keep working for library functions (``jax.nn.relu``...).  Until
        a variable operation has run inside an inner transformation, no inner trace can
        depend on variables, and the fingerprint leaves them out (see ``_observe``).
        """
        if self.direct is not None:
            # A direct body falls back as soon as a variable is used inside an inner trace,
            # so no inner trace made under it depends on variables: one shared key.
            return _DIRECT_KEY
        if _strict[0]:
            return ("varjax", self._strict_base, self._vars_hash, self.path_prefix)
        return ("varjax", self._base, self.path_prefix)

    def observe(self) -> None:
        """Called by every variable operation: the first one that runs inside an inner
        JAX trace (a jitted helper, a loop body...) switches the whole process to strict
        fingerprints, which include the variable view and a per-trace nonce.

        Before that switch, inner traces were made by code that never touched a variable
        (library functions), so sharing them across variable views and traces is safe;
        the inner trace that makes the switch was keyed non-strictly, and no non-strict
        key is ever looked up again."""
        if self.direct is not None:
            if _jax.current_trace() is not self.top_trace:
                raise DirectFallback()
            return
        if not _strict[0] and _jax.current_trace() is not self.top_trace:
            _strict[0] = True
            _JIT_KEY.set_local(self.fingerprint)

    def snapshot(self, variables: dict[Key, VarType]) -> "TraceContext":
        """A copy that sees the given variables plus ``variables`` as they are at one point
        of the program (variables created later are not visible).

        Passes re-trace user code after the trace has ended (custom_jvp/vjp rules are
        traced lazily); they must see variable types as of the call site, not the end.
        """
        ctx = TraceContext({**self.given, **variables}, self.mutable, self.rng_streams,
                           self.initializing, self.lift)
        ctx.path_prefix = self.path_prefix
        ctx.origin = self.origin
        return ctx

    def region(self, variables: dict[Key, VarType], rng_streams: dict[str, Any],
               lift: Lifted) -> "TraceContext":
        """The context a lifted region's body traces under: same modules (origin), scope,
        mutability and init flag as this one; the variables and streams it was handed."""
        ctx = TraceContext(variables, self.mutable, rng_streams, self.initializing, lift)
        ctx.path_prefix = self.path_prefix
        ctx.origin = self.origin
        ctx.module = self.module
        return ctx

    def set_type(self, key: Key, vt: VarType) -> None:
        """Record a variable's new type; inner jit traces made before must not be reused."""
        old = self.variables.get(key)
        if old == vt:
            return
        if old is not None:
            self._vars_hash ^= hash((key, old))
        self.variables[key] = vt
        self._vars_hash ^= hash((key, vt))
        if _strict[0]:
            _JIT_KEY.set_local(self.fingerprint)

    def is_mutable(self, collection: str) -> bool:
        return filters.matches(self.mutable, collection)

    def full_path(self, name: str | Sequence[str]) -> Path:
        tail = (name,) if isinstance(name, str) else tuple(name)
        return self.path_prefix + tail


_JIT_KEY = _jax.jit_key_state("varjax_trace_context")
_nonces = itertools.count()
_strict = [False]   # process-wide and one-way: see TraceContext.observe
_local = threading.local()


def _stack() -> list[TraceContext]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current(api: str = "this function") -> TraceContext:
    stack = _stack()
    if not stack:
        raise errors.ScopeError(
            f"{api} was called outside a functionalized function: there is no variable "
            "store to read from or write to.", **errors.where(),
            fix="decorate the enclosing function with @vj.functionalize and call .init/.apply")
    if stack[-1] is None:
        # The trace running the init function knows the module that called it.
        owner = next((c for c in reversed(stack) if c is not None), None)
        raise errors.ScopeError(
            f"{api} was called inside an init function; init functions compute a value "
            "from their arguments and cannot use variables or RNG streams.",
            **where(owner), fix="pass what the init function needs as init_args")
    return stack[-1]


def where(ctx: TraceContext | None = None, about: Any = None) -> dict[str, Any]:
    """``errors.where()`` while tracing: the user's line, and the ``_label()`` of the module
    whose method is running under ``ctx`` (the active context if not given) -- else of
    ``about``, the Module the error is about (``MLP/hidden (Dense)``, see ``errors``)."""
    ctx = active() if ctx is None else ctx
    module = ctx.module if ctx is not None and ctx.module is not None else about
    return errors.where(module=module._label() if module is not None else None)


def active() -> TraceContext | None:
    stack = _stack()
    return stack[-1] if stack else None


# Init functions are pure (key, shape -> value).  They run under one constant jit key, so
# the jitted library code they call (jax.random, initializers) is traced once per process
# instead of once per trace context; the stack marker makes any variable use an error.
_INIT_KEY = ("varjax", "init-fn")
_DIRECT_KEY = ("varjax", "direct")


def run_init(init_fn: Callable[..., Any], *args: Any) -> Any:
    stack = _stack()
    stack.append(None)
    previous = _JIT_KEY.swap_local(_INIT_KEY)
    try:
        return init_fn(*args)
    finally:
        stack.pop()
        _JIT_KEY.set_local(previous)


class _Activation:
    def __init__(self, ctx: TraceContext):
        self.ctx = ctx

    def __enter__(self) -> TraceContext:
        _stack().append(self.ctx)
        self.previous_key = _JIT_KEY.swap_local(self.ctx.fingerprint)
        return self.ctx

    def __exit__(self, exc_type, *exc) -> None:
        _stack().pop()
        _JIT_KEY.set_local(self.previous_key)
        if exc_type is None and self.ctx.pending:
            pending = self.ctx.pending
            self.ctx.pending = {}
            raise next(iter(pending.values()))


def activate(ctx: TraceContext) -> _Activation:
    return _Activation(ctx)


# --- the free-function API -------------------------------------------------------------

def _subkeys(ctx: TraceContext, collection: str, path: Path) -> list[Key]:
    """The variables below ``path``: a variable whose value is a dict is stored as one
    variable per entry, as a variables dict nests it (so init and apply agree)."""
    n = len(path)
    return [k for k in ctx.variables if k[0] == collection and len(k[1]) > n and k[1][:n] == path]


def _exists(ctx: TraceContext, collection: str, path: Path) -> bool:
    return (collection, path) in ctx.variables or bool(_subkeys(ctx, collection, path))


def _read(ctx: TraceContext, collection: str, path: Path) -> Any:
    ctx.observe()
    if ctx.lift is not None:
        ctx.lift.check(ctx, collection, path)
    vt = ctx.variables.get((collection, path))
    if vt is not None and ctx.direct is not None:
        return ctx.direct.values[(collection, path)]
    if vt is None:                       # a dict-valued variable: read its entries
        value: dict[str, Any] = {}
        for _, sub in sorted(_subkeys(ctx, collection, path)):
            node = value
            for name in sub[len(path):-1]:
                node = node.setdefault(name, {})
            node[sub[-1]] = _read(ctx, collection, sub)
        return value
    return jax.tree.unflatten(vt.tree, bind_get(collection, path, vt.tree, vt.avals))


def _check_collection(ctx: TraceContext, collection: str, path: Path) -> None:
    if is_internal(collection):
        raise errors.ScopeError(
            f"collection names starting with '__' are reserved for varjax's own scratch "
            f"variables; '{collection}' cannot be used.", collection=collection, path=path,
            **where(ctx), fix="rename the collection so that it does not start with '__'")


def _write(ctx: TraceContext, collection: str, path: Path, value: Any) -> None:
    ctx.observe()
    if ctx.lift is not None:
        ctx.lift.check(ctx, collection, path)
    if isinstance(value, Mapping) and value:
        for name, entry in value.items():   # stored as the variables dict nests it
            _write(ctx, collection, path + (str(name),), entry)
        return
    leaves, tree = jax.tree.flatten(value)
    leaves = [jax.numpy.asarray(x) for x in leaves]
    vt = VarType.of_leaves(tree, leaves)
    pending = ctx.pending.pop((collection, path), None)
    if pending is not None and mismatch(ctx.given[(collection, path)], vt) is not None:
        raise pending     # the code neither keeps the given shape nor gets the one it expects
    ctx.set_type((collection, path), vt)
    if ctx.direct is None:
        bind_set(collection, path, leaves, tree)
        return
    if not ctx.is_mutable(collection):
        raise _immutable(ctx, collection, path)
    # Stored values are strongly typed, as a var_get would read them back.
    leaves = [jax.lax.convert_element_type(x, x.dtype) if _jax.get_aval(x).weak_type else x
              for x in leaves]
    ctx.direct.values[(collection, path)] = jax.tree.unflatten(tree, leaves)
    ctx.direct.written.add((collection, path))


def _missing(ctx: TraceContext, collection: str, path: Path, why: str) -> errors.MissingVariableError:
    return errors.MissingVariableError(
        f"variable {errors.format_path(path)!s} of collection '{collection}' does not exist "
        f"and {why}.", collection=collection, path=path, **where(ctx),
        fix=f"pass it in the variables dict, or run init / apply with mutable=['{collection}'] "
            "so it can be created")


def has_variable(collection: str, name: str | Sequence[str]) -> bool:
    """Whether the variable exists at this point of the trace."""
    ctx = current("vj.has_variable")
    return has_at(ctx, collection, ctx.full_path(name))


def has_at(ctx: TraceContext, collection: str, path: Path) -> bool:
    ctx.observe()
    if ctx.lift is not None:
        ctx.lift.check(ctx, collection, path)
    return _exists(ctx, collection, path)


def read_at(ctx: TraceContext, collection: str, path: Path) -> Any:
    """The variable's current value; ``MissingVariableError`` if it does not exist."""
    if ctx.lift is not None:
        ctx.lift.check(ctx, collection, path)
    if not _exists(ctx, collection, path):
        raise _missing(ctx, collection, path, "it was never created in this trace")
    return _read(ctx, collection, path)


def write_at(ctx: TraceContext, collection: str, path: Path, value: Any) -> None:
    """Store ``value`` (creating the variable); the collection must be mutable."""
    _check_collection(ctx, collection, path)
    if not ctx.is_mutable(collection):
        raise _immutable(ctx, collection, path)
    _write(ctx, collection, path, value)


def _immutable(ctx: TraceContext, collection: str, path: Path) -> errors.ImmutableCollectionError:
    return errors.ImmutableCollectionError(
        f"variable {errors.format_path(path)} is written, but collection '{collection}' "
        "is not mutable.", collection=collection, path=path, **where(ctx),
        fix=f"pass mutable=['{collection}'] to apply")


def is_initializing() -> bool:
    """True while tracing for ``init`` (Flax's ``Module.is_initializing``)."""
    return current("vj.is_initializing").initializing


def is_mutable_collection(collection: str) -> bool:
    return current("vj.is_mutable_collection").is_mutable(collection)


def make_rng(name: str = streams.PARAMS) -> jax.Array:
    """A fresh key from RNG stream ``name`` (or, if it was not given, from ``default``):
    different on every call, same for same inputs."""
    ctx = current("vj.make_rng")
    return draw_at(ctx, name, ctx.path_prefix)


def resolve_stream(ctx: TraceContext, name: str, where_: Path,
                   fallbacks: tuple[str, ...] = (streams.DEFAULT,)) -> str:
    """The stream a draw from ``name`` comes from: ``name`` if it was given, else the first
    given fallback (see ``varjax.streams``).  A stream the enclosing lifted transform did
    not lift is an error, not a reason to fall back."""
    for stream in streams.candidates(name, fallbacks):
        if ctx.lift is not None and stream in ctx.lift.hidden:
            raise errors.TransformError(
                f"RNG stream '{stream}' is used inside vj.{ctx.lift.name}, which was not asked "
                "to lift it.", collection=stream, path=where_ or None, **where(ctx),
                fix=f"include '{stream}' in the transform's rngs filter")
        if stream in ctx.rng_streams:
            return stream
    tried = " nor ".join(f"'{s}'" for s in streams.candidates(name, fallbacks))
    raise errors.MissingRngError(
        f"RNG stream '{name}' was requested, but neither {tried} was provided." if fallbacks
        else f"RNG stream '{name}' was requested but not provided.",
        collection=name, path=where_ or None, **where(ctx),
        fix=f"pass rngs={{'{name}': jax.random.key(0)}} (or a vj.Rngs) to init/apply")


def draw_at(ctx: TraceContext, name: str, where_: Path,
            fallbacks: tuple[str, ...] = (streams.DEFAULT,)) -> jax.Array:
    """A fresh key from stream ``name`` or a fallback; ``where_`` (the module path) is for
    errors only."""
    stream = resolve_stream(ctx, name, where_, fallbacks)
    direct = ctx.direct
    if direct is not None:
        ctx.observe()
        n = direct.counters.get(stream, 0)
        direct.counters[stream] = n + 1
        return jax.random.fold_in(direct.keys[stream], n)
    return bind_draw(stream, ctx.rng_streams[stream])


_expected = LRU()   # _memo_key -> VarType


def _memo_key(init_fn: Callable, args: tuple, needs_key: bool) -> Any:
    """Initializers are usually fresh closures (``lecun_normal()``): key them by code and
    captured values, which determine the result's type (by type and value: a captured
    ``1`` and ``1.0`` give different dtypes).  None when not hashable."""
    code = getattr(init_fn, "__code__", None)
    try:
        cells = tuple(c.cell_contents for c in getattr(init_fn, "__closure__", None) or ())
        key = (code, typed(cells), typed(getattr(init_fn, "__defaults__", None))) if code \
            else (init_fn,)
        key += (typed(args), needs_key)
        hash(key)
        return key
    except (TypeError, ValueError):
        return None


def expected_type(init_fn: Callable, args: tuple, needs_key: bool) -> VarType:
    """The type ``init_fn`` would produce, computed abstractly (nothing runs)."""
    memo = _memo_key(init_fn, args, needs_key)
    found = _expected.get(memo) if memo is not None else None
    if found is not None:
        return found
    if needs_key:
        out = jax.eval_shape(lambda k: init_fn(k, *args), jax.ShapeDtypeStruct((), _key_dtype()))
    else:
        out = jax.eval_shape(lambda: init_fn(*args))
    found = VarType(jax.tree.structure(out), tuple(
        _jax.ShapedArray(x.shape, x.dtype) for x in jax.tree.leaves(out)))
    if memo is not None:
        _expected[memo] = found
    return found


def _key_dtype() -> Any:
    return jax.eval_shape(lambda: jax.random.key(0)).dtype


def mismatch(have: VarType, want: VarType) -> str | None:
    """Why a value of type ``have`` cannot stand for one of type ``want``, or None.

    Structure and shapes must agree.  A floating (or complex) dtype may stand for another
    one, as in Linen: half-precision inference from an f32 checkpoint reads the bf16
    values as given.  Any other dtype change (an int for a float) is a mismatch."""
    if have.tree != want.tree:
        return "its structure differs"
    for a, b in zip(have.avals, want.avals):
        if a.shape != b.shape:
            return "its shape differs"
        if a.dtype != b.dtype and not (jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) and
                                       jax.numpy.issubdtype(b.dtype, jax.numpy.inexact)):
            return "its dtype is of another kind"
    return None


def shape_error(collection: str, path: Path, have: VarType, want: VarType, why: str,
                **where_: Any) -> errors.VariableShapeError:
    fix = "re-initialize the variables for these input shapes, or fix the init function"
    if have.tree != want.tree and want.tree.num_leaves == 1 and not want.tree.children():
        fix = f"pass an array (jnp.asarray(value)) for it, not a {have.tree.node_data()[0].__name__}" \
            if have.tree.node_data() else fix
    return errors.VariableShapeError(
        f"the given value of variable {errors.format_path(path)} has type "
        f"{have.describe()}, but the code expects {want.describe()}: {why}.",
        collection=collection, path=path, **where_, fix=fix)


def check_type(collection: str, path: Path, have: VarType, want: VarType,
               module: Any = None) -> None:
    """``VariableShapeError`` unless ``have`` can stand for ``want`` (see ``mismatch``);
    ``module`` is the Module reading the variable, for the message."""
    why = mismatch(have, want)
    if why is not None:
        raise shape_error(collection, path, have, want, why,
                          **errors.where(module=module._label() if module is not None else None))


def _expect(ctx: TraceContext, collection: str, path: Path, init_fn: Callable[..., Any],
            init_args: tuple) -> None:
    """A given variable read through ``variable(..., init_fn, ...)`` must have the type
    ``init_fn`` makes (a ``(1,)`` mean from another model would broadcast silently).

    In an immutable collection that is checked here.  In a mutable one the code may treat
    the given shape as the real one and ``init_fn`` as the shape to create -- a decode
    cache declared with the one-step key's shape and written back at its full length --
    so a mismatch is an error only if no later write keeps the given shape (``_write``,
    and ``_Activation.__exit__`` for a variable never written)."""
    have = ctx.given[(collection, path)]
    want = expected_type(init_fn, init_args, False)
    why = mismatch(have, want)
    if why is None:
        return
    error = shape_error(collection, path, have, want, why, **where(ctx))
    if not ctx.is_mutable(collection):
        raise error
    ctx.pending[(collection, path)] = error


def param(name: str, init_fn: Callable[..., Any], *init_args: Any) -> Any:
    """Read parameter ``name``, creating it with ``init_fn(make_rng('params'), *init_args)``.

    An existing parameter is checked against the abstract result of ``init_fn``
    and a mismatch raises ``VariableShapeError``.
    """
    ctx = current("vj.param")
    return param_at(ctx, ctx.full_path(name), init_fn, init_args)


def param_at(ctx: TraceContext, path: Path, init_fn: Callable[..., Any], init_args: tuple) -> Any:
    ctx.observe()
    if ctx.lift is not None:
        ctx.lift.check(ctx, "params", path)
    if _exists(ctx, "params", path):
        value = _read(ctx, "params", path)
        check_type("params", path, VarType.of(value), expected_type(init_fn, init_args, True),
                   ctx.module)
        return value
    if not ctx.is_mutable("params"):
        raise _missing(ctx, "params", path, "collection 'params' is immutable, so it cannot be created")
    if not any(s in ctx.rng_streams for s in streams.candidates(streams.PARAMS)):
        raise errors.MissingRngError(
            f"creating parameter {errors.format_path(path)} needs the '{streams.PARAMS}' RNG "
            "stream, which was not provided.", collection="params", path=path, **where(ctx),
            fix="call init with a key or a vj.Rngs: fn.init(jax.random.key(0), ...)")
    value = run_init(init_fn, draw_at(ctx, streams.PARAMS, path), *init_args)
    _write(ctx, "params", path, value)
    return value


class Variable:
    """A handle on one variable: ``.value`` reads it, ``.value = x`` writes it.

    Every access goes through the IR, so a read after a write inside a
    ``lax.scan`` body sees the carried value, not a Python-side cache.
    """

    __slots__ = ("collection", "path")

    def __init__(self, collection: str, path: Path):
        self.collection = collection
        self.path = path

    @property
    def value(self) -> Any:
        return read_at(current("Variable.value"), self.collection, self.path)

    @value.setter
    def value(self, new: Any) -> None:
        _write(current("Variable.value"), self.collection, self.path, new)

    def __repr__(self) -> str:
        return f"Variable({self.collection}:{errors.format_path(self.path)})"


def variable(collection: str, name: str | Sequence[str], init_fn: Callable[..., Any] | None = None,
             *init_args: Any) -> Variable:
    """A handle on variable ``name`` of ``collection``, created with ``init_fn(*init_args)``
    if it does not exist and the collection is mutable."""
    ctx = current("vj.variable")
    return variable_at(ctx, collection, ctx.full_path(name), init_fn, init_args)


def variable_at(ctx: TraceContext, collection: str, path: Path, init_fn: Callable[..., Any] | None,
                init_args: tuple) -> Variable:
    ctx.observe()
    _check_collection(ctx, collection, path)
    if ctx.lift is not None:
        ctx.lift.check(ctx, collection, path)
    if not _exists(ctx, collection, path):
        if init_fn is None:
            raise _missing(ctx, collection, path, "no init_fn was given to create it")
        if not ctx.is_mutable(collection):
            raise _missing(ctx, collection, path,
                           f"collection '{collection}' is immutable, so it cannot be created")
        _write(ctx, collection, path, run_init(init_fn, *init_args))
    elif init_fn is not None and ctx.variables.get((collection, path)) is ctx.given.get((collection, path)) \
            is not None:    # given, and not rewritten in this trace
        _expect(ctx, collection, path, init_fn, init_args)
    return Variable(collection, path)


def _append(xs: tuple, x: Any) -> tuple:
    return tuple(xs) + (x,)


def sow(collection: str, name: str | Sequence[str], value: Any,
        reduce_fn: Callable[[Any, Any], Any] = _append,
        init_fn: Callable[[], Any] = tuple) -> bool:
    """Store ``value`` in ``collection`` if it is mutable; a no-op (returning False) if not.

    By default values accumulate in a tuple, as in Flax.
    """
    ctx = current("vj.sow")
    return sow_at(ctx, collection, ctx.full_path(name), value, reduce_fn, init_fn)


def sow_at(ctx: TraceContext, collection: str, path: Path, value: Any,
           reduce_fn: Callable[[Any, Any], Any] = _append, init_fn: Callable[[], Any] = tuple) -> bool:
    ctx.observe()
    _check_collection(ctx, collection, path)
    if not ctx.is_mutable(collection):
        return False          # before the lift check: a no-op needs no lifting
    if ctx.lift is not None:
        ctx.lift.check(ctx, collection, path)
    old = _read(ctx, collection, path) if _exists(ctx, collection, path) else init_fn()
    _write(ctx, collection, path, reduce_fn(old, value))
    return True
