"""The jit-cache fingerprint of a trace context.

JAX keys its ``jax.jit`` cache on the function and the avals of its arguments.  A
jitted helper called inside varjax-traced code may also depend on the variables it
reads, which are not arguments; so varjax folds a fingerprint of the active trace
context into JAX's jit key (``_jax.jit_key_state``).  Equal fingerprints mean an inner
trace can be reused.

Fingerprints start *lax* (mutability, streams, init flag, lift policy and scope; the
variable view is left out) and turn *strict* (the variable view and a per-trace nonce
added) at the first variable operation inside an inner trace.  The switch is
process-wide and one-way: before it, every inner trace was made by code that never
touched a variable (library functions such as ``jax.nn.relu``), so sharing it across
variable views is safe, and JAX's caches keep working for library code.  The inner
trace that makes the switch was keyed laxly, and no lax key is ever looked up again.
See "Inner jax.jit functions" in ``notes/architecture.md``.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable

from varjax import _jax

_JIT_KEY = _jax.jit_key_state("varjax_trace_context")
_nonces = itertools.count()
_strict = [False]

# Init functions are pure (key, shape -> value): they run under one constant key, so the
# jitted library code they call (jax.random, initializers) is traced once per process
# instead of once per trace context.
INIT_KEY = ("varjax", "init-fn")


def is_strict() -> bool:
    """Whether fingerprints include the variable view (see the module docstring)."""
    return _strict[0]


class Fingerprint:
    """The fingerprint of one trace context, kept up to date as variables change type.

    ``base`` is everything fixed for the context's life.  A context that may create or
    retype variables changes the view inside inner ``jax.jit`` bodies -- Python that a
    cache hit would skip -- so under strict fingerprints it never shares inner traces
    with another context (a nonce); a fully immutable one can."""

    def __init__(self, base: tuple, may_change: bool, variables: dict):
        nonce = next(_nonces) if may_change else None
        self._lax = hash(base)
        self._strict = hash((base, nonce))
        self._vars = 0
        for item in variables.items():
            self._vars ^= hash(item)

    def key(self, path_prefix: tuple) -> tuple:
        if _strict[0]:
            return ("varjax", self._strict, self._vars, path_prefix)
        return ("varjax", self._lax, path_prefix)

    def retype(self, item_key: Any, old: Any, new: Any, current: Callable[[], tuple]) -> None:
        """Variable ``item_key`` changed type from ``old`` (None: created) to ``new``;
        ``current()`` is the context's key afterwards, installed when keys are strict."""
        if old is not None:
            self._vars ^= hash((item_key, old))
        self._vars ^= hash((item_key, new))
        if _strict[0]:
            _JIT_KEY.set_local(current())


def make_strict(current: Callable[[], tuple]) -> None:
    """Switch every fingerprint to strict; ``current()`` is then the active context's key."""
    if not _strict[0]:
        _strict[0] = True
        _JIT_KEY.set_local(current())


def swap(key: Any) -> Any:
    """Install ``key`` as JAX's jit-key state; returns the one it replaces."""
    return _JIT_KEY.swap_local(key)


def restore(key: Any) -> None:
    _JIT_KEY.set_local(key)
