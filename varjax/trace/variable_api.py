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

from typing import Any, Callable, Sequence

import jax

from varjax.ir import errors, streams
from varjax.ir.primitives import Path, VarType, bind_draw, is_internal
from varjax.ir.typing import PyTree
from varjax.trace.context import TraceContext, current, run_init, site
from varjax.trace.type_checks import check_type, expect_given, expected_type
from varjax.trace.variable import Variable
from varjax.trace.variable_access import exists, missing_error, read_value, write_value
from varjax.trace.variable_access import read_at as read_at  # the API's read, beside write_at

# --- the free-function API -------------------------------------------------------------

def _check_collection(ctx: TraceContext, collection: str, path: Path) -> None:
    if is_internal(collection):
        raise errors.ScopeError(
            f"collection names starting with '__' are reserved for varjax's own scratch "
            f"variables; '{collection}' cannot be used.", collection=collection, path=path,
            **site(ctx), fix="rename the collection so that it does not start with '__'")


def has_variable(collection: str, name: str | Sequence[str]) -> bool:
    """Whether the variable exists at this point of the trace."""
    ctx = current("vj.has_variable")
    return has_at(ctx, collection, ctx.full_path(name))


def has_at(ctx: TraceContext, collection: str, path: Path) -> bool:
    ctx.guard(collection, path)
    return exists(ctx, collection, path)


def write_at(ctx: TraceContext, collection: str, path: Path, value: Any) -> None:
    """Store ``value`` (creating the variable); the collection must be mutable."""
    _check_collection(ctx, collection, path)
    if not ctx.is_mutable(collection):
        raise immutable_error(ctx, collection, path)
    write_value(ctx, collection, path, value)


def immutable_error(ctx: TraceContext, collection: str, path: Path) -> errors.ImmutableCollectionError:
    return errors.ImmutableCollectionError(
        f"variable {errors.format_path(path)} is written, but collection '{collection}' "
        "is not mutable.", collection=collection, path=path, **site(ctx),
        fix=errors.mutable_fix(collection))


def is_initializing() -> bool:
    """True while tracing for ``init`` (Flax's ``Module.is_initializing``)."""
    return current("vj.is_initializing").initializing


def is_mutable_collection(collection: str) -> bool:
    """Whether the call being traced may write ``collection`` (its ``mutable=``), so a
    function can skip an update (``batch_stats``) that ``apply`` would refuse."""
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
        fix=errors.rng_fix(name))


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


def param(name: str, init_fn: Callable[..., Any], *init_args: Any) -> PyTree:
    """Read parameter ``name``, creating it with ``init_fn(make_rng('params'), *init_args)``.

    An existing parameter is checked against the abstract result of ``init_fn``
    and a mismatch raises ``VariableShapeError``.
    """
    ctx = current("vj.param")
    return param_at(ctx, ctx.full_path(name), init_fn, init_args)


def param_at(ctx: TraceContext, path: Path, init_fn: Callable[..., Any], init_args: tuple) -> Any:
    ctx.guard("params", path)
    _ask(ctx, "params", path)
    if exists(ctx, "params", path):
        value = read_value(ctx, "params", path)
        have = ctx.variables.get(("params", path)) or VarType.of(value)   # known: no flatten
        check_type("params", path, have, expected_type(init_fn, init_args, True), ctx.module)
        return value
    if _supplied(ctx, "params", path, init_fn, init_args, True):
        return read_value(ctx, "params", path)
    if not ctx.is_mutable("params"):
        raise missing_error(ctx, "params", path, "collection 'params' is immutable, so it cannot be created")
    if not any(s in ctx.rng_streams for s in streams.candidates(streams.PARAMS)):
        raise errors.MissingRngError(
            f"creating parameter {errors.format_path(path)} needs the '{streams.PARAMS}' RNG "
            "stream, which was not provided.", collection="params", path=path, **site(ctx),
            fix="call init with a key or a vj.Rngs: fn.init(jax.random.key(0), ...)")
    value = run_init(init_fn, draw_at(ctx, streams.PARAMS, path, module=path[:-1]), *init_args)
    write_value(ctx, "params", path, value)
    # Read back: every use of a parameter's value starts at a ``var_get``, in init as in
    # apply, so a pass that rewrites reads (cast, quantize, adapt) changes both alike;
    # forward-stores turns the read back into the stored value.
    return read_value(ctx, "params", path)


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
    if not exists(ctx, collection, path):
        if init_fn is None:
            raise missing_error(ctx, collection, path, "no init_fn was given to create it")
        if _supplied(ctx, collection, path, init_fn, init_args, False):
            return Variable.at(collection, path, unbox=unbox)
        if not ctx.is_mutable(collection):
            raise missing_error(ctx, collection, path,
                           f"collection '{collection}' is immutable, so it cannot be created")
        write_value(ctx, collection, path, run_init(init_fn, *init_args))
    elif init_fn is not None and ctx.variables.get((collection, path)) is ctx.given.get((collection, path)) \
            is not None:    # given, and not rewritten in this trace
        expect_given(ctx, collection, path, init_fn, init_args)
    return Variable.at(collection, path, unbox=unbox)


def append(xs: tuple, x: Any) -> tuple:
    return tuple(xs) + (x,)


def sow(collection: str, name: str | Sequence[str], value: PyTree,
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
    old = read_value(ctx, collection, path) if exists(ctx, collection, path) else init_fn()
    write_value(ctx, collection, path, reduce_fn(old, value))
    return True

