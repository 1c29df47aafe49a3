"""The variable API: ``vj.param`` / ``vj.variable`` / ``vj.sow`` / ``vj.make_rng`` and the
``*_at`` forms ``varjax.nn`` and the lifting layer call with an explicit context.

Each function consults the active ``TraceContext`` (``varjax.trace.context``): whether the
variable exists, its type, whether its collection is mutable.  Reads, writes and draws go
to the context's store (the IR, normally: ``var_get`` / ``var_set`` / ``rng_draw``), after
the context's one access guard.  Nothing here holds a value, so the same code traces for
``init`` and ``apply``.

Given variables are checked against what the code expects: ``param`` on an existing
variable evaluates ``init_fn`` abstractly (``jax.eval_shape``) to compare types, as Flax
does; ``variable(..., init_fn)`` does the same for a given value (``varjax.trace.type_checks``).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax

from varjax.ir import axis_metadata, errors, streams
from varjax.ir.primitives import Key, Path, VarType, bind_draw, is_internal
from varjax.ir.statics import Exact
from varjax.trace.context import TraceContext, active, current, run_init, site
from varjax.trace.type_checks import check_type, expect_given, expected_type, mismatch

# --- the free-function API -------------------------------------------------------------

def _subkeys(ctx: TraceContext, collection: str, path: Path) -> list[Key]:
    """The variables below ``path``: a variable whose value is a dict is stored as one
    variable per entry, as a variables dict nests it (so init and apply agree)."""
    n = len(path)
    return [k for k in ctx.variables if k[0] == collection and len(k[1]) > n and k[1][:n] == path]


def _exists(ctx: TraceContext, collection: str, path: Path) -> bool:
    return (collection, path) in ctx.variables or bool(_subkeys(ctx, collection, path))


def _read(ctx: TraceContext, collection: str, path: Path) -> Any:
    ctx.guard(collection, path)
    vt = ctx.variables.get((collection, path))
    if vt is None:                       # a dict-valued variable: read its entries
        value: dict[str, Any] = {}
        for _, sub in sorted(_subkeys(ctx, collection, path)):
            node = value
            for name in sub[len(path):-1]:
                node = node.setdefault(name, {})
            node[sub[-1]] = _read(ctx, collection, sub)
        return value
    return ctx.store.read(ctx, collection, path, vt)


def _check_collection(ctx: TraceContext, collection: str, path: Path) -> None:
    if is_internal(collection):
        raise errors.ScopeError(
            f"collection names starting with '__' are reserved for varjax's own scratch "
            f"variables; '{collection}' cannot be used.", collection=collection, path=path,
            **site(ctx), fix="rename the collection so that it does not start with '__'")


def _write(ctx: TraceContext, collection: str, path: Path, value: Any) -> None:
    ctx.guard(collection, path)
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
    ctx.store.write(ctx, collection, path, leaves, tree)


def _missing(ctx: TraceContext, collection: str, path: Path, why: str) -> errors.MissingVariableError:
    return errors.MissingVariableError(
        f"variable {errors.format_path(path)!s} of collection '{collection}' does not exist "
        f"and {why}.", collection=collection, path=path, **site(ctx),
        fix=f"pass it in the variables dict, or run init / apply with mutable=['{collection}'] "
            "so it can be created")


def has_variable(collection: str, name: str | Sequence[str]) -> bool:
    """Whether the variable exists at this point of the trace."""
    ctx = current("vj.has_variable")
    return has_at(ctx, collection, ctx.full_path(name))


def has_at(ctx: TraceContext, collection: str, path: Path) -> bool:
    ctx.guard(collection, path)
    return _exists(ctx, collection, path)


def read_at(ctx: TraceContext, collection: str, path: Path) -> Any:
    """The variable's current value; ``MissingVariableError`` if it does not exist."""
    ctx.guard(collection, path)
    if not _exists(ctx, collection, path):
        raise _missing(ctx, collection, path, "it was never created in this trace")
    return _read(ctx, collection, path)


def write_at(ctx: TraceContext, collection: str, path: Path, value: Any) -> None:
    """Store ``value`` (creating the variable); the collection must be mutable."""
    _check_collection(ctx, collection, path)
    if not ctx.is_mutable(collection):
        raise immutable_error(ctx, collection, path)
    _write(ctx, collection, path, value)


