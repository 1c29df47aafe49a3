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
from typing import Any, Callable, Iterator, MutableMapping

import jax

from varjax.ir import errors
from varjax.nnx.config import resolve
from varjax.nnx.filterlib import to_predicate
from varjax.nnx.pytree import Pytree, _Container, flatten_node, in_order, is_node
from varjax.nnx.statelib import FlatState, State
from varjax.trace.rngs import Rngs, RngStream
from varjax.trace.variable import Variable, held

__all__ = ["GraphDef", "NodeDef", "NodeRef", "LeafDef", "ApplyCaller", "GraphState", "PureState",
           "graphdef", "state", "split", "merge", "unpack", "flatten", "unflatten", "update",
           "clone", "set_child", "to_pure_dict", "replace_by_pure_dict"]

Path = tuple


@dataclasses.dataclass(frozen=True)
class LeafDef:
    """A state leaf: the Variable or array the state holds at ``path`` (a Variable reached
    again is named by its first path, so both places get the one object).  ``variable``,
    a Variable's type, collection and metadata, makes a Variable again of a plain value
    (``unflatten`` of ``flatten(..., with_paths=False)``'s values, ``merge`` of one)."""

    path: Path
    variable: tuple | None = None


def _variable_def(x: Any) -> tuple | None:
    if not isinstance(x, Variable):
        return None
    return type(x), x.collection, tuple(sorted(x.get_metadata().items()))


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

    def apply(self, state: Any, *states: Any, graph: bool | None = None) -> "ApplyCaller":
        """A caller of the object merged from the states: ``g.apply(s)(x)`` calls it,
        ``g.apply(s).method(x)`` a method, and each returns ``(out, (graphdef, state))``
        with the object's structure and state after the call: a pure function of state."""
        return ApplyCaller(self, (state, *states), graph, ())


@dataclasses.dataclass(frozen=True)
class ApplyCaller:
    """What ``GraphDef.apply`` returns: an attribute path to call on the merged object."""

    graphdef: GraphDef
    states: tuple
    graph: bool | None
    names: tuple[str, ...]

    def __getattr__(self, name: str) -> "ApplyCaller":
        return dataclasses.replace(self, names=(*self.names, name))

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, tuple[GraphDef, State]]:
        fn = obj = merge(self.graphdef, *self.states)
        for name in self.names:
            fn = getattr(fn, name)
        out = fn(*args, **kwargs)
        g, entries = _flat(obj, self.graph)
        return out, (g, State.from_flat(dict(entries)))


class GraphState(MutableMapping):
    """A ``State`` that carries its object's ``GraphDef`` (``unpack``'s result), so
    ``merge(graph_state)`` needs nothing else.  Reads and writes go to the state; a pytree
    of the state's leaves, the ``GraphDef`` static."""

    def __init__(self, graphdef: GraphDef, state: State, /):
        if not isinstance(state, State):
            raise errors.InvalidVariablesError(
                f"GraphState takes a State, got {type(state).__name__}.", **errors.where(),
                fix="pass a State (nnx.state(node))")
        self.__dict__.update(graphdef=graphdef, state=state)

    def __getitem__(self, k: Any) -> Any:
        return self.state[k]

    def __setitem__(self, k: Any, v: Any) -> None:
        self.state[k] = v

    def __delitem__(self, k: Any) -> None:
        del self.state[k]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)

    def __getattr__(self, k: str) -> Any:
        return getattr(self.__dict__["state"], k)

    def __repr__(self) -> str:
        return f"GraphState({self.state!r})"


jax.tree_util.register_pytree_with_keys(
    GraphState,
    lambda g: (jax.tree_util.tree_flatten_with_path(g.state)[0], (g.graphdef, jax.tree.structure(g.state))),
    lambda aux, leaves: GraphState(aux[0], aux[1].unflatten(leaves)),
    lambda g: (jax.tree.leaves(g.state), (g.graphdef, jax.tree.structure(g.state))))

