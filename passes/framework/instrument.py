"""Instrumentation: the hooks around a pipeline run, and the timing instrumentation.

Everything that watches a run (verification, IR dumps, timing, your own counters) is an
``Instrumentation``: one hook list, as in MLIR's pass manager.  This module holds only
the hook interface, ``Timing`` and the dump environment variables, so that the built-in
instrumentations (``verify.py``, ``dump.py``) depend on it and not on ``pipeline.py``,
which in turn imports them: the dependencies point one way.
"""
from __future__ import annotations

import time

from varjax import _jax
from varjax.passes.framework.base import Pass, PassContext

DUMP_DIR_ENV = "VARJAX_DUMP_DIR"
# Comma-separated pass names: dump only the IR after these passes (and the input).
DUMP_AFTER_ENV = "VARJAX_DUMP_AFTER"
# Anything but "" or "0": dump only after passes that changed the IR.
DUMP_CHANGED_ENV = "VARJAX_DUMP_ONLY_CHANGED"


class Instrumentation:
    """Hooks around a pipeline run; override the ones you need.

    Hooks observe: they must not change the jaxprs they are shown.  They may
    raise to stop the run (the verifier does).
    """

    def before_pipeline(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> None:
        pass

    def before_pass(self, p: Pass, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> None:
        pass

    def after_pass(self, p: Pass, before: _jax.ClosedJaxpr, after: _jax.ClosedJaxpr,
                   ctx: PassContext) -> None:
        """``after is before`` when the pass changed nothing."""

    def pass_failed(self, p: Pass, jaxpr: _jax.ClosedJaxpr, exc: Exception,
                    ctx: PassContext) -> None:
        """The pass raised ``exc`` on ``jaxpr``; the pipeline re-raises after the hooks."""

    def after_pipeline(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> None:
        """Called only when every pass succeeded."""


class Timing(Instrumentation):
    """Wall-clock seconds per pass name (repeats summed), in first-run order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = 0.0

    def before_pipeline(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> None:
        self.seconds = {}

    def before_pass(self, p: Pass, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> None:
        self._start = time.perf_counter()

    def after_pass(self, p: Pass, before: _jax.ClosedJaxpr, after: _jax.ClosedJaxpr,
                   ctx: PassContext) -> None:
        self._stop(p)

    def pass_failed(self, p: Pass, jaxpr: _jax.ClosedJaxpr, exc: Exception,
                    ctx: PassContext) -> None:
        self._stop(p)

    def _stop(self, p: Pass) -> None:
        self.seconds[p.name] = self.seconds.get(p.name, 0.0) + time.perf_counter() - self._start