def immutable_error(ctx: TraceContext, collection: str, path: Path) -> errors.ImmutableCollectionError:
    return errors.ImmutableCollectionError(
        f"variable {errors.format_path(path)} is written, but collection '{collection}' "
        "is not mutable.", collection=collection, path=path, **site(ctx),
        fix=errors.mutable_fix(collection))


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
    given fallback (see ``varjax.ir.streams``).  A stream the enclosing lifted transform did
    not lift is an error, not a reason to fall back."""
    for stream in streams.candidates(name, fallbacks):
        if ctx.policy is not None:
            ctx.policy.check_stream(ctx, stream, where_)
        if stream in ctx.rng_streams:
            return stream
    tried = " nor ".join(f"'{s}'" for s in streams.candidates(name, fallbacks))
    raise errors.MissingRngError(
        f"RNG stream '{name}' was requested, but neither {tried} was provided." if fallbacks
        else f"RNG stream '{name}' was requested but not provided.",
        collection=name, path=where_ or None, **site(ctx),
        fix=f"pass rngs={{'{name}': jax.random.key(0)}} (or a vj.Rngs) to init/apply")


def draw_at(ctx: TraceContext, name: str, where_: Path,
            fallbacks: tuple[str, ...] = (streams.DEFAULT,),
            module: Path | None = None) -> jax.Array:
    """A fresh key from stream ``name`` or a fallback.  ``where_`` is for errors;
    ``module`` (default ``where_``) is the drawing module's path, which a stream under
    Linen's convention counts and folds in (``varjax.ir.streams``)."""
    stream = resolve_stream(ctx, name, where_, fallbacks)
    linen = streams.linen_counts(ctx.origin)
    if linen is None or stream not in linen.streams:
        return ctx.store.draw(ctx, stream)
    module = tuple(where_ if module is None else module)
    count = streams.linen_count(ctx, linen, stream, module)
    base = streams.linen_base(ctx)
    return _linen_draw(ctx, stream, module[len(base):] if module[:len(base)] == base else module,
                       count)


def hands_as_is(ctx: TraceContext, stream: str) -> bool:
    """Whether ``hand_key_at`` hands ``stream``'s key itself (Linen's convention), so that
    handing it draws nothing: a lift may then hand it to a body that never uses it."""
    linen = streams.linen_counts(ctx.origin)
    return linen is not None and stream in linen.streams and stream in ctx.rng_streams


def hand_key_at(ctx: TraceContext, stream: str, where_: Path) -> jax.Array:
    """The key a lifted transform hands its body for ``stream``: under Linen's
    convention the stream's key itself (the body folds in its own paths and counts, which
    continue the enclosing trace's), else one draw."""
    if not hands_as_is(ctx, stream):
        return draw_at(ctx, stream, where_)
    if ctx.policy is not None:
        ctx.policy.check_stream(ctx, stream, where_)
    return _linen_draw(ctx, stream, (), 0)


def _linen_draw(ctx: TraceContext, stream: str, module: Path, count: int) -> jax.Array:
    draw = getattr(ctx.store, "draw_linen", None)   # a store that resolves draws itself
    if draw is not None:
        return draw(ctx, stream, module, count)
    return bind_draw(stream, ctx.rng_streams[stream], module, count)


def param(name: str, init_fn: Callable[..., Any], *init_args: Any) -> Any:
    """Read parameter ``name``, creating it with ``init_fn(make_rng('params'), *init_args)``.

    An existing parameter is checked against the abstract result of ``init_fn``
    and a mismatch raises ``VariableShapeError``.
    """
    ctx = current("vj.param")
    return param_at(ctx, ctx.full_path(name), init_fn, init_args)


def param_at(ctx: TraceContext, path: Path, init_fn: Callable[..., Any], init_args: tuple) -> Any:
    ctx.guard("params", path)
    _ask(ctx, "params", path)
    if _exists(ctx, "params", path):
        value = _read(ctx, "params", path)
        have = ctx.variables.get(("params", path)) or VarType.of(value)   # known: no flatten
        check_type("params", path, have, expected_type(init_fn, init_args, True), ctx.module)
        return value
    if _supplied(ctx, "params", path, init_fn, init_args, True):
        return _read(ctx, "params", path)
    if not ctx.is_mutable("params"):
        raise _missing(ctx, "params", path, "collection 'params' is immutable, so it cannot be created")
    if not any(s in ctx.rng_streams for s in streams.candidates(streams.PARAMS)):
        raise errors.MissingRngError(
            f"creating parameter {errors.format_path(path)} needs the '{streams.PARAMS}' RNG "
            "stream, which was not provided.", collection="params", path=path, **site(ctx),
            fix="call init with a key or a vj.Rngs: fn.init(jax.random.key(0), ...)")
    value = run_init(init_fn, draw_at(ctx, streams.PARAMS, path, module=path[:-1]), *init_args)
    _write(ctx, "params", path, value)
    # Read back: every use of a parameter's value starts at a ``var_get``, in init as in
    # apply, so a pass that rewrites reads (cast, quantize, adapt) changes both alike;
    # forward-stores turns the read back into the stored value.
    return _read(ctx, "params", path)