PureState = tuple[GraphDef, State]
"""A ``(graphdef, state)`` pair, as flax.nnx names it."""


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
                return (LeafDef(first[id(x)], _variable_def(x)) if isinstance(x, Variable)
                        else NodeRef(index[id(x)]))
            if id(x) in open_:
                raise errors.InconsistentAliasError(
                    f"{type(x).__name__} at {_show(path)} contains itself (at "
                    f"{_show(open_[id(x)])}): tree mode (graph=False) does not take cycles.",
                    path=tuple(map(str, path)), **errors.where(), fix="pass graph=True")
        if shareable:
            first.setdefault(id(x), path)
        if not is_node(x):
            entries.append((path, x))
            return LeafDef(path, _variable_def(x))
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


def _build(g: GraphDef, value_at: Callable[[Path], Any], *, copy: bool = False,
           recreate: bool = True) -> Any:
    """The object ``g`` describes, ``value_at(path)`` at each leaf (a copy of a Variable
    with ``copy``; a plain value where a Variable was made one again with ``recreate``);
    an object met again (a ``NodeRef``) is the one built at its first place."""
    built: dict[int, Any] = {}
    made: dict[Path, Any] = {}

    def leaf(d: LeafDef) -> Any:
        if d.path not in made:
            value = value_at(d.path)
            if isinstance(value, Variable) and copy:
                value = held(type(value), value.collection, value.value, value.get_metadata())
            elif d.variable is not None and not isinstance(value, Variable) and recreate:
                typ, collection, metadata = d.variable
                value = held(typ, collection, value, dict(metadata))
            made[d.path] = value
        return made[d.path]

    def build(d: Any) -> Any:
        if isinstance(d, LeafDef):
            return leaf(d)
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


def merge(graphdef_or_graphstate: Any, /, *states: Any, copy: bool = False,
          recreate_variables: bool = True) -> Any:
    """The object a ``GraphDef`` describes, its leaves from ``states`` (the Variables
    themselves, as NNX's ``merge`` uses them; copies with ``copy``; a plain value made a
    Variable of the split one's type again unless ``recreate_variables=False``).  Or the
    object of ``GraphState``s (``unpack``'s), which carry their ``GraphDef``."""
    g, states = _graphdef_and_states("merge", graphdef_or_graphstate, states)
    flat: dict[tuple, Any] = {}
    for s in states:
        flat.update(_as_state(s).flat())
    missing = [p for p in g.paths if p not in flat]
    if missing:
        raise errors.MissingVariableError(
            f"merge: no state gives the leaf at {'/'.join(map(str, missing[0]))}.",
            path=tuple(map(str, missing[0])), **errors.where(),
            fix="pass every state split returned")
    return _build(g, flat.__getitem__, copy=copy, recreate=recreate_variables)


def _graphdef_and_states(what: str, first: Any, states: tuple) -> tuple[GraphDef, tuple]:
    if isinstance(first, GraphState):
        if any(not isinstance(s, GraphState) or s.graphdef != first.graphdef for s in states):
            raise errors.InvalidVariablesError(
                f"{what}: after a GraphState, every state must be a GraphState of the same "
                "GraphDef.", **errors.where(), fix="pass the GraphStates one unpack returned")
        return first.graphdef, (first.state, *(s.state for s in states))
    if not isinstance(first, GraphDef):
        raise errors.InvalidVariablesError(
            f"{what} takes a GraphDef or a GraphState first, got {type(first).__name__}.",
            **errors.where(), fix="pass what split (a GraphDef) or unpack returned")
    if not states:
        raise errors.MissingVariableError(
            f"{what}: no state was given for the GraphDef.", **errors.where(),
            fix="pass the states split returned")
    return first, states


def _as_state(s: Any) -> State:
    if isinstance(s, GraphState):
        return s.state
    return s if isinstance(s, State) else State(s)


