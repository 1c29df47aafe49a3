"""NNX's graph and state functions over NNX objects: ``state``, ``split``, ``merge``,
``update``, ``graphdef``, ``clone``, ``to_pure_dict``/``replace_by_pure_dict``.

An NNX object's state is its leaves, found by the one walk of its children
(``varjax.nnx.pytree.children``, flax.nnx's order): the Variables themselves (the same
objects, as NNX's ``state`` returns them), raw array attributes, and the key and count of
each ``Rngs`` stream.  Each leaf is named by its path in the object, as flax.nnx names it
(attribute names, list indices, ``rngs/<stream>/count``), so the ``to_pure_dict`` of a
varjax model's state and of the same flax.nnx model's hold the same paths, and checkpoints
interchange.  The ``GraphDef`` records the walk: each object's one-level treedef (which
rebuilds it) and, in graph mode, a reference where an object is met again, so ``merge``
rebuilds shared objects shared.  ``graph=False`` (tree mode) refuses shared Variables.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from varjax.ir import errors
from varjax.nnx.config import resolve
from varjax.nnx.filterlib import to_predicate
from varjax.nnx.pytree import Pytree, _Container, flatten_node, in_order, is_node
from varjax.nnx.statelib import State
from varjax.trace.rngs import Rngs, RngStream
from varjax.trace.variable import Variable, held

__all__ = ["GraphDef", "NodeDef", "NodeRef", "LeafDef", "graphdef", "state", "split", "merge",
           "update", "clone", "to_pure_dict", "replace_by_pure_dict"]

Path = tuple


@dataclasses.dataclass(frozen=True)
class LeafDef:
    """A state leaf: the Variable or array the state holds at ``path`` (a Variable reached
    again is named by its first path, so both places get the one object)."""

    path: Path


@dataclasses.dataclass(frozen=True)
class NodeRef:
    """An object met before in the walk (graph mode): the one built there."""

    index: int


@dataclasses.dataclass(frozen=True)
class NodeDef:
    """An object or container: its children's definitions in flax.nnx's order, and what
    rebuilds it from them (its one-level treedef, taking the children in JAX's order).
    ``index`` numbers NNX objects in walk order, for ``NodeRef``; plain containers have
    none, as they are never shared."""

    type: type
    index: int | None
    treedef: Any
    keys: tuple
    children: tuple[tuple[Any, Any], ...]


@dataclasses.dataclass(frozen=True)
class GraphDef:
    """The static part of an object: how to rebuild it from a state's leaves, and the
    leaves' paths (walk order).  Hashable, so it can be a static argument."""

    root: Any
    paths: tuple[Path, ...]

    def merge(self, *states: Any) -> Any:
        return merge(self, *states)


def _show(path: Path) -> str:
    return "/".join(map(str, path)) or "(the node itself)"


def _flat(node: Any, graph: bool | None = None) -> tuple[GraphDef, list[tuple[Path, Any]]]:
    """``node``'s ``GraphDef`` and its ``(path, leaf)`` pairs in flax.nnx's walk order.
    Graph mode names an object or Variable reached again by its first path (NNX lists a
    shared object once); tree mode (``graph=False``) refuses a Variable or stream reached
    twice, as flax.nnx does, and walks a repeated object again."""
    graph = resolve(graph)[0]
    first: dict[int, Path] = {}
    index: dict[int, int] = {}
    open_: dict[int, Path] = {}
    entries: list[tuple[Path, Any]] = []

    def walk(x: Any, path: Path) -> Any:
        shareable = isinstance(x, (Variable, Pytree, Rngs, RngStream))
        if shareable and id(x) in first:
            if not graph and isinstance(x, (Variable, RngStream)):
                _duplicate(x, first[id(x)], path)
            if graph:
                return LeafDef(first[id(x)]) if isinstance(x, Variable) else NodeRef(index[id(x)])
            if id(x) in open_:
                raise errors.InconsistentAliasError(
                    f"{type(x).__name__} at {_show(path)} contains itself (at "
                    f"{_show(open_[id(x)])}): tree mode (graph=False) does not take cycles.",
                    path=tuple(map(str, path)), **errors.where(), fix="pass graph=True")
        if shareable:
            first.setdefault(id(x), path)
        if not is_node(x):
            entries.append((path, x))
            return LeafDef(path)
        if isinstance(x, (Pytree, Rngs, RngStream)):
            index.setdefault(id(x), len(index))
        open_[id(x)] = path
        pairs, treedef = flatten_node(x)
        kids = tuple((k, walk(child, (*path, k))) for k, child in in_order(pairs))
        del open_[id(x)]
        return NodeDef(type(x), index.get(id(x)) if graph else None, treedef,
                       tuple(k for k, _ in pairs), kids)

    root = walk(node, ())
    return GraphDef(root, tuple(p for p, _ in entries)), entries


def _duplicate(x: Any, before: Path, path: Path) -> None:
    raise errors.InconsistentAliasError(
        f"{type(x).__name__} found at two paths, {_show(before)} and {_show(path)}: tree "
        "mode (graph=False) does not take shared references.",
        path=tuple(map(str, path)), **errors.where(),
        fix="pass graph=True (or nnx.set_graph_mode(True)), or give each place its own object")


def _build(g: GraphDef, leaf: Callable[[Path], Any]) -> Any:
    """The object ``g`` describes, ``leaf(path)`` at each leaf; an object met again (a
    ``NodeRef``) is the one built at its first place."""
    built: dict[int, Any] = {}

    def build(d: Any) -> Any:
        if isinstance(d, LeafDef):
            return leaf(d.path)
        if isinstance(d, NodeRef):
            return built[d.index]
        kids = {k: build(c) for k, c in d.children}
        obj = d.treedef.unflatten([kids[k] for k in d.keys])
        if d.index is not None:
            built[d.index] = obj
        return obj

    return build(g.root)


def graphdef(node: Any, /, *, graph: bool | None = None) -> GraphDef:
    """``node``'s structure (``split``'s first result)."""
    return _flat(node, graph)[0]


def _partition(entries: list, filters: tuple) -> list[State]:
    predicates = [to_predicate(f) for f in filters]
    parts: list[dict] = [{} for _ in predicates]
    for path, leaf in entries:
        for i, p in enumerate(predicates):
            if p(path, leaf):
                parts[i][path] = leaf
                break
    return [State.from_flat(part) for part in parts]


def state(node: Any, *filters: Any, graph: bool | None = None) -> Any:
    """The leaves of ``node`` as a ``State`` (several filters: one ``State`` each, a leaf
    in the first whose filter matches)."""
    _, entries = _flat(node, graph)
    parts = _partition(entries, filters or (...,))
    return parts[0] if len(parts) == 1 else tuple(parts)


def split(node: Any, *filters: Any, graph: bool | None = None) -> tuple:
    """``(graphdef, state, ...)``: the object's structure and its leaves, one ``State`` per
    filter (no filter: one with everything); a leaf no filter matches is an error."""
    g, entries = _flat(node, graph)
    parts = _partition(entries, filters or (...,))
    placed = sum(len(p.flat()) for p in parts)
    if placed != len(entries):
        left = next(p for p, _ in entries if not any(p in s.flat() for s in parts))
        raise errors.InvalidVariablesError(
            f"split: the leaf at {'/'.join(map(str, left))} matches none of the filters.",
            path=tuple(map(str, left)), **errors.where(),
            fix="add a last filter ... to collect the rest")
    return (g, *parts)


def merge(g: GraphDef, *states: Any) -> Any:
    """The object ``g`` describes, its leaves from ``states`` (the Variables themselves,
    as NNX's ``merge`` uses them)."""
    flat: dict[tuple, Any] = {}
    for s in states:
        flat.update(s.flat() if isinstance(s, State) else State(s).flat())
    missing = [p for p in g.paths if p not in flat]
    if missing:
        raise errors.MissingVariableError(
            f"merge: no state gives the leaf at {'/'.join(map(str, missing[0]))}.",
            path=tuple(map(str, missing[0])), **errors.where(),
            fix="pass every state split returned")
    return _build(g, flat.__getitem__)


def _set(node: Any, path: tuple, value: Any) -> None:
    """Writes ``value`` at ``path`` in ``node``: into the Variable there, else the
    attribute, element or stream field."""
    *head, last = path
    parent = node
    for k in head:
        parent = _child(parent, k)
    current = _child(parent, last)
    if isinstance(current, Variable):
        current.value = value.value if isinstance(value, Variable) else value
    elif isinstance(parent, _Container):
        parent[last] = value
    else:
        setattr(parent, last, value)


def _child(parent: Any, k: Any) -> Any:
    if isinstance(parent, _Container):
        return parent[k]
    if isinstance(parent, Rngs):
        return parent._streams[k]
    return getattr(parent, k)


def update(node: Any, *states: Any) -> None:
    """Writes the leaves of ``states`` into ``node``, in place."""
    known = set(graphdef(node).paths)
    for s in states:
        for path, value in (s.flat() if isinstance(s, State) else State(s).flat()).items():
            if path not in known:
                raise errors.MissingVariableError(
                    f"update: {type(node).__name__} has no leaf at {'/'.join(map(str, path))}.",
                    path=tuple(map(str, path)), **errors.where(),
                    fix="update with a state of this object (nnx.state(node))")
            _set(node, path, value)


def clone(node: Any, /, *, graph: bool | None = None) -> Any:
    """A copy of ``node`` with new Variables holding the same values (graph mode: what is
    shared in ``node`` is shared in the copy)."""
    g, entries = _flat(node, graph)
    copies = {path: held(type(leaf), leaf.collection, leaf.value, leaf.get_metadata())
              if isinstance(leaf, Variable) else leaf for path, leaf in entries}
    return _build(g, copies.__getitem__)


def to_pure_dict(s: Any) -> dict:
    """A state's nested dict of plain values (Variables replaced by their values)."""
    return (s if isinstance(s, State) else State(s)).to_pure_dict()


def replace_by_pure_dict(s: State, pure: Any) -> None:
    """Puts the values of ``pure`` (as ``to_pure_dict`` gives) into state ``s``."""
    s.replace_by_pure_dict(pure)
