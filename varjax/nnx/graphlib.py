"""The graph walk under NNX's graph functions: an object to a ``GraphDef`` and its leaves,
and back (flax.nnx's ``graphlib``).

``flatten_graph`` walks an object's children (``varjax.nnx.pytree.children``, flax.nnx's
order) and records, per object, its one-level treedef (which rebuilds it) and its
children's definitions; its leaves (Variables, arrays, stream keys and counts) are named by
path.  In graph mode an NNX object or Variable met again is a ``NodeRef`` to its first
place, so ``build`` makes it one object again; tree mode (``graph=False``) refuses a shared
Variable, as flax.nnx does.

Walks can share their bookkeeping, as flax.nnx's contexts do (``varjax.nnx.contexts``): a
``RefMap`` numbers the objects of several ``flatten_graph`` calls (an object split before
is a ``NodeRef``), an index map gives ``build`` the objects of earlier builds, and an
*outer* numbering marks which objects of a walk stand for a caller's objects, which
``build`` then refills in place (NNX's graph updates).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from varjax.ir import errors
from varjax.ir.typing import Node, StateLike
from varjax.nnx.config import resolve
from varjax.nnx.pytree import Pytree, flatten_node, in_order, is_node
from varjax.nnx.rng_variables import VariableStream, plain_type
from varjax.nnx.statelib import State
from varjax.objects.graph import structure_changed
from varjax.trace.rngs import Rngs, RngStream
from varjax.trace.variable import Variable, held

__all__ = ["GraphDef", "NodeDef", "NodeRef", "LeafDef", "ApplyCaller", "RefMap", "flatten_graph",
           "build", "build_from_states", "nested", "flat_of", "is_graph_node"]

Path = tuple


def is_graph_node(x: object) -> bool:
    """An object with identity in NNX's graph: an NNX object, ``Rngs`` or a stream (plain
    containers are values, walked again wherever they are met)."""
    return isinstance(x, (Pytree, Rngs, RngStream))


@dataclasses.dataclass(frozen=True)
class LeafDef:
    """A state leaf: the Variable or array the state holds at ``path``.  ``variable`` (a
    Variable's type, collection and metadata) makes a plain value a Variable again;
    ``index``/``outer_index`` number a Variable as objects are numbered."""

    path: Path
    variable: tuple | None = None
    index: int | None = None
    outer_index: int | None = None


@dataclasses.dataclass(frozen=True)
class NodeRef:
    """An object or Variable met before (graph mode): the one built there."""

    index: int


@dataclasses.dataclass(frozen=True)
class NodeDef:
    """An object or container: its children's definitions in flax.nnx's order, and what
    rebuilds it (its one-level treedef, taking the children in JAX's order, ``keys``).
    NNX objects are numbered (``index``) for ``NodeRef``s; plain containers are not."""

    type: type
    index: int | None
    outer_index: int | None
    treedef: jax.tree_util.PyTreeDef
    keys: tuple
    children: tuple[tuple[Any, Any], ...]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class GraphDef:
    """The static part of an object: how to rebuild it from a state's leaves, and the
    leaves' paths (walk order).  Hashable and a static pytree, so it can be a static
    argument and a function's output under ``jax.jit``."""

    root: NodeDef | LeafDef | NodeRef
    paths: tuple[Path, ...]

    def merge(self, *states: StateLike | Variable) -> Node:
        return build_from_states(self, states)

    def apply(self, state: StateLike | Variable, *states: StateLike | Variable,
              graph: bool | None = None) -> "ApplyCaller":
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

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, tuple[GraphDef, Any]]:
        fn = obj = build_from_states(self.graphdef, self.states)
        for name in self.names:
            fn = getattr(fn, name)
        out = fn(*args, **kwargs)
        g, entries = flatten_graph(obj, self.graph)
        return out, (g, State.from_flat(dict(entries)))


class RefMap:
    """Objects and Variables numbered in the order walks meet them.  It holds them, so an
    ``id`` stays theirs while the map lives."""

    def __init__(self) -> None:
        self._index: dict[int, int] = {}
        self._objects: list[Any] = []

    def get(self, x: Node) -> int | None:
        return self._index.get(id(x))

    def add(self, x: Node) -> int:
        self._index[id(x)] = len(self._objects)
        self._objects.append(x)
        return self._index[id(x)]

    def objects(self) -> dict[int, Any]:
        """``{index: object}``."""
        return dict(enumerate(self._objects))

    def __len__(self) -> int:
        return len(self._objects)


def _variable_def(x: Any) -> tuple | None:
    if not isinstance(x, Variable):
        return None
    return plain_type(x), x.collection, tuple(sorted(x.get_metadata().items()))


def show(path: Path) -> str:
    return "/".join(map(str, path)) or "(the node itself)"


def duplicate(x: Any, before: Path, path: Path) -> None:
    """The error of tree mode for an object met twice."""
    raise errors.InconsistentAliasError(
        f"{type(x).__name__} found at two paths, {show(before)} and {show(path)}: tree "
        "mode (graph=False) does not take shared references.",
        path=tuple(map(str, path)), **errors.where(),
        fix="pass graph=True (or nnx.set_graph_mode(True)), or give each place its own object")


def flatten_graph(node: Node, graph: bool | None = None, *, refs: RefMap | None = None,
                  outer: dict[int, int] | None = None) -> tuple[GraphDef, list[tuple[Path, Any]]]:
    """``node``'s ``GraphDef`` and its ``(path, leaf)`` pairs in flax.nnx's walk order.
    Graph mode numbers objects and Variables in ``refs`` (shared with earlier walks when
    given): one met again is a ``NodeRef``.  ``outer`` (``{id: outer index}``) marks the
    objects that stand for a caller's.  Tree mode refuses a Variable or stream met twice
    and walks a repeated object again, as flax.nnx does."""
    graph = resolve(graph)[0]
    refs = RefMap() if refs is None else refs
    outer = outer or {}
    first: dict[int, Path] = {}
    open_: dict[int, Path] = {}
    entries: list[tuple[Path, Any]] = []

    def walk(x: Any, path: Path) -> Any:
        numbered = isinstance(x, Variable) or is_graph_node(x)
        if numbered and graph and refs.get(x) is not None:
            return NodeRef(refs.get(x))
        if numbered and not graph:
            if id(x) in first and isinstance(x, (Variable, RngStream)):
                duplicate(x, first[id(x)], path)
            if id(x) in open_:
                raise errors.InconsistentAliasError(
                    f"{type(x).__name__} at {show(path)} contains itself (at "
                    f"{show(open_[id(x)])}): tree mode (graph=False) does not take cycles.",
                    path=tuple(map(str, path)), **errors.where(), fix="pass graph=True")
            first.setdefault(id(x), path)
        index = refs.add(x) if numbered and graph else None
        if not is_node(x):
            entries.append((path, x))
            return LeafDef(path, _variable_def(x), index, outer.get(id(x)))
        open_[id(x)] = path
        pairs, treedef = flatten_node(x)
        kids = tuple((k, walk(child, (*path, k))) for k, child in in_order(pairs))
        del open_[id(x)]
        # a stream is rebuilt as a plain ``RngStream`` holding values, whatever kind it was
        # (one bound inside an object-mode body reads its fields from the trace)
        kind = RngStream if isinstance(x, RngStream) else type(x)
        return NodeDef(kind, index, outer.get(id(x)), treedef, tuple(k for k, _ in pairs),
                       kids)

    root = walk(node, ())
    return GraphDef(root, tuple(p for p, _ in entries)), entries


def build(g: GraphDef, value_at: Callable[[Path], Any], *, copy: bool = False,
          recreate: bool = True, built: dict[int, Any] | None = None,
          outer: dict[int, Any] | None = None) -> Node:
    """The object ``g`` describes, ``value_at(path)`` at each leaf (a copy of a Variable
    with ``copy``; a plain value where a Variable was made one again with ``recreate``).
    ``built`` (``{index: object}``, shared with earlier builds when given) resolves
    ``NodeRef``s; an object whose outer index is in ``outer`` is that caller's object,
    refilled in place (its Variables take the new values), so identity and cycles
    survive."""
    built = {} if built is None else built
    outer = outer or {}

    def leaf(d: LeafDef) -> Any:
        value = value_at(d.path)
        if isinstance(value, Variable) and copy:
            value = held(plain_type(value), value.collection, value.value, value.get_metadata())
        elif d.variable is not None and not isinstance(value, Variable) and recreate:
            typ, collection, metadata = d.variable
            value = held(typ, collection, value, dict(metadata))
        if d.outer_index in outer:
            mine = outer[d.outer_index]
            mine.value = value.value if isinstance(value, Variable) else value
            value = mine
        if d.index is not None:
            built[d.index] = value
        return value

    def node(d: NodeDef) -> Any:
        if d.index is None:    # a plain container: never shared, built from its children
            kids = {k: build_(c) for k, c in d.children}
            return d.treedef.unflatten([kids[k] for k in d.keys])
        reuse = d.outer_index in outer
        obj = outer[d.outer_index] if reuse else object.__new__(d.type)
        built[d.index] = obj       # before its children, which may refer to it
        kids = {k: build_(c) for k, c in d.children}
        fresh = d.treedef.unflatten([kids[k] for k in d.keys])
        if isinstance(fresh, VariableStream) and type(obj) is not VariableStream:
            # An RNG stream merged over the Variables of a state (``VariableStream``); the
            # caller's own stream got its values through its views already.
            if reuse:
                return obj
            obj.__class__ = type(fresh)
        if reuse:
            obj.__dict__.clear()
            structure_changed()
        obj.__dict__.update(fresh.__dict__)
        return obj

    def build_(d: Any) -> Any:
        if isinstance(d, NodeRef):
            return built[d.index]
        return leaf(d) if isinstance(d, LeafDef) else node(d)

    return build_(g.root)


def build_from_states(g: GraphDef, states: tuple, **options: Any) -> Node:
    """``build`` with the leaves of ``states`` (``State``s or mappings, later ones winning
    at a path); a leaf none gives is a ``MissingVariableError``."""
    flat: dict[Path, Any] = {}
    for s in states:
        flat.update(flat_of(s))
    missing = [p for p in g.paths if p not in flat]
    if missing:
        raise errors.MissingVariableError(
            f"merge: no state gives the leaf at {show(missing[0])}.",
            path=tuple(map(str, missing[0])), **errors.where(),
            fix="pass every state split returned")
    return build(g, flat.__getitem__, **options)


def nested(flat: dict[Path, Any]) -> State | Variable:
    """The state of ``{path: leaf}`` pairs; of a bare Variable split alone (its path
    ``()``), the Variable itself, as flax.nnx gives it."""
    return flat[()] if () in flat else State.from_flat(flat)


def flat_of(state: StateLike | Variable) -> dict[Path, Any]:
    """``{path: leaf}`` of a ``State``, a mapping, or a bare Variable (path ``()``)."""
    if isinstance(state, Variable):
        return {(): state}
    return (state if isinstance(state, State) else State(state)).flat()
