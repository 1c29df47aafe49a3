"""Model code run by a pass: ``PassContext.in_module`` for a traced program.

A pass that adds variables (LoRA adapters beside a kernel) should make them exactly as
the module that owns the kernel would: at its path, created in ``init`` and read in
``apply``, with keys drawn as that module's next draws.  The simplest way to get all of
that right is to run ordinary model code -- ``vj.param`` and friends -- under a trace
context that stands where the module stood.  ``PassScopes`` builds that context once per
pipeline run from the context the program was traced under:

* it sees the trace's variables as they were at the end of the trace, so a pass never
  re-creates a variable the module made, and the ones the pass creates stay visible to
  its later rewrites (a module called twice finds its adapters);
* it keeps the trace's mutability, init flag, RNG streams and lifting policy, so a pass
  inside a lifted body is held to what the transform lifted;
* under Linen's RNG convention its draw counts continue from the counts the trace ended
  with, on a copy: running the pipeline again (``vj.dump``) draws the same keys, and an
  adapter created after a module's own parameters gets the key Linen would give a
  parameter the module declared after them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import jax

from varjax import _jax, errors, scope, streams, type_checks
from varjax.context import IR_STORE, TraceContext, activate, current, run_init
from varjax.primitives import Path, VarType


class PassScopes:
    """``modules`` of a ``PassContext``: enters model code at a module path."""

    def __init__(self, traced: TraceContext):
        self._traced = traced
        self._ctx: TraceContext | None = None

    def _context(self) -> TraceContext:
        if self._ctx is None:
            t = self._traced
            ctx = TraceContext(t.given, t.mutable, t.rng_streams, t.initializing, t.policy, IR_STORE)
            for key, vt in t.variables.items():
                ctx.set_type(key, vt)
            ctx.use_passes(t.passes)
            linen = streams.linen_counts(t.origin)
            if linen is not None:
                streams.start_linen(ctx, linen.streams)
                streams.linen_counts(ctx).restore(linen.snapshot())
                streams.set_linen_base(ctx, streams.linen_base(t))
            self._ctx = ctx
        return self._ctx

    @contextlib.contextmanager
    def __call__(self, path: Path) -> Iterator[TraceContext]:
        ctx = self._context()
        previous = ctx.path_prefix, ctx.top_trace
        ctx.path_prefix, ctx.top_trace = tuple(path), _jax.current_trace()
        try:
            with activate(ctx):
                yield ctx
        finally:
            ctx.path_prefix, ctx.top_trace = previous


def declare(owner: str, collection: str, name: tuple[str, ...], init_fn: Callable[..., Any],
            shape: tuple[int, ...], dtype: Any, source_info: Any) -> jax.Array:
    """The array variable ``name`` that pass ``owner`` (its spec) declares at the module
    ``PassContext.in_module`` stands in: read when it exists, created from the module's next
    ``params`` draw when the collection is mutable.

    A given one is checked against ``shape``/``dtype`` as a model's own variables are
    (``type_checks.mismatch``): adapters made with ``lora{rank=4}`` read by ``lora{rank=2}``
    are a ``VariableShapeError``, not a silently different model."""
    ctx = current(owner)
    path = ctx.full_path(name)
    where = errors.where(source_info)
    if scope.has_at(ctx, collection, path):
        have = ctx.variables[(collection, path)]
        want = VarType(jax.tree.structure(0), (_jax.ShapedArray(tuple(shape), dtype),))
        why = type_checks.mismatch(have, want)
        if why is not None:
            raise type_checks.shape_error(
                collection, path, have, want, why, **where,
                fix=f"give the variables made with the same pass options ({owner}), or make "
                    "them again with these")
        return scope.read_at(ctx, collection, path)
    if not ctx.is_mutable(collection):
        raise errors.MissingVariableError(
            f"variable {errors.format_path(path)} of collection '{collection}', which pass "
            f"'{owner}' declares, was not given, and '{collection}' is not mutable, so it "
            "cannot be created.", collection=collection, path=path, **where,
            fix=f"pass the variables that init returned with passes='{owner}' (they include "
                f"the '{collection}' collection), or apply with mutable=['{collection}'] to "
                "create them")
    scope.write_at(ctx, collection, path, run_init(init_fn, scope.make_rng("params"), shape, dtype))
    return scope.read_at(ctx, collection, path)
