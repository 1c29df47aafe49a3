"""The cache entries of a functionalized function (``functionalized.Functionalized``).

A trace is cached under a ``_Key`` as an ``_Effectful`` (the effectful jaxpr), and a
compiled call as a ``Traced`` (the pure jaxpr after the pass pipeline, and how to call it).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from varjax import _jax
from varjax.passes.default.discharge import Signature
from varjax.trace.context import TraceContext


@dataclasses.dataclass(frozen=True)
class _Key:
    """Everything a trace depends on: argument structure, static leaves (with their
    positions, compared by type and value: ``statics.typed``), array avals, variable types,
    mutable filter, RNG streams, init flag, the active mesh and logical axis rules (which
    ``shard-variables`` and ``nn.with_logical_constraint`` read while tracing)."""

    tree: Any
    static: tuple
    avals: tuple
    variables: tuple
    mutable: Any
    rngs: tuple
    initializing: bool
    sharding: tuple
    # The static leaves themselves, for the trace; ``static`` is what equality sees.
    static_values: tuple = dataclasses.field(default=(), compare=False)


@dataclasses.dataclass
class _Effectful:
    """A traced, not yet compiled, function: what ``.jaxpr()`` needs."""

    jaxpr: _jax.ClosedJaxpr
    out_tree: Any
    context: TraceContext
    key: _Key
    # Linen draw counts a trace adopted from another start ends at (the counts when its
    # passes run are its start: its Python did not run), for the passes' draws.
    linen_end: dict | None = None


@dataclasses.dataclass
class Traced:
    """One cache entry: the pure jaxpr, the variable layout, and the compiled call.

    ``effectful`` is the trace it came from for a lifted body (``inline``), whose lift
    keys Linen's draw counts on it, and None for a top-level function, which lets the
    trace go (see ``functionalized``'s module docstring)."""

    effectful: _jax.ClosedJaxpr | None
    pure: _jax.ClosedJaxpr
    signature: Signature
    out_tree: Any
    call: Callable[..., Any]
    stats: dict
