"""Run a trace with room on CPython's frame stack, so that tracing does not map and unmap
memory per equation.

CPython 3.11 keeps Python frames on a per-thread stack of 16 KiB chunks. A call that does
not fit in the current chunk maps a new one, and the return that leaves it unmaps it. When
the frames of tracing one equation (``bind``, the trace's rule, JAX's staging code) happen
to straddle a chunk boundary, every equation pays an ``mmap``/``munmap`` pair and the page
faults of a fresh chunk. Where the boundary falls depends on how deep the trace started, so
the same model traced one frame deeper can run 20% slower. A lifted ``vmap`` body traced at
varjax's depth did: ``strace`` counted 64 such pairs per cold ``init`` of a two-layer body
(2 with the headroom below), and the trace took 4.8 ms instead of 4.2 ms.

``call_with_headroom(fn, *args)`` calls ``fn`` from a frame of about 32 KiB. No chunk has
that much left, so CPython maps a fresh 64 KiB chunk for the frame, and ``fn`` and
everything it calls start with 32 KiB free: a trace's equations are staged well inside one
chunk. It costs one chunk per call (``varjax._jax.trace_to_jaxpr`` makes a few per trace).
"""
from __future__ import annotations

from typing import Any, Callable

# Local slots of the calling frame: 8 bytes each, so about 32 KiB.
SLOTS = 4000
# The generated function's file name: a traceback shows it without a (wrong) source line,
# and ``varjax._jax`` keeps it out of the user frames that source lines name.
FILENAME = "<varjax stack headroom>"


def _make_caller(slots: int) -> Callable[..., Any]:
    # The slots are locals the function declares but never binds (CPython sizes a frame by
    # its code object's locals).
    names = " = ".join(f"_{i}" for i in range(slots))
    source = ("def call_with_headroom(fn, *args):\n"
              "    if fn is None:\n"
              f"        {names} = None\n"
              "    return fn(*args)\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, FILENAME, "exec"), namespace)
    return namespace["call_with_headroom"]


call_with_headroom = _make_caller(SLOTS)
call_with_headroom.__doc__ = "``fn(*args)``, started with about 32 KiB of free frame stack."
