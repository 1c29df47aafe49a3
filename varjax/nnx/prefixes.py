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
from varjax.nnx.state_axes import StateAxes
from varjax.objects.nodes import is_node
from varjax.trace.unprovided import not_provided

__all__ = ["prefix"]


def _nnx_path(keypath: tuple) -> PathParts:
    """A JAX key path as the NNX path of the same place (names, indices, dict keys)."""
    return tuple(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k))) for k in keypath)


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
    what ``None`` means for a whole argument (not what a ``StateAxes`` ``None`` means)."""


def _at(path: PathParts) -> Callable[[PathParts, Any], bool]:
    def under(p: PathParts, _: Any) -> bool:
        return tuple(p[:len(path)]) == path
    return under


def axes_by_path(entry: Any, is_axis: Callable[[Any], bool]) -> PrefixAxes:
    """``entry`` (a prefix tree of an argument: a module of axes, a dict of axes) as one
    filter per path, each with its axis."""
    leaves = jax.tree_util.tree_leaves_with_path(entry, is_leaf=is_axis)
    return PrefixAxes([(_at(_nnx_path(p)), axis) for p, axis in leaves])