def _ask(ctx: TraceContext, collection: str, path: Path) -> None:
    if (collection, path) in ctx.supplied:
        ctx.origin.asked.add((collection, path))


def _supplied(ctx: TraceContext, collection: str, path: Path, init_fn: Callable[..., Any],
              init_args: tuple, needs_key: bool) -> bool:
    """Whether a missing variable is one a pass provides (``Pass.supplies``) and is not
    created here (only ``init`` creates it, so that its initializer draws its key); if
    so it now exists, with the type ``init_fn`` would make, and reads of it are emitted
    for the pass to replace."""
    if (collection, path) not in ctx.supplied or (ctx.initializing and ctx.is_mutable(collection)):
        return False
    ctx.set_type((collection, path), expected_type(init_fn, init_args, needs_key))
    return True


class Variable:
    """A variable: ``.value`` reads it, ``.value = x`` writes it.  One class, two constructors.

    * ``vj.Variable(value, collection='params', **metadata)`` holds its value: object mode
      (``notes/object-mode.md``).  Metadata become attributes and ``get_metadata()``.
    * ``vj.variable(...)`` / ``Module.variable(...)`` return a *handle* on a variable of the
      running trace (``Variable.at``); so does an object-mode transform for each ``Variable``
      it is given, inside its body.  A handle holds no value: every access goes through the
      IR (``var_get``/``var_set``), so a read after a write inside a ``lax.scan`` body sees
      the carried value, not a Python-side cache.

    A ``Variable`` is a pytree with one child, its value (a handle's flatten reads it), so
    ``jax.tree.*`` and raw JAX transforms see the array; unflattening gives a held one.

    A handle made with ``unbox`` (``Module.variable``'s, as Linen's) reads a boxed value
    (``nn.Partitioned``) without its boxes, and a write of a value shaped like the unboxed
    one keeps the boxes (Linen's ``Variable.value``).
    """

    __slots__ = ("collection", "path", "_value", "_metadata", "_origin", "_unbox")

    def __init__(self, value: Any, *, collection: str = "params", **metadata: Any):
        if not isinstance(collection, str):
            raise errors.InvalidVariablesError(
                f"vj.Variable: collection must be a string, got {collection!r}.",
                **errors.where(), fix="vj.Variable(value, collection='params'); a handle on a "
                                      "variable of a trace is Variable.at(collection, path)")
        self.collection, self.path = collection, None
        self._value, self._metadata, self._origin, self._unbox = value, metadata, None, False

    @classmethod
    def at(cls, collection: str, path: Path, metadata: Mapping[str, Any] | None = None,
           origin: Any = None, unbox: bool = False) -> "Variable":
        """A handle on variable ``path`` of ``collection`` in the active trace (``origin``:
        the trace it must be used under, ``None`` for whichever is active)."""
        handle = object.__new__(cls)
        handle.collection, handle.path = collection, tuple(path)
        handle._value, handle._metadata, handle._origin = None, dict(metadata or {}), origin
        handle._unbox = unbox
        return handle

    def _ctx(self, api: str) -> TraceContext:
        ctx = active() if self._origin is not None else current(api)
        if self._origin is not None and (ctx is None or ctx.origin is not self._origin):
            raise errors.InvalidScopeError(
                f"variable {errors.format_path(self.path)} of collection '{self.collection}' "
                "was used after the object-mode transform that made its handle had returned.",
                collection=self.collection, path=self.path, **(site(ctx) if ctx else errors.where()),
                fix="return values out of the transformed function instead of keeping "
                    "the Variable objects it was given")
        return ctx

    @property
    def value(self) -> Any:
        if self.path is None:
            return self._value
        value = read_at(self._ctx("Variable.value"), self.collection, self.path)
        return axis_metadata.unbox(value, apply_constraint=False) if self._unbox else value

    @value.setter
    def value(self, new: Any) -> None:
        if self.path is None:
            self._value = new
            return
        ctx = self._ctx("Variable.value")
        if self._unbox:    # boxes read off the variable's type: nothing is read in the IR
            vt = ctx.variables.get((self.collection, self.path))
            new = axis_metadata.rebox(jax.tree.unflatten(vt.tree, vt.avals) if vt is not None
                                      else _read(ctx, self.collection, self.path), new)
        _write(ctx, self.collection, self.path, new)

    def __getitem__(self, index: Any) -> Any:
        return self.value[index]

    def __setitem__(self, index: Any, new: Any) -> None:
        self.value = new if index is Ellipsis else self.value.at[index].set(new)

    def __jax_array__(self) -> Any:
        return self.value

    def get_metadata(self) -> dict[str, Any]:
        """The metadata given at construction (``out_sharding=...`` and the like)."""
        return dict(self._metadata)

    def __getattr__(self, name: str) -> Any:
        # Only for names not found normally: metadata, then the value's (shape, dtype...).
        if name.startswith("_"):
            raise AttributeError(name)
        metadata = object.__getattribute__(self, "_metadata")
        if name in metadata:
            return metadata[name]
        return getattr(self.value, name)

    def __repr__(self) -> str:
        if self.path is not None:
            return f"Variable({self.collection}:{errors.format_path(self.path)})"
        extra = "".join(f", {k}={v!r}" for k, v in self._metadata.items())
        return f"Variable({self._value!r}, collection={self.collection!r}{extra})"


