"""A loop body returning its carry's objects in other places (two modules or Variables
swapped): every ``varjax.nnx`` loop refuses it with ``CarryIdentityError`` (a
``ValueError``), naming the place and the line.

Why, from flax.nnx 0.12.8 run on the same bodies (``tests/nnx/test_nnx_moved_carry.py``):
``while_loop`` refuses it in every mode, and so does ``scan`` for modules; without graph
updates every loop refuses it (all ``ValueError``s).  Where flax.nnx takes it (``fori_loop``
with graph updates, ``scan`` of bare Variables), it puts the caller's objects where one
step's output puts them, whatever the number of steps, each holding that place's values:
after an even number of swaps each object holds the other's, not what the loop gives run in
Python.  That is no rule a program can rely on, so varjax refuses those too, and says so.
"""
from __future__ import annotations

from typing import Any, Callable, NoReturn

import jax

from varjax.ir import errors
from varjax.nnx.graph_updates import is_object
from varjax.nnx.pytree import Pytree

__all__ = ["refuse_moved", "WHY_FORI", "WHY_SCAN", "WHY_WHILE"]

WHY_FORI = ("flax.nnx 0.12.8 takes it with graph updates, but puts the caller's objects where "
            "one step's output puts them whatever the number of steps, so after an even "
            "number of swaps each holds the other's values, not what the loop computes (and "
            "refuses it without graph updates).")
WHY_SCAN = ("flax.nnx refuses it (it takes swapped bare Variables with graph updates, placed "
            "by one step's output whatever the number of steps: after an even number of "
            "swaps each holds the other's values).")
WHY_WHILE = ("the number of steps is not known while tracing, so neither is where each object "
             "ends (flax.nnx refuses it too).")


def _placed(tree: Any, at: str = "") -> list[tuple[str, Any]]:
    """``(place, object)`` for every NNX object and Variable in ``tree``, modules before their
    children, the place as ``jax.tree_util.keystr`` writes it."""
    found: list[tuple[str, Any]] = []
    for path, x in jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda y: y is not tree and is_object(y)):
        if is_object(x):
            place = at + jax.tree_util.keystr(path)
            found.append((place, x))
            if isinstance(x, Pytree):
                found.extend(_placed(x, place))
    return found


def refuse_moved(what: str, fn: Callable, carry: Any, new_carry: Any, why: str) -> NoReturn:
    """``CarryIdentityError``: ``fn``, the body of ``nnx.<what>``, returned ``new_carry``
    holding the objects of ``carry`` in other places; the message names the first object
    moved, where it was given and where it came back, and ``why`` the loop refuses it."""
    given: dict[int, list[str]] = {}
    for place, x in _placed(carry):
        given.setdefault(id(x), []).append(place)
    moved = next(((place, x) for place, x in _placed(new_carry)
                  if place not in given.get(id(x), [place])), None)
    detail = "" if moved is None else (
        f": carry{moved[0]} holds the {type(moved[1]).__name__} given at "
        f"carry{given[id(moved[1])][0]}")
    raise errors.CarryIdentityError(
        f"nnx.{what}: {getattr(fn, '__name__', 'the body')} returns the carry's objects in "
        f"other places{detail}; {why}", **errors.where(),
        fix="return each carry object in the place it came in; to swap two of them, swap "
            "their Variables' values (p.w[...], q.w[...] = q.w[...], p.w[...])")
