"""``vj.split`` / ``vj.merge`` / ``vj.state``: a node as a static graphdef and states.

A state is a nested dict in the variables-dict layout, ``{collection: {scope:
{name: value}}}``, where the scope is the node's place in the tree followed by the
variable's path inside the node (``params:Dense_0/kernel`` for a bound module given
alone).  A plain variables dict is its own state: its leaves are the variables.
``split`` sorts every variable into the first filter that matches it; ``merge``
builds new objects of the same structure from the values (JAX's unflatten of each
object's treedef, so a bound module comes back as a bound module of the same class).
An object reached twice is stored once and comes back as one object.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from varjax import errors, filters
from varjax.functionalize import unflatten_variables
from varjax.objects.graph import Graph
from varjax.primitives import Key


@dataclasses.dataclass(frozen=True)
class GraphDef:
    """The static half of ``split``; hashable, so it can be a static ``jax.jit`` argument.

    ``outer``: the treedef with every object a leaf; ``parts``: per outer leaf, the
    variable it is (a plain leaf) or the index of the object; ``objects``: per object,
    its own treedef and the ``(variable, number of leaves)`` of each of its cells."""

    outer: Any
    parts: tuple[tuple[str, Any], ...]
    objects: tuple[tuple[Any, tuple[tuple[Key, int], ...]], ...]
    # Per object, its leaves that are not variables: the keys and call count of a module
    # bound with ``rngs={...}`` (not state: they travel with the graphdef).
    extras: tuple[tuple[Any, ...], ...] = dataclasses.field(default=(), compare=False)


def _split_node(node: Any) -> tuple[GraphDef, list[tuple[Key, Any]]]:
    graph = Graph.of(node)
    entries: list[tuple[Key, Any]] = []
    parts: list[tuple[str, Any]] = []
    place = iter(graph.places)
    for names, leaf, is_object in zip(graph.paths, graph.leaves, graph.is_object):
        if is_object:
            parts.append(("object", next(place)))
            continue
        if not names:
            raise errors.TransformError(
                "vj.split: the node is a bare array; a state needs a collection.",
                **errors.where(), fix="wrap it: vj.Variable(x), or {'params': {'x': x}}")
        key = (names[0], names[1:])
        parts.append(("variable", key))
        entries.append((key, leaf))
    objects, extras = [], []
    for n in graph.nodes:
        cells = []
        for cell in n.cells:
            key, value = (cell.collection, n.prefix + cell.path), cell.get()
            entries.append((key, value))
            cells.append((key, len(jax.tree.leaves(value))))
        leaves, treedef = jax.tree.flatten(n.obj)
        objects.append((treedef, tuple(cells)))
        extras.append(tuple(leaves[sum(count for _, count in cells):]))
    return GraphDef(graph.treedef, tuple(parts), tuple(objects), tuple(extras)), entries


def _matches(f: Any, key: Key, value: Any) -> bool:
    """Whether filter ``f`` takes the variable ``key``: a collection name, a list or tuple
    (any), ``True``/``...`` (all), ``False``, ``vj.DenyList``, or ``pred(path, value)``."""
    if f is Ellipsis:
        return True
    if isinstance(f, filters.DenyList):
        return not _matches(f.deny, key, value)
    if isinstance(f, (tuple, list)):
        return any(_matches(x, key, value) for x in f)
    if callable(f):
        return bool(f((key[0], *key[1]), value))
    return filters.matches(f, key[0])


def split(node: Any, *filters_: Any) -> tuple:
    """``(graphdef, state)``, or ``(graphdef, s1, ..., sn)``: one state per filter, each
    variable in the first filter it matches (``TransformError`` if none)."""
    graphdef, entries = _split_node(node)
    chosen = filters_ or (True,)
    groups: list[list[tuple[Key, Any]]] = [[] for _ in chosen]
    for key, value in entries:
        for group, f in zip(groups, chosen):
            if _matches(f, key, value):
                group.append((key, value))
                break
        else:
            raise errors.TransformError(
                f"vj.split: variable {errors.format_path(key[1])} of collection '{key[0]}' "
                "matches none of the filters.", collection=key[0], path=key[1],
                **errors.where(), fix="add a filter that matches it, or end with ... (the rest)")
    return (graphdef, *(unflatten_variables(dict(g)) for g in groups))


def state(node: Any, *filters_: Any) -> Any:
    """The state of ``node``: one dict, or a tuple of dicts for several filters.  Unlike
    ``split``, a variable that matches no filter is left out (it is not asked for)."""
    if not filters_:
        return split(node)[1]
    _, *states, _ = split(node, *filters_, ...)
    return tuple(states) if len(filters_) > 1 else states[0]


def flatten_state(state_: Any, into: dict[Key, Any]) -> dict[Key, Any]:
    """Add a state's variables to ``into`` as ``{(collection, path): value}``."""
    if not isinstance(state_, dict):
        raise errors.InvalidVariablesError(
            f"vj.merge: a state is a dict of collections, got {type(state_).__name__}.",
            **errors.where(), fix="pass the states vj.split returned")

    def visit(col: str, path: tuple, sub: Any) -> None:
        if isinstance(sub, dict):
            for k, v in sub.items():
                visit(col, path + (str(k),), v)
            return
        if (col, path) in into:
            raise errors.TransformError(
                f"vj.merge: variable {errors.format_path(path)} of collection '{col}' is in "
                "two of the states.", collection=col, path=path, **errors.where(),
                fix="pass each variable in one state, as split returned them")
        into[(col, path)] = sub
    for col, tree in state_.items():
        visit(col, (), tree)
    return into