def _flatten_variable(v: Variable) -> tuple[tuple, tuple]:
    # Metadata keys JAX's caches by type and value (``tag=1`` and ``tag=1.0`` trace apart).
    return (v.value,), (v.collection, Exact(tuple(sorted(v._metadata.items()))))


def _unflatten_variable(aux: tuple, children: tuple) -> Variable:
    held = object.__new__(Variable)
    held.collection, held.path, held._origin, held._unbox = aux[0], None, None, False
    held._value, held._metadata = children[0], dict(aux[1].value)
    return held


jax.tree_util.register_pytree_node(Variable, _flatten_variable, _unflatten_variable)


def variable(collection: str, name: str | Sequence[str], init_fn: Callable[..., Any] | None = None,
             *init_args: Any) -> Variable:
    """A handle on variable ``name`` of ``collection``, created with ``init_fn(*init_args)``
    if it does not exist and the collection is mutable."""
    ctx = current("vj.variable")
    return variable_at(ctx, collection, ctx.full_path(name), init_fn, init_args)


def variable_at(ctx: TraceContext, collection: str, path: Path, init_fn: Callable[..., Any] | None,
                init_args: tuple, unbox: bool = False) -> Variable:
    """A handle on the variable, created with ``init_fn(*init_args)`` if missing (``unbox``:
    the handle reads and writes through boxes, see ``Variable``)."""
    _check_collection(ctx, collection, path)
    ctx.guard(collection, path)
    _ask(ctx, collection, path)
    if not _exists(ctx, collection, path):
        if init_fn is None:
            raise _missing(ctx, collection, path, "no init_fn was given to create it")
        if _supplied(ctx, collection, path, init_fn, init_args, False):
            return Variable.at(collection, path, unbox=unbox)
        if not ctx.is_mutable(collection):
            raise _missing(ctx, collection, path,
                           f"collection '{collection}' is immutable, so it cannot be created")
        _write(ctx, collection, path, run_init(init_fn, *init_args))
    elif init_fn is not None and ctx.variables.get((collection, path)) is ctx.given.get((collection, path)) \
            is not None:    # given, and not rewritten in this trace
        expect_given(ctx, collection, path, init_fn, init_args)
    return Variable.at(collection, path, unbox=unbox)


def append(xs: tuple, x: Any) -> tuple:
    return tuple(xs) + (x,)


def sow(collection: str, name: str | Sequence[str], value: Any,
        reduce_fn: Callable[[Any, Any], Any] = append,
        init_fn: Callable[[], Any] = tuple) -> bool:
    """Store ``value`` in ``collection`` if it is mutable; a no-op (returning False) if not.

    By default values accumulate in a tuple, as in Flax.
    """
    ctx = current("vj.sow")
    return sow_at(ctx, collection, ctx.full_path(name), value, reduce_fn, init_fn)


def sow_at(ctx: TraceContext, collection: str, path: Path, value: Any,
           reduce_fn: Callable[[Any, Any], Any] = append, init_fn: Callable[[], Any] = tuple) -> bool:
    _check_collection(ctx, collection, path)
    if not ctx.is_mutable(collection):
        return False          # before the guard: a no-op needs no lifting
    ctx.guard(collection, path)
    old = _read(ctx, collection, path) if _exists(ctx, collection, path) else init_fn()
    _write(ctx, collection, path, reduce_fn(old, value))
    return True

