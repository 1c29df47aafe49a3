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
from typing import Iterator

from varjax import _jax, streams
from varjax.context import IR_STORE, TraceContext, activate
from varjax.primitives import Path


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
