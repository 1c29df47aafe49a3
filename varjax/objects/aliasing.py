"""One object at two places of a transform's arguments is one object inside it.

JAX copies a pytree place by place: a submodule a model holds at two attributes comes into
a ``jax.jit`` as two copies.  Their Variables are made one again by the nodes' places
(``Graph.places``, ``dealias``), but the submodule would stay two objects: ``m.a is m.b``
false inside, an attribute set through one alias missing from the other, a gradient
listing it twice.  flax.nnx's graph mode keeps it one object, so the caller's graph
records, per occurrence of an object of a type registered here (``register_aliased``:
varjax.nnx's objects), which occurrence it repeats (``object_places``), and inside the
transform the copies are put together the same way (``shared_again``).  Both walk the
tree depth first, entering each object once, so the occurrences line up.  The caller's
graph notes while JAX flattens its arguments whether an object is met twice
(``RepeatWatch``); only then are they walked again, and only then are the copies.
"""
from __future__ import annotations

import itertools
from typing import Any

import jax

from varjax.objects.nodes import is_node

# Types whose instances keep their identity through a transform, and per type met whether
# it is one of them.
_ALIASED: list[type] = []
_IS_ALIASED: dict[type, bool] = {}


def register_aliased(type_: type) -> None:
    """Instances of ``type_`` met at several places of a transform's arguments are one
    object inside it, as outside (a node, which ``Graph.places`` keeps one already, is
    not counted as one)."""
    _ALIASED.append(type_)
    _IS_ALIASED.clear()


class RepeatWatch:
    """The ``is_leaf`` of JAX's flatten of a call's arguments (nodes are leaves) that
    counts the aliased objects it meets and notes whether one is met twice."""

    __slots__ = ("seen", "count", "again")

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.count, self.again = 0, False

    def __call__(self, x: Any) -> bool:
        t = type(x)
        aliased = _IS_ALIASED.get(t)
        if aliased is None:
            aliased = _IS_ALIASED[t] = issubclass(t, tuple(_ALIASED)) and not is_node(x)
        if aliased:
            self.count += 1
            if id(x) in self.seen:
                self.again = True
            self.seen.add(id(x))
        return is_node(x)

    def places(self, tree: Any) -> tuple[int, ...]:
        """``object_places(tree)`` of the tree this watched: each object its own first
        occurrence unless one was met twice."""
        return object_places(tree) if self.again else tuple(range(self.count))


def _contents(x: Any, aliased: tuple[type, ...]) -> tuple[list[Any], Any]:
    """The leaves of ``x`` with every node and aliased object inside it a leaf (``x``
    itself entered), and the treedef that puts them back: JAX walks the containers between
    in one call."""
    return jax.tree_util.tree_flatten(
        x, is_leaf=lambda y: y is not x and (is_node(y) or isinstance(y, aliased)))


def object_places(tree: Any) -> tuple[int, ...]:
    """Per occurrence of an aliased object in ``tree`` (depth first, a repeat not entered),
    the occurrence where it was first met (``repeats`` says whether one is met twice)."""
    aliased = tuple(_ALIASED)
    firsts: list[int] = []
    seen: dict[int, int] = {}

    def enter(x: Any) -> None:
        for leaf in _contents(x, aliased)[0]:
            if isinstance(leaf, aliased) and not is_node(leaf):
                first = seen.setdefault(id(leaf), len(firsts))
                firsts.append(first)
                if first == len(firsts) - 1:
                    enter(leaf)
    if aliased:
        enter(tree)
    return tuple(firsts)


def repeats(firsts: tuple[int, ...]) -> bool:
    """Whether ``object_places`` met an object twice: only then are copies put together."""
    return any(f != k for k, f in enumerate(firsts))


def shared_again(tree: Any, firsts: tuple[int, ...]) -> Any:
    """JAX's copy of a tree whose ``object_places`` are ``firsts``, walked in the same
    order: each repeated object replaced by the copy of its first occurrence, and the
    objects and containers holding one rebuilt around it."""
    aliased = tuple(_ALIASED)
    built: dict[int, Any] = {}
    count = itertools.count()

    def enter(x: Any) -> Any:
        leaves, treedef = _contents(x, aliased)
        changed = False
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, aliased) and not is_node(leaf):
                k = next(count)
                new = built[firsts[k]] if firsts[k] != k else enter(leaf)
                built[k] = new
                if new is not leaf:
                    leaves[i], changed = new, True
        return treedef.unflatten(leaves) if changed else x
    return enter(tree)
