"""The rest of NNX's graph and state functions: flat states (``to_flat_state``,
``from_flat_state``), functions over states (``merge_state``, ``map_state``,
``split_state``, ``filter_state``), and walks of an object's graph (``pop``,
``iter_graph``, ``find_duplicates``), ``map`` over an object's state, and
``restore_int_paths`` for a checkpoint's string keys.

The state functions are ``State``'s methods (``varjax.nnx.statelib``) under flax.nnx's
names.  The walks visit an object as flax.nnx's graph mode does: depth first, an object's
attributes in name order (a ``List`` by index, ``Rngs`` by stream name), each NNX object and
Variable once however many paths lead to it, so a shared layer is walked at its first path.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping

import jax

from varjax.ir import errors
from varjax.ir.typing import Filter, Node, PathParts, PyTree, StateLike
from varjax.nnx.config import resolve
from varjax.nnx.filterlib import to_predicate
from varjax.nnx.graph import set_child
from varjax.nnx.graphlib import build, duplicate, flatten_graph
from varjax.nnx.pytree import Dict, List, Pytree, children, flatten_node, in_order, is_node
from varjax.nnx.statelib import FlatState, State, int_or_key
from varjax.nnx.traversals import flatten_to_sequence
from varjax.trace.rngs import Rngs, RngStream
from varjax.trace.unprovided import not_provided
from varjax.trace.variable import Variable

__all__ = ["to_flat_state", "from_flat_state", "merge_state", "map_state", "split_state",
           "filter_state", "pop", "iter_graph", "recursive_map", "find_duplicates", "map",
           "as_pure", "pure", "with_vars", "vars_as", "restore_int_paths"]


def to_flat_state(state: StateLike) -> FlatState:
    """``state``'s ``(path, leaf)`` pairs, sorted by path."""
    return _as_state(state).flat_state()


def from_flat_state(flat_state: Mapping[PathParts, Any] | Iterable[tuple[PathParts, Any]], *,
                    cls: type[State] = State) -> State:
    """The nested state of ``(path, leaf)`` pairs or a ``{path: leaf}`` mapping."""
    return cls.from_flat_path(flat_state)


def merge_state(state: StateLike, /, *states: StateLike, cls: type[State] = State) -> State:
    """One state of the leaves of all, the last state giving a path winning."""
    return cls.merge(state, *states)


def map_state(f: Callable[[PathParts, Any], Any], state: StateLike) -> State:
    """A new state holding ``f(path, leaf)`` at each leaf's path."""
    return _as_state(state).map(f)


def split_state(state: StateLike, first: Filter, /, *filters: Filter
                ) -> State | tuple[State, ...]:
    """One state per filter, a leaf in the first whose filter matches; every leaf must
    match one (end with ``...``)."""
    return _as_state(state).split(first, *filters)


def filter_state(state: StateLike, first: Filter, /, *filters: Filter
                 ) -> State | tuple[State, ...]:
    """As ``split_state``, leaving out the leaves no filter matches."""
    return _as_state(state).filter(first, *filters)


def map(f: Callable[[PathParts, Any], Any], node: Node, /, *, graph: bool | None = None,
        recreate_variables: bool = True) -> Node:
    """A new object of ``node``'s structure holding ``f(path, leaf)`` at each leaf.  Where
    ``f`` maps a Variable to a plain value, the new object holds a Variable of the same type
    and metadata around it (with ``recreate_variables=False``, the value itself); a
    Variable ``f`` returns is used as it is."""
    g, entries = flatten_graph(node, graph)
    made = {path: f(path, leaf) for path, leaf in entries}    # a shared leaf once: it stays shared
    return build(g, made.__getitem__, recreate=recreate_variables)


def as_pure(tree: PyTree) -> PyTree:
    """``tree`` with each Variable replaced by its value: a state without Variable types
    or metadata, for saving or exporting."""
    return jax.tree.map(lambda x: as_pure(x.value) if isinstance(x, Variable) else x, tree,
                        is_leaf=lambda x: isinstance(x, Variable))


def pure(tree: PyTree) -> PyTree:
    """``as_pure`` under its old name (deprecated in flax.nnx, which warns too)."""
    warnings.warn("nnx.pure is deprecated: use nnx.as_pure", DeprecationWarning, stacklevel=2)
    return as_pure(tree)