def _set(node: Any, path: tuple, value: Any) -> None:
    """Writes ``value`` at ``path`` in ``node`` (``set_child`` at its parent)."""
    *head, last = path
    parent = node
    for k in head:
        parent = _child(parent, k)
    set_child(parent, last, value)


def set_child(parent: Any, key: Any, value: Any) -> None:
    """Puts ``value`` at ``key`` of ``parent``: into the Variable there (its value, as
    flax.nnx's graph nodes take one), else as the attribute, element or stream.  A tuple
    or other immutable container refuses, as in flax.nnx."""
    current = _child(parent, key)
    if isinstance(current, Variable):
        current.value = value.value if isinstance(value, Variable) else value
    elif isinstance(parent, (_Container, dict, list)):
        parent[key] = value
    elif isinstance(parent, Rngs):
        parent._streams[key] = value
    elif isinstance(parent, (Pytree, RngStream)):
        setattr(parent, key, value)
    else:
        raise errors.InvalidVariablesError(
            f"a {type(parent).__name__} cannot have its child '{key}' replaced: it is "
            "immutable.", path=(str(key),), **errors.where(),
            fix="hold the values in an nnx.List/nnx.Dict, a list or a dict")


def _child(parent: Any, k: Any) -> Any:
    if isinstance(parent, (_Container, dict, list, tuple)):
        return parent[k]
    if isinstance(parent, Rngs):
        return parent._streams[k]
    return getattr(parent, k)


def update(node: Any, *states: Any) -> None:
    """Writes the leaves of ``states`` into ``node``, in place."""
    known = set(graphdef(node).paths)
    for s in states:
        for path, value in _as_state(s).flat().items():
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
    return _build(g, dict(entries).__getitem__, copy=True)


def unpack(node: Any, *filters: Any, graph: bool | None = None) -> Any:
    """``split`` with the ``GraphDef`` carried by each state: one ``GraphState`` per filter
    (none or one filter: one ``GraphState``), which ``merge`` takes alone."""
    g, *states = split(node, *filters, graph=graph)
    out = tuple(GraphState(g, s) for s in states)
    return out[0] if len(out) == 1 else out


def flatten(node: Any, /, *, with_paths: bool = True, graph: bool | None = None
            ) -> tuple[GraphDef, Any]:
    """``(graphdef, leaves)``: a ``FlatState`` of ``(path, leaf)`` in path order, or with
    ``with_paths=False`` the list of plain values (each Variable's value), which
    ``unflatten`` makes Variables of again."""
    g, entries = _flat(node, graph)
    if with_paths:
        return g, FlatState(entries, sort=False)
    return g, [leaf.value if isinstance(leaf, Variable) else leaf for _, leaf in entries]


def unflatten(graphdef: GraphDef, state: Any, /, *, copy_variables: bool = False,
              recreate_variables: bool = True) -> Any:
    """The object of ``graphdef`` with the leaves of ``state``: a ``State``, a mapping, a
    ``FlatState``, or a list in ``flatten``'s order (plain values become Variables of the
    flattened ones' types)."""
    if isinstance(state, list):
        if len(state) != len(graphdef.paths):
            raise errors.VariableStructureError(
                f"unflatten: the GraphDef has {len(graphdef.paths)} leaves, the list "
                f"{len(state)}.", **errors.where(),
                fix="pass the leaves flatten(..., with_paths=False) returned")
        flat = dict(zip(graphdef.paths, state))
    else:
        flat = dict(state) if isinstance(state, FlatState) else _as_state(state).flat()
    return merge(graphdef, State.from_flat(flat), copy=copy_variables,
                 recreate_variables=recreate_variables)


def to_pure_dict(s: Any) -> dict:
    """A state's nested dict of plain values (Variables replaced by their values)."""
    return (s if isinstance(s, State) else State(s)).to_pure_dict()


def replace_by_pure_dict(s: State, pure: Any) -> None:
    """Puts the values of ``pure`` (as ``to_pure_dict`` gives) into state ``s``."""
    s.replace_by_pure_dict(pure)
