"""Writes JAX would lose: a held ``Variable`` written where the write cannot leave.

A held ``Variable`` keeps its value in Python, and only outputs leave a JAX trace.  Two
writes under a raw JAX transform (``jax.jit``, ``jax.vmap``, ``jax.grad``, a ``jax.lax``
body) would be lost, and Flax NNX loses the second one silently:

* **A closed-over Variable** (a module made eagerly, closed over by the function, or by an
  object-mode/NNX transform it was not passed to).  The write stores a tracer in it, which
  fails at the module's next use far from the line that wrote it, or (under ``jax.vmap``
  of values the write does not depend on) a value that skips the batch.  Each held
  Variable records the trace it was made in (a JAX trace's weak reference, compared by
  identity: one attribute read per write), and ``check_write`` refuses a write under
  another trace while that one runs, naming the Variable, its collection and the line.
  A Variable whose trace has ended (it escaped a transform) may be written at the top
  level again: that replaces the leaked value.
* **A copy JAX made of an argument** (the pytree flatten hands the function new Variables
  holding tracers).  Writing it is how a function in tree style updates a module it then
  returns, so the write itself is fine; the update is lost only if the copy is not
  returned.  The copy knows its original (``Origin``, carried in the treedef's aux data
  and equal to every other ``Origin``, so treedefs and JAX's caches are unchanged): a
  write marks the original ``pending``, a later flatten of the copy (JAX flattening the
  function's outputs) clears it, and the original's next use at the top level raises
  ``TransformError`` naming it and the line of the lost write.  A copy flattened inside
  the function after the write for another reason (``jax.tree.leaves(model)``) counts as
  returned: that loss is not seen.

An RNG stream's draw writes its count, so a stream follows both rules too (a closed-over
``Rngs`` drawn from inside ``jax.jit``; a ``Dropout`` whose stream JAX copied, drawing the
same mask at every call of the compiled step).

Transforms that are handed a module as an argument (``nnx.jit``, ``vj.jit`` and the
rest) see its Variables as handles (``var_get``/``var_set`` of their trace) and write
them back; neither rule applies to them.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

from varjax import _jax
from varjax.ir import errors

_FIX = ("pass the module to an NNX or object-mode transform (nnx.jit, nnx.vmap, nnx.scan, "
        "vj.jit, ...), which writes its updates back; under a raw JAX transform, return the "
        "module (or nnx.state of it) and update it outside")

# id(original) -> (weak reference to it, the lost write's error); kept small: an entry
# lives from a copy's write until the copy is flattened or the original is next used.
pending: dict[int, tuple[Any, errors.TransformError]] = {}


class Origin:
    """The Variable a pytree flatten was taken of, held weakly in the treedef's aux data.
    Every ``Origin`` equals every other and hashes alike: the treedef of a model compares
    and caches as before, whichever objects it was taken of."""

    __slots__ = ("ref",)

    def __init__(self, variable: Any = None):
        self.ref = None if variable is None else weakref.ref(variable)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Origin)

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "Origin"


def _named(owner: Any) -> tuple[str, str]:
    """How an error names ``owner`` (a Variable, or an RNG stream drawn from: its count is
    written), and its collection."""
    if hasattr(owner, "collection"):
        return f"a {type(owner).__name__} of collection '{owner.collection}'", owner.collection
    return f"the count of RNG stream '{owner.tag}' (a draw)", "rngs"


NOWHERE = Origin()     # a handle's or a made Variable's: no original to report to


def check_write(variable: Any, made: Any) -> None:
    """Refuse the write of held ``variable``, made under the trace ``made`` refers to (a weak
    reference), when another trace runs and ``made``'s has not ended.  The caller has
    already found that the current trace is not ``made``'s."""
    trace = made()
    if trace is None or _jax.is_invalidated(trace) or _jax.is_top_level():
        return
    what, collection = _named(variable)
    raise errors.TransformError(
        f"{what} was written inside a JAX "
        "transformation that holds it as a constant (a module closed over by jax.jit, "
        "jax.vmap or a jax.lax body, a jax.grad argument not differentiated, or a module an "
        "object-mode/NNX transform was not passed): the write cannot leave the "
        "transformation, and the Variable would keep a tracer.",
        collection=collection, **errors.where(), fix=_FIX)


def source_of(origin: Origin) -> Any:
    """The weak reference a copy made under a JAX trace keeps to its original (None for a
    copy made at the top level, whose writes are ordinary eager writes)."""
    return None if origin.ref is None or _jax.is_top_level() else origin.ref


_TRACING_ONLY = threading.local()


@contextlib.contextmanager
def tracing_only() -> Iterator[None]:
    """A block whose JAX transformations only trace (``jax.make_jaxpr``, ``jax.eval_shape``,
    ``jax.jit(f).lower(...)``): a write to a copy of a Variable there is not an update that
    could have reached the Variable, so none is reported lost.  ``nnx.eval_shape`` runs
    its function this way; ``nnx.make_jaxpr`` and ``vj.dump`` hand JAX no Variable copies."""
    previous = getattr(_TRACING_ONLY, "on", False)
    _TRACING_ONLY.on = True
    try:
        yield
    finally:
        _TRACING_ONLY.on = previous


def forget() -> None:
    """Drop every pending update: an exception is leaving a varjax entry point, and the
    writes it interrupted are reported by that exception, not as lost later."""
    pending.clear()


def written(copy: Any, source: Any) -> None:
    """A copy with original ``source()`` was written: the original's update is pending
    until the copy is flattened (returned)."""
    original = source()
    if original is None or getattr(_TRACING_ONLY, "on", False):
        return
    what, collection = _named(original)
    pending[id(original)] = (source, errors.TransformError(
        f"an update of {what} was lost: it was "
        "written to the copy a JAX transformation (jax.jit, jax.vmap, jax.grad, a jax.lax "
        "body) made of it, and the transformation returned (or raised) without returning "
        "the copy.", collection=collection, **errors.where(),
        fix=_FIX + "; if the transformation only traced (jax.make_jaxpr, jax.eval_shape, "
                   ".lower), nothing was lost: trace under `with vj.tracing_only():`"))


def returned(source: Any) -> None:
    """The copy with original ``source()`` was flattened after its write: not lost."""
    original = source()
    if original is not None:
        pending.pop(id(original), None)


errors.on_error(forget)


def check_used(variable: Any) -> None:
    """Raise the lost update of ``variable`` at its first use at the top level.  Called only
    while some update is pending."""
    entry = pending.get(id(variable))
    if entry is None or entry[0]() is not variable or not _jax.is_top_level():
        return
    del pending[id(variable)]
    raise entry[1]