def with_vars(node: Node, /, *, hijax: bool | None = None, ref: bool | None = None,
              mutable: bool | None = None, only: Filter = ...,
              allow_duplicates: bool = False) -> Node:
    """``node`` with the selected Variables in the given modes.  A varjax Variable is never
    a hijax type nor an array Ref and is always mutable (object mode makes its reads and
    writes effects of the transform's trace), so ``hijax=False``, ``ref=False`` and
    ``mutable=True`` are the modes it has: no Variable differs, and ``node``'s structure
    comes back holding its own Variables, as flax.nnx's does then (``only`` and
    ``allow_duplicates`` choose among the Variables that differ: none).  The other modes
    raise ``NotProvidedError``."""
    asked = [f"{name}={value}" for name, value, have in
             (("hijax", hijax, False), ("ref", ref, False), ("mutable", mutable, True))
             if value is not None and value is not have]
    if asked:
        not_provided(f"nnx.with_vars({asked[0]})",
                     "a varjax Variable is neither a hijax type nor an array Ref, and is "
                     "always mutable: object mode gives what those modes give.",
                     f"leave {asked[0].split('=')[0]} out", by="varjax.nnx")
    return map(lambda _, leaf: leaf, node, recreate_variables=False)


def vars_as(node: Node, /, **modes: Any) -> Node:
    """``with_vars`` under its old name (deprecated in flax.nnx, which warns too)."""
    warnings.warn("nnx.vars_as is deprecated: use nnx.with_vars", DeprecationWarning,
                  stacklevel=2)
    return with_vars(node, **modes)


def restore_int_paths(pure_dict: Mapping) -> dict:
    """``pure_dict`` with each key that reads as an integer made one: a checkpoint stores
    list indices as strings, and ``to_pure_dict`` names them by int."""
    out: dict = {}
    for path, value in flatten_to_sequence(pure_dict):
        *head, last = (int_or_key(k) for k in path)
        node = out
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
    return out


def _as_state(state: Any) -> State:
    return state if isinstance(state, State) else State(state)


def _is_graph_node(x: Any) -> bool:
    return isinstance(x, (Pytree, Rngs, RngStream))


def iter_graph(node: Node, /, *, graph: bool | None = None) -> Iterator[tuple[PathParts, Any]]:
    """Every node and leaf under ``node`` with its path, children before their parent and
    ``node`` last.  Graph mode: each object and Variable once (its first path), and the
    leaves include the static attributes.  Tree mode (``graph=False``): data only, a
    repeated object walked again, a Variable or stream met twice refused, as in flax.nnx."""
    return _iter_graph(node) if resolve(graph)[0] else _iter_tree(node)


def _iter_graph(node: Any) -> Iterator[tuple[tuple, Any]]:
    seen: set[int] = set()
    stack: list[tuple[tuple, Any, bool]] = [((), node, False)]
    while stack:
        path, current, walked = stack.pop()
        if walked or not (is_node(current) or isinstance(current, Variable)):
            yield path, current
            continue
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, Variable):
            yield path, current
            continue
        stack.append((path, current, True))
        stack.extend(((*path, k), c, False) for k, c in reversed(children(current, static=True)))


def _iter_tree(node: Any) -> Iterator[tuple[tuple, Any]]:
    first: dict[int, tuple] = {}
    open_: set[int] = set()
    stack: list[tuple[tuple, Any, bool]] = [((), node, False)]
    while stack:
        path, current, walked = stack.pop()
        if walked:
            open_.discard(id(current))
            yield path, current
            continue
        if isinstance(current, (Variable, RngStream)):
            if id(current) in first:
                duplicate(current, first[id(current)], path)
            first[id(current)] = path
        if not is_node(current):
            yield path, current
            continue
        if id(current) in open_:
            raise errors.InconsistentAliasError(
                f"{type(current).__name__} at {'/'.join(map(str, path))} contains itself: "
                "tree mode (graph=False) does not take cycles.", path=tuple(map(str, path)),
                **errors.where(), fix="pass graph=True")
        open_.add(id(current))
        stack.append((path, current, True))
        stack.extend(((*path, k), c, False) for k, c in reversed(children(current)))


def recursive_map(f: Callable[[PathParts, Any], Any], node: Node, /, *,
                  graph: bool | None = None) -> Node:
    """``f(path, x)`` applied to every node and leaf under ``node``, children first, each
    result put in its parent's place; returns ``f((), ...)`` of the rebuilt root.

    Graph mode (flax.nnx's): on a copy of ``node``'s structure that shares its Variables,
    static attributes included, each object and Variable once (a shared one gets its first
    result); a Variable ``f`` replaces takes the new value in place, as flax.nnx's objects
    take one, so the original object sees it too.  Tree mode: data only, each object
    rebuilt from its mapped children, a shared Variable refused."""
    if not resolve(graph)[0]:
        return _recursive_map_tree(f, node)
    g, entries = flatten_graph(node, True)
    copy = build(g, dict(entries).__getitem__)
    results: dict[int, Any] = {}
    open_: set[int] = set()

    def visit(x: Any, path: tuple) -> Any:
        if id(x) in results:
            return results[id(x)]
        if id(x) in open_:
            raise errors.InconsistentAliasError(
                f"recursive_map: {type(x).__name__} at {'/'.join(map(str, path))} contains "
                "itself.", path=tuple(map(str, path)), **errors.where(),
                fix="map an object without cycles")
        open_.add(id(x))
        for key, child in children(x, static=True):
            new = visit(child, (*path, key))
            if new is not child:
                set_child(x, key, new)
        open_.discard(id(x))
        out = f(path, x)
        if isinstance(x, (Variable, Pytree, Rngs, RngStream)):
            results[id(x)] = out
        return out

    return visit(copy, ())


