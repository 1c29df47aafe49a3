"""``nnx.prefix``: a transform's axes (or shardings) for a node, computed per Variable.

flax.nnx 0.12.8 replaces each leaf of ``node`` (each Variable, each stream's key and count,
each array) by ``filter_map(path, leaf)`` (or by the value of the first filter of a mapping
that matches it), giving a prefix to pass as ``in_axes``/``out_axes``.  A varjax module is a
pytree whose leaves, to a transform, are object-mode nodes (a Variable, a ``RngStream``, an
``Rngs``, an array), so the prefix here is ``node`` with each of those replaced by its value:
a JAX prefix that ``nnx.vmap`` takes as it is.  A stream (or ``Rngs``) is one node, so its
key and count must get one value; a node met again (graph mode) gets its first place's.

``nnx.scan`` splits an argument by its prefix (``axes_by_path``): one state per path, each
with its axis, as a ``StateAxes`` of path filters would, except that a ``None`` there means
what ``None`` means for a whole argument of that scan (``PrefixAxes``).

flax.nnx takes a graph-mode prefix (its ``TreeState``) only without graph updates; here the
prefix is the same in both modes and is taken in both.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax

from varjax.ir.typing import Filter, Node, PathParts, Prefix
from varjax.nnx.filterlib import to_predicate
from varjax.nnx.graphlib import flatten_graph
from varjax.nnx.pytree import Pytree
from varjax.nnx.state_axes import StateAxes, nests_state_axes
from varjax.objects.nodes import is_node
from varjax.trace.unprovided import not_provided
from varjax.trace.variable import Variable

__all__ = ["prefix"]


def _nnx_path(keypath: tuple) -> PathParts:
    """A JAX key path as the NNX path of the same place (names, indices, dict keys); the
    index of a leaf inside an object-mode node (a Variable's value in a prefix tree made by
    ``jax.tree.map``) is no part of it: the node is one place."""
    return tuple(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k))) for k in keypath
                 if not isinstance(k, jax.tree_util.FlattenedIndexKey))


def _by_filters(filter_map: Mapping[Any, Any]) -> Callable[[PathParts, Any], Any]:
    predicates = tuple((to_predicate(f), value) for f, value in filter_map.items())
    filters = list(filter_map)

    def prefix_fn(path: PathParts, leaf: Any) -> Any:
        for predicate, value in predicates:
            if predicate(path, leaf):
                return value
        raise ValueError(f"No filter matched leaf at path {path!r} with value {leaf!r}. "
                         f"Filters: {filters}")
    return prefix_fn


def prefix(node: Node, filter_map: Mapping[Filter, Prefix] | Callable[[PathParts, Any], Prefix],
           /, *, graph: bool | None = None) -> Prefix:
    """``node`` with each leaf (Variable, stream, array) replaced by its prefix value:
    ``filter_map(path, leaf)``, or the value of the first filter of a mapping that matches
    it (``ValueError`` when none does); pass it as a transform's ``in_axes``.  ``graph`` is
    flax.nnx's, whose prefix takes another form in each mode; this one is the same in both
    (the graph walk gives each leaf its path and a node met again its first place's value,
    and a tree-mode transform refuses the shared node itself, as flax.nnx's does)."""
    prefix_fn = _by_filters(filter_map) if isinstance(filter_map, Mapping) else filter_map
    _, entries = flatten_graph(node, True)
    values = [(path, prefix_fn(path, leaf)) for path, leaf in entries]
    by_id: dict[int, Any] = {}

    def one(keypath: tuple, leaf: Any) -> Any:
        at = _nnx_path(keypath)
        found = {repr(v): v for p, v in values if p[:len(at)] == at}
        if not found:
            return by_id.get(id(leaf))
        if len(found) > 1:
            not_provided("nnx.prefix giving one stream (or Rngs) several values",
                         f"the key and count at {'/'.join(map(str, at))} got "
                         f"{sorted(found)}; a stream is one node of a varjax module, mapped "
                         "as one.", "give a stream's key and count the same value",
                         by="varjax.nnx")
        by_id[id(leaf)] = value = next(iter(found.values()))
        return value
    return jax.tree_util.tree_map_with_path(one, node, is_leaf=is_node)


class PrefixAxes(StateAxes):
    """An argument's prefix tree as per-path filters and their axes; its ``None`` means
    what ``None`` means for a whole argument (not what a ``StateAxes`` ``None`` means),
    except at the filters numbered in ``restored``, which came from a ``StateAxes`` in the
    tree."""

    def __init__(self, filter_axes: list[tuple[Filter, Any]],
                 restored: frozenset[int] = frozenset()):
        super().__init__(filter_axes)
        self.restored = restored


def _at(path: PathParts, f: Filter = ...) -> Callable[[PathParts, Any], bool]:
    """The filter of what is at or under ``path`` and, below it, matches ``f``."""
    below = to_predicate(f)

    def under(p: PathParts, value: Any) -> bool:
        return tuple(p[:len(path)]) == path and below(tuple(p[len(path):]), value)
    return under


def axes_by_path(entry: Any, is_axis: Callable[[Any], bool]) -> PrefixAxes:
    """``entry`` (a prefix tree of an argument: a module of axes, a dict of axes) as one
    filter per path, each with its axis.  A ``StateAxes`` in the tree gives the part under
    its path one filter per filter of its own, matched against the path below it, as
    flax.nnx's ``StateAxes`` matches a module's paths (``restored`` marks its ``None``s)."""
    leaves = [(p, x.get_value() if isinstance(x, Variable) else x)
              for p, x in jax.tree_util.tree_leaves_with_path(
                  entry, is_leaf=lambda x: is_axis(x) or isinstance(x, (StateAxes, Variable)))]
    pairs: list[tuple[Filter, Any]] = []
    restored: set[int] = set()
    for p, axis in leaves:
        for f, a in axis.items() if isinstance(axis, StateAxes) else ((..., axis),):
            if a is None and isinstance(axis, StateAxes):
                restored.add(len(pairs))
            pairs.append((_at(_nnx_path(p), f), a))
    return PrefixAxes(pairs, frozenset(restored))


def with_prefix_axes(axes: Prefix) -> Prefix:
    """``axes`` with each NNX object in it (an ``nnx.prefix`` tree) that holds a
    ``StateAxes`` made a ``PrefixAxes`` (``axes_by_path``), so ``nnx.vmap`` splits the
    argument under it by path, as it splits one at a ``StateAxes``."""
    def one(e: Any) -> Any:
        if isinstance(e, Pytree) and nests_state_axes(e):
            return axes_by_path(e, lambda x: x is None)
        return e
    return jax.tree.map(one, axes, is_leaf=lambda x: x is None
                        or isinstance(x, (StateAxes, Pytree)))
