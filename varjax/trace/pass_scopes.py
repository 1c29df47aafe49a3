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
  parameter the module declared after them.  A lifted body's trace adopted from another
  start (``lifting.body.with_counts_moved``: ``scan``'s loop trace) did not run, so the
  counts are its start: the context continues from its end, which the lift gives
  (``linen_end``), or an adapter would get its kernel's key;
* a pass variable a lift created in the trace before its transform (``CreateOutside``: the
  LoRA adapter of a kernel handed to an ``nn.cond``) is made again when the pass's rewrite
  reaches that creation (``recreate``), as the pass's draw there, or dropped when the pass
  created it at an earlier read: every variable of a pass takes its keys from this one
  copy of the counts, in program order, so two adapters of one module never share a key.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import jax

from varjax import _jax
from varjax.ir import errors, streams
from varjax.ir.primitives import Key, Path, VarType
from varjax.trace import type_checks, variable_api
from varjax.trace.context import IR_STORE, TraceContext, activate, current, run_init


class PassScopes:
    """``modules`` of a ``PassContext``: enters model code at a module path."""

    def __init__(self, traced: TraceContext, linen_end: dict | None = None):
        self._traced = traced
        self._linen_end = linen_end
        self._ctx: TraceContext | None = None

    def _context(self) -> TraceContext:
        if self._ctx is None:
            t = self._traced
            ctx = TraceContext(t.given, t.mutable, t.rng_streams, t.initializing, t.policy, IR_STORE)
            for key, vt in t.variables.items():
                ctx.set_type(key, vt)
            ctx.use_passes(t.passes)
            ctx.created_outside = dict(t.created_outside)
            linen = streams.linen_counts(t.origin)
            if linen is not None:
                streams.start_linen(ctx, linen.streams)
                end = linen.snapshot() if self._linen_end is None else self._linen_end
                streams.linen_counts(ctx).restore(end)
                streams.set_linen_base(ctx, streams.linen_base(t))
            self._ctx = ctx
        return self._ctx

    def created_outside(self, key: Key | None = None) -> bool:
        """Whether a lift created pass variable ``key`` (None: any) in the traced program
        just before its transform (``CreateOutside``), and the rewrite has not reached that
        yet."""
        made = self._context().created_outside
        return bool(made) if key is None else key in made

    def recreate(self, key: Key) -> None:
        """The rewrite reached the ``var_set`` by which a lift created pass variable ``key``
        before its transform (``CreateOutside``), which the rewrite drops.  Unless
        ``declare`` created the variable at an earlier read (a kernel whose matmul runs
        before the cond that is handed it), it is created here, drawn as this pass's next
        draw of its module: the lift drew it during the trace, from counts no later draw of
        the pass knows of, so another adapter of the same module would get its key.
        Later reads find it existing either way."""
        made = self._context().created_outside.pop(key)
        if isinstance(made, Creation):
            with self(made.module) as ctx:
                _create(ctx, key, made.init_fn, made.shape, made.dtype)

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


@dataclasses.dataclass(frozen=True)
class Creation:
    """How a lift created a pass variable before its transform (``CreateOutside``): kept on
    the trace (``TraceContext.created_outside``) so that the pass, rewriting that trace,
    can create it again with its own draws (``PassScopes.recreate``)."""

    module: Path
    init_fn: Callable[..., Any]
    shape: tuple[int, ...]
    dtype: Any


class CreateOutside(Exception):
    """A pass in a lifted body declared a variable the body must be handed rather than
    create (``declare``): not an error, a signal that ``vj.lift(create_outside=True)``
    catches.  Only the bodies of such a lift raise it (their policy says so), and a pass
    runs after its body's trace, when no lift nested in the body is running, so the lift
    that catches it is the body's own.  It calls ``create`` in the enclosing trace and
    traces its bodies again; ``create`` raises ``CreateOutside`` itself, for the lift
    around that trace, when the variable it stands beside was handed in there too.  When
    the enclosing trace's pipeline runs the pass as well (``init``'s ``passes=``), that
    pass makes the variable again where its rewrite reaches this creation
    (``PassScopes.recreate``): the value drawn here stands in for the trace."""

    def __init__(self, key: Key, create: Callable[[], None]):
        super().__init__(key)
        self.key = key
        self._create = create

    def create(self, linen: streams.LinenCounts | None, start: dict, drawn: dict) -> dict:
        """Create the variable, drawing from Linen counts ``drawn`` (the lift's start with
        the draws of the variables created before it this way), without counting its draws
        in the trace's counts, which stay ``start`` (the failed trace's draws uncounted):
        as ``PassScopes`` draws a pass's variables from a copy, the model's own draws keep
        the numbers they have without the pass (a scan body's counts, which its loop trace
        is moved by, included).  Returns ``drawn`` after it."""
        if linen is None:
            self._create()
            return drawn
        linen.restore(drawn)
        try:
            self._create()
            return linen.snapshot()
        finally:
            linen.restore(start)


def declare(owner: str, collection: str, name: tuple[str, ...], init_fn: Callable[..., Any],
            shape: tuple[int, ...], dtype: Any, source_info: Any, beside: Key | None = None
            ) -> jax.Array:
    """The array variable ``name`` that pass ``owner`` (its spec) declares at the module
    ``PassContext.in_module`` stands in: read when it exists, created from the module's next
    ``params`` draw when the collection is mutable.

    ``beside`` is the variable it belongs with (an adapter's kernel).  It is created where
    that one was: in a branch of a ``cond`` that was handed the kernel, the lift creates it
    before the cond (``CreateOutside``) and hands it to every branch, as the
    kernel is, rather than the branches that read the kernel creating it alone.

    A given one is checked against ``shape``/``dtype`` as a model's own variables are
    (``type_checks.mismatch``): adapters made with ``lora{rank=4}`` read by ``lora{rank=2}``
    are a ``VariableShapeError``, not a silently different model."""
    ctx = current(owner)
    path = ctx.full_path(name)
    where = errors.where(source_info)
    key = (collection, path)
    if isinstance(ctx.created_outside.get(key), Creation):
        # Run by the pass of the trace a lift created it in, at a read before that creation
        # in program order: it is created here, and the lift's creation is dropped when
        # the rewrite reaches it (``PassScopes.recreate``).
        ctx.created_outside[key] = True
    elif variable_api.has_at(ctx, collection, path):
        have = ctx.variables[(collection, path)]
        want = VarType(jax.tree.structure(0), (_jax.ShapedArray(tuple(shape), dtype),))
        why = type_checks.mismatch(have, want)
        if why is not None:
            raise type_checks.shape_error(
                collection, path, have, want, why, **where,
                fix=f"give the variables made with the same pass options ({owner}), or make "
                    "them again with these")
        return variable_api.read_at(ctx, collection, path)
    if not ctx.is_mutable(collection):
        raise errors.MissingVariableError(
            f"variable {errors.format_path(path)} of collection '{collection}', which pass "
            f"'{owner}' declares, was not given, and '{collection}' is not mutable, so it "
            "cannot be created.", collection=collection, path=path, **where,
            fix=f"pass the variables that init returned with passes='{owner}' (they include "
                f"the '{collection}' collection), or apply with mutable=['{collection}'] to "
                "create them")
    if beside is not None and _handed_in(ctx, beside):
        module = ctx.path_prefix
        raise CreateOutside(key, lambda: _create_at(
            module, owner, collection, name, init_fn, shape, dtype, source_info, beside))
    _create(ctx, key, init_fn, shape, dtype)
    return variable_api.read_at(ctx, collection, path)


def _create(ctx: TraceContext, key: Key, init_fn: Callable[..., Any], shape: tuple[int, ...],
            dtype: Any) -> None:
    """Create variable ``key`` from the ``params`` stream's next draw at ``ctx``'s module."""
    value = run_init(init_fn, variable_api.make_rng("params"), shape, dtype)
    variable_api.write_at(ctx, *key, value)


def _handed_in(ctx: TraceContext, key: Key) -> bool:
    """Whether ``key`` was handed to the lifted body ``ctx`` traces, by a transform whose
    pass variables are created outside it (``Lift.create_outside``)."""
    return getattr(ctx.policy, "create_outside", False) and key in ctx.given


def _create_at(module: Path, owner: str, *declared: Any) -> None:
    """``declare`` in the current (enclosing) trace, at ``module``: run by the lift before
    it traces its bodies again.  The trace keeps how, for its pass (``Creation``)."""
    ctx = current(owner)
    previous, ctx.path_prefix = ctx.path_prefix, tuple(module)
    try:
        declare(owner, *declared)
        collection, name, init_fn, shape, dtype = declared[:5]
        ctx.created_outside[(collection, ctx.full_path(name))] = Creation(
            tuple(module), init_fn, tuple(shape), dtype)
    finally:
        ctx.path_prefix = previous
