"""NNX's ``cond``, ``switch``, ``while_loop``, ``fori_loop`` and ``eval_shape`` in graph mode,
on varjax's object-mode control flow (``varjax.objects.control_flow``).

Inside a branch or a loop body every Variable access is a ``var_get``/``var_set`` of one
functionalized trace, and the updates reach the caller's Variables (a BatchNorm's
statistics, a counter), as flax.nnx writes them.  With graph updates (the default):

* a branch's structural change to an operand's module (a ``sow``) reaches the caller's
  module, and an operand's object a branch returns is the caller's own (``graph_updates``);
* a loop returns its carry with the caller's objects in it (flax.nnx does), when the body
  returns each carry object in the place it came in; a body that moves them is refused with
  ``CarryIdentityError`` (``carry_moves``: ``while_loop`` as flax.nnx refuses it; for
  ``fori_loop`` flax.nnx puts the objects where one step's output puts them, whatever the
  trip count, which is not what the loop computes);
  a structural change in a loop body is a ``TransformError``, as flax.nnx refuses it too.

With ``graph_updates=False`` (or ``graph=False``) a branch carries Variable values only
(``graph_updates``), and a loop returns new objects holding the caller's Variables, as
flax.nnx does.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax

from varjax.ir.typing import ArrayLike, Passes, PyTree
from varjax.nnx.carry_moves import WHY_FORI, WHY_WHILE, refuse_moved
from varjax.nnx.config import resolve
from varjax.nnx.graph_updates import carrying, finish, restored, shared_output
from varjax.nnx.transform_checks import (
    as_given,
    checked,
    refuse_bound_method,
    same_carry_objects,
)
from varjax.objects import control_flow, object_transforms
from varjax.trace import raw_writes

__all__ = ["cond", "switch", "while_loop", "fori_loop", "eval_shape"]


def cond(pred: ArrayLike, true_fun: Callable, false_fun: Callable, *operands: Any,
         graph: bool | None = None, graph_updates: bool | None = None,
         passes: Passes = ()) -> PyTree:
    """``jax.lax.cond`` over NNX objects: a Variable either branch writes is updated.
    ``passes`` (beyond flax.nnx, as ``nnx.jit``'s) run on each branch's IR."""
    modes = resolve(graph, graph_updates)
    out, changes = control_flow.cond(pred, carrying(true_fun, "cond", *modes),
                                     carrying(false_fun, "cond", *modes), *operands,
                                     passes=passes)
    return finish(operands, {}, out, changes)


def switch(index: ArrayLike, branches: Sequence[Callable], *operands: Any,
           graph: bool | None = None, graph_updates: bool | None = None,
           passes: Passes = ()) -> PyTree:
    """``jax.lax.switch`` over NNX objects: a Variable any branch writes is updated
    (``passes`` as ``cond``'s)."""
    modes = resolve(graph, graph_updates)
    out, changes = control_flow.switch(
        index, [carrying(f, "switch", *modes) for f in branches], *operands, passes=passes)
    return finish(operands, {}, out, changes)


def _while_carry(what: str, body: Callable, args: tuple, out: Any) -> None:
    same_carry_objects(what, body, args[0], out,
                       functools.partial(refuse_moved, what, body, args[0], out, WHY_WHILE))


def _fori_carry(what: str, body: Callable, args: tuple, out: Any) -> None:
    same_carry_objects(what, body, args[1], out,
                       functools.partial(refuse_moved, what, body, args[1], out, WHY_FORI))


def while_loop(cond_fun: Callable, body_fun: Callable, init_val: PyTree, *,
               graph: bool | None = None, graph_updates: bool | None = None,
               passes: Passes = ()) -> PyTree:
    """``jax.lax.while_loop`` over NNX objects in the carry: the body's Variable updates are
    carried and written back, and the carry returned holds the caller's objects (without
    graph updates: new objects holding the caller's Variables).  ``passes`` (as ``cond``'s)
    run on the IR of ``cond_fun`` and of ``body_fun``."""
    final = control_flow.while_loop(
        cond_fun, checked(body_fun, "while_loop", _while_carry), init_val,
        passes=passes)
    return as_given(init_val, final, resolve(graph, graph_updates)[1])


def fori_loop(lower: int | jax.Array, upper: int | jax.Array, body_fun: Callable,
              init_val: PyTree, *, unroll: int | bool | None = None, graph: bool | None = None,
              graph_updates: bool | None = None, passes: Passes = ()) -> PyTree:
    """``jax.lax.fori_loop`` over NNX objects in the carry (see ``while_loop``; ``passes``
    run on the body's IR).  ``unroll`` is JAX's, as flax.nnx passes it on: a ``scan``
    unrolled that many steps per iteration, the bounds then concrete."""
    final = control_flow.fori_loop(
        lower, upper, checked(body_fun, "fori_loop", _fori_carry), init_val,
        unroll=unroll, passes=passes)
    return as_given(init_val, final, resolve(graph, graph_updates)[1])


def eval_shape(f: Callable, *args: Any, graph: bool | None = None,
               graph_updates: bool | None = None, **kwargs: Any) -> PyTree:
    """``jax.eval_shape`` over NNX objects: the output's modules hold Variables of
    ``jax.ShapeDtypeStruct``s (an abstract model: ``eval_shape(lambda: Model(rngs))``).
    The function runs on copies of the arguments, so, as in flax.nnx, nothing is written
    back to them (``graph_updates`` changes nothing here), and their writes are not
    reported as lost (``raw_writes.tracing_only``).  In graph mode the output's objects
    share what they shared inside (a submodule held twice is one); tree mode refuses that,
    as flax.nnx does."""
    refuse_bound_method(f, "eval_shape")
    graph_mode = resolve(graph, graph_updates)[0]

    def shaped(*a: Any, **k: Any) -> Any:       # what the output shares crosses JAX too
        return shared_output(f(*a, **k), "eval_shape", graph_mode)
    with raw_writes.tracing_only():
        return restored(jax.eval_shape(object_transforms.jit(shaped), *args, **kwargs))

