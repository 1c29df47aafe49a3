"""Checks of given variables against what the code expects.

A variable handed to ``apply`` may come from another model or an old checkpoint; reading it
where the code would create one with ``init_fn`` is only safe if it has the type ``init_fn``
would make.  That type is computed abstractly (``jax.eval_shape``, nothing runs) and
memoised, since the same initializer closure is asked about once per layer.

Sharp edges:
  * A slow init function costs trace time once per cache miss (its abstract result is
    memoised by code and captured values).
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from varjax import _jax
from varjax.ir import axis_metadata, errors
from varjax.ir.caches import LRU
from varjax.ir.primitives import Path, VarType
from varjax.ir.protocols import Labelled
from varjax.ir.statics import typed
from varjax.trace.context import TraceContext, site

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

    Structure and shapes must agree, boxes of axis metadata (``nn.Partitioned``) aside:
    as in Linen, unboxed values stand for what a boxing initializer makes, and boxed ones
    for a plain initializer's.  A floating (or complex) dtype may stand for another
    one, as in Linen: half-precision inference from an f32 checkpoint reads the bf16
    values as given.  Any other dtype change (an int for a float) is a mismatch."""
    if have.tree != want.tree and not axis_metadata.equal_unboxed(have.tree, want.tree):
        kinds = {t.node_data()[0] for t in (have.tree, want.tree) if t.node_data()}
        if len(kinds) == 2 and len({k.__name__ for k in kinds}) == 1:   # flax's box vs ours
            return ("its structure differs: its node is a {0.__module__}.{0.__qualname__}, "
                    "not the expected {1.__module__}.{1.__qualname__}").format(
                        have.tree.node_data()[0], want.tree.node_data()[0])
        return "its structure differs"
    for a, b in zip(have.avals, want.avals):
        if a.shape != b.shape:
            return "its shape differs"
        if a.dtype != b.dtype and not (jax.numpy.issubdtype(a.dtype, jax.numpy.inexact) and
                                       jax.numpy.issubdtype(b.dtype, jax.numpy.inexact)):
            return "its dtype is of another kind"
    return None


def shape_error(collection: str, path: Path, have: VarType, want: VarType, why: str,
                fix: str = "re-initialize the variables for these input shapes, or fix the init function",
                **where_: Any) -> errors.VariableShapeError:
    if have.tree != want.tree and want.tree.num_leaves == 1 and not want.tree.children():
        fix = f"pass an array (jnp.asarray(value)) for it, not a {have.tree.node_data()[0].__name__}" \
            if have.tree.node_data() else fix
    return errors.VariableShapeError(
        f"the given value of variable {errors.format_path(path)} has type "
        f"{have.describe()}, but the code expects {want.describe()}: {why}.",
        collection=collection, path=path, **where_, fix=fix)


def branch_types_error(what: str, collection: str, path: Path, first: tuple[str, VarType],
                       other: tuple[str, VarType], before: VarType | None = None,
                       **where: Any) -> errors.VariableStructureError:
    """Two branches of a cond/switch leave a variable with different types: JAX would name
    only the position of the mismatch in varjax's own output, so name the variable and the
    branches (``(label, type)`` each) here, for the lifted and the object-mode forms."""
    was = f" (it was {before.describe()} before)" if before is not None else ""
    return errors.VariableStructureError(
        f"{what}: variable {errors.format_path(path)} of collection '{collection}' is "
        f"{first[1].describe()} after {first[0]} but {other[1].describe()} after {other[0]}"
        f"{was}; JAX needs every branch to leave it with one type.",
        collection=collection, path=path, **where,
        fix="write the variable a value of its own dtype in every branch "
            "(x.astype(v.value.dtype))")


def check_type(collection: str, path: Path, have: VarType, want: VarType,
               module: Labelled | None = None) -> None:
    """``VariableShapeError`` unless ``have`` can stand for ``want`` (see ``mismatch``);
    ``module`` is the Module reading the variable, for the message."""
    why = mismatch(have, want)
    if why is not None:
        raise shape_error(collection, path, have, want, why,
                          **errors.where(module=module._label() if module is not None else None))


def expect_given(ctx: TraceContext, collection: str, path: Path, init_fn: Callable[..., Any],
            init_args: tuple) -> None:
    """A given variable read through ``variable(..., init_fn, ...)`` must have the type
    ``init_fn`` makes (a ``(1,)`` mean from another model would broadcast silently).

    In an immutable collection that is checked here.  In a mutable one the code may treat
    the given shape as the real one and ``init_fn`` as the shape to create -- a decode
    cache declared with the one-step key's shape and written back at its full length --
    so a mismatch is an error only if no later write keeps the given shape (``_write``,
    and ``context.activate``'s exit for a variable never written).

    Linen never calls ``init_fn`` for an existing variable, so code may pass arguments it
    cannot run on then (``make_rng(...) if not exists else None``): an ``init_fn`` that
    fails on them leaves the variable unchecked rather than failing the call."""
    have = ctx.given[(collection, path)]
    try:
        want = expected_type(init_fn, init_args, False)
    except errors.VarjaxError:
        raise
    except Exception:     # noqa: BLE001 -- any failure of user code: not checkable
        return
    why = mismatch(have, want)
    if why is None:
        return
    error = shape_error(collection, path, have, want, why, **site(ctx))
    if not ctx.is_mutable(collection):
        raise error
    ctx.pending[(collection, path)] = error