def merge(graphdef: GraphDef, *states: Any) -> Any:
    """The node that ``split`` took apart, as new objects holding the states' values."""
    if not isinstance(graphdef, GraphDef):
        raise errors.TransformError(
            f"vj.merge needs the graphdef vj.split returned, got {type(graphdef).__name__}.",
            **errors.where(), fix="call vj.merge(graphdef, *states) with split's first result")
    values: dict[Key, Any] = {}
    for s in states:
        flatten_state(s, values)

    def value(key: Key) -> Any:
        if key not in values:
            raise errors.TransformError(
                f"vj.merge: variable {errors.format_path(key[1])} of collection '{key[0]}' is "
                "in none of the states.", collection=key[0], path=key[1], **errors.where(),
                fix="pass every state that split returned")
        return values[key]
    objects = []
    for (treedef, cells), extra in zip(graphdef.objects, graphdef.extras):
        leaves = [x for key, _ in cells for x in jax.tree.leaves(value(key))]
        objects.append(jax.tree.unflatten(treedef, [*leaves, *extra]))
    outer = [objects[ref] if kind == "object" else value(ref) for kind, ref in graphdef.parts]
    return jax.tree.unflatten(graphdef.outer, outer)


def update(node: Any, *states: Any) -> None:
    """Write the states' values into the variables of ``node``'s objects, in place (NNX's
    ``nnx.update``): the way to put new parameters into a bound module, also inside an
    object-mode transform, where each write is a ``var_set``.  A state entry that is no
    variable of an object in ``node`` raises ``TransformError``."""
    values: dict[Key, Any] = {}
    for s in states:
        flatten_state(s, values)
    graph = Graph.of(node)
    for n in graph.nodes:
        for cell in n.cells:
            key = (cell.collection, n.prefix + cell.path)
            if key in values:
                cell.set(values.pop(key))
    for col, path in values:
        raise errors.TransformError(
            f"vj.update: variable {errors.format_path(path)} of collection '{col}' is not a "
            "variable of the objects given (a plain dict is not updated in place).",
            collection=col, path=path, **errors.where(),
            fix="pass the state of this node (vj.state(node)), paths relative to it")