def _recursive_map_tree(f: Callable[[tuple, Any], Any], node: Any) -> Any:
    first: dict[int, tuple] = {}
    open_: set[int] = set()

    def visit(x: Any, path: tuple) -> Any:
        if isinstance(x, (Variable, RngStream)):
            if id(x) in first:
                duplicate(x, first[id(x)], path)
            first[id(x)] = path
        if not is_node(x):
            return f(path, x)
        if id(x) in open_:
            raise errors.InconsistentAliasError(
                f"recursive_map: {type(x).__name__} at {'/'.join(map(str, path))} contains "
                "itself: tree mode (graph=False) does not take cycles.",
                path=tuple(map(str, path)), **errors.where(), fix="pass graph=True")
        open_.add(id(x))
        pairs, treedef = flatten_node(x)
        mapped = {k: visit(child, (*path, k)) for k, child in in_order(pairs)}
        open_.discard(id(x))
        return f(path, treedef.unflatten([mapped[k] for k, _ in pairs]))

    return visit(node, ())


def find_duplicates(node: Node, /, *, only: Filter = ...) -> list[list[PathParts]]:
    """The paths of each NNX object or Variable reachable by more than one path (a shared
    layer, a tied weight), first path first.  ``only`` filters the repeated paths."""
    candidate = to_predicate(only)
    paths: dict[int, list[tuple]] = {}

    def walk(obj: Any, path: tuple) -> None:
        shared = _is_graph_node(obj) or isinstance(obj, Variable)
        if shared and id(obj) in paths:
            if candidate(path, obj):
                paths[id(obj)].append(path)
            return
        if shared:
            paths[id(obj)] = [path]
        for k, child in children(obj):
            walk(child, (*path, k))

    walk(node, ())
    return [p for p in paths.values() if len(p) > 1]


def pop(node: Node, *filters: Filter) -> State | tuple[State, ...]:
    """Removes from ``node`` the Variables each filter selects (a Variable in the first
    whose filter matches) and returns them, one ``State`` per filter.  A Variable reachable
    by several paths is popped at its first."""
    if not filters:
        raise errors.ConfigError("pop: no filter was given.", **errors.where(),
                                 fix="say which Variables to pop, e.g. nnx.pop(model, nnx.Intermediate)")
    predicates = [to_predicate(f) for f in filters]
    flats: list[dict[tuple, Any]] = [{} for _ in predicates]
    seen: set[int] = set()

    def walk(obj: Any, path: tuple) -> None:
        seen.add(id(obj))
        for key, value in children(obj):
            if is_node(value):
                if id(value) not in seen:
                    walk(value, (*path, key))
                continue
            if not isinstance(value, Variable) or id(value) in seen:
                continue
            here = (*path, key)
            i = next((i for i, p in enumerate(predicates) if p(here, value)), None)
            if i is not None:
                seen.add(id(value))
                found.append((obj, key, here, i, value))

    found: list[tuple[Any, Any, tuple, int, Variable]] = []
    walk(node, ())
    for parent, _, here, _, _ in found:     # refused before anything is removed
        _check_removable(parent, here)
    for parent, key, here, i, value in found:
        _remove(parent, key)
        flats[i][here] = value
    states = [State.from_flat(f) for f in flats]
    return states[0] if len(states) == 1 else tuple(states)


def _check_removable(parent: Any, path: tuple) -> None:
    names = tuple(str(k) for k in path)
    if isinstance(parent, RngStream):
        raise errors.NotProvidedError(
            f"pop: the {names[-1]} of the RNG stream at {'/'.join(names[:-1])} (at "
            f"{'/'.join(names)}) is part of the stream, which cannot lose it.",
            path=names, collection=parent.tag, **errors.where(),
            fix="select the random state with nnx.state(model, nnx.RngState), or pop "
                "other Variables (nnx.pop(model, nnx.Intermediate))")
    if isinstance(parent, (List, list, tuple, dict)):
        raise errors.NotProvidedError(
            f"pop: the Variable at {'/'.join(names)} is an element of a "
            f"{type(parent).__name__}, which pop does not remove elements from (flax.nnx "
            "refuses a plain container and leaves an nnx.List broken).",
            path=names, **errors.where(),
            fix="hold Variables to pop in module attributes or an nnx.Dict")


def _remove(parent: Any, key: Any) -> None:
    if isinstance(parent, Dict):
        del parent[key]
    else:
        delattr(parent, key)
