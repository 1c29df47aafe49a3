"""The nodes of an argument tree, their cells, and where each cell lives.

``Graph.of(tree)`` walks a pytree (arguments of a transformed function, or the
node given to ``vj.split``) and finds every object node in it.  Each cell gets a
full path: the node's key path in the tree (``model``, ``opt/0``) followed by the
cell's path inside the node.  A node reached twice is kept once: the second place is
an alias of the first (``places``), so sharing survives a round trip through JAX,
which copies each place separately.  A variable reached through two different nodes
(a module and its submodule, one ``Rngs`` held by two modules) is one variable too:
``Graph.shared`` says which cell stands for it, and a call gives it one key.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Hashable, Sequence

import jax
import numpy as np

from varjax.ir.primitives import Path
from varjax.objects.aliasing import RepeatWatch
from varjax.objects.dict_versions import version_reader
from varjax.objects.layout import Layout
from varjax.objects.nodes import Cell, NodeKind, VariableKind, is_node, kind_of
from varjax.trace.context import active
from varjax.trace.variable import HeldValues, Variable


def key_name(entry: Any) -> str:
    """A key-path entry as a path name: ``0`` for a sequence index, the key for a dict,
    the attribute for a dataclass field."""
    for attr in ("key", "idx", "name"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


@dataclasses.dataclass
class Node:
    """One object node found in a tree."""

    obj: Any
    kind: NodeKind
    prefix: Path
    cells: list[Cell]
    # Bound where another node's variables are, all of its own being theirs (``run._rebase``).
    rebased: bool = False


@dataclasses.dataclass
class Graph:
    """The nodes of a tree, in tree order, without repeats; ``places`` maps each node
    position of the tree (leaf index when nodes are leaves) to its node index."""

    nodes: list[Node]
    places: list[int]
    treedef: Any
    leaves: list[Any]
    paths: list[tuple[str, ...]]     # per leaf, its key path
    is_object: list[bool]            # per leaf
    # Per occurrence of an aliased object, the one it repeats (``aliasing.object_places``).
    objects: tuple[int, ...] = ()
    cells: list[tuple[Node, Cell]] = dataclasses.field(init=False)
    # Set when the graph is kept by ``ArgumentGraphs``: the positions of the object arguments
    # (nodes, or containers of them; every other argument is a plain value), and what
    # callers derive from the graph once.
    node_args: tuple[int, ...] | None = dataclasses.field(default=None, init=False)
    memo: dict[str, Any] = dataclasses.field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.cells = [(n, c) for n in self.nodes for c in n.cells]
        self._variables: HeldValues | _EachValue | None = None     # see write_back
        self._cells: list[int] = []
        self._writers: list[tuple[Callable[[list[Any]], None], int, int]] = []
        self._direct = False

    def write_back(self, updates: list[Any], created: list[dict]) -> None:
        """Apply a call's changes to the nodes: ``updates[i]`` is cell i's new value (None:
        unchanged), ``created[j]`` the variables created under node j (``{(collection,
        path): value}``).  A kept graph is written back on every call of a train step, so
        what to write where is worked out once per graph (a kept graph's nodes keep their
        cells): the Variable nodes, a step's usual ones, are set in one call
        (``HeldValues``, else each by its ``value``), every other node by its kind's
        writer."""
        if self._variables is None:
            variables, self._cells, self._writers, start = [], [], [], 0
            for node in self.nodes:
                if isinstance(node.kind, VariableKind):
                    variables.append(node.obj)
                    self._cells.append(start)
                else:
                    self._writers.append((node.kind.writer(node.obj), start,
                                          start + len(node.cells)))
                start += len(node.cells)
            self._variables = HeldValues.of(variables) or _EachValue(variables)
            self._direct = self._cells == list(range(start))   # only Variables: no reorder
        if self._direct:
            self._variables.write(updates)
        else:
            self._variables.write([updates[i] for i in self._cells])
            for write, start, stop in self._writers:
                write(updates[start:stop])
        if any(created):
            for node, made in zip(self.nodes, created):
                for (col, path), value in made.items():
                    node.kind.add(node.obj, col, path, value)

    @classmethod
    def of(cls, tree: Any) -> "Graph":
        """The nodes of ``tree``, each at its key path (``run.graph_of`` names the arguments)."""
        watch = RepeatWatch()
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=watch)
        nodes: list[Node] = []
        places: list[int] = []
        seen: dict[int, int] = {}
        names = [tuple(key_name(k) for k in key_path) for key_path, _ in with_paths]
        is_object = []
        for path, (_, leaf) in zip(names, with_paths):
            kind = kind_of(leaf)
            is_object.append(kind is not None)
            if kind is None:
                continue
            if id(leaf) in seen:
                places.append(seen[id(leaf)])
                continue
            seen[id(leaf)] = len(nodes)
            places.append(len(nodes))
            nodes.append(Node(leaf, kind, path, kind.cells(leaf)))
        return cls(nodes, places, treedef, [leaf for _, leaf in with_paths], names, is_object,
                   watch.places(tree))

    def layout(self) -> Layout:
        """Where the nodes are, without them (computed once per graph)."""
        found = self.memo.get("layout")
        if found is None:
            found = self.memo["layout"] = Layout(
                tuple(self.places), tuple(self.is_object), tuple(n.prefix for n in self.nodes),
                tuple(self.paths), tuple((type(n.obj), jax.tree.structure(n.obj)) for n in self.nodes),
                self.objects)
        return found

    @classmethod
    def copies(cls, layout: Layout, tree: Any) -> "Graph":
        """The graph of the copies a JAX transform made of a tree whose graph has
        ``layout`` (``tree`` has its structure, with one copy per node, ``dealias``):
        each node where the layout has it, its cells its copy's, without walking key
        paths again.  So a call's graph is built once, outside the transform."""
        leaves, treedef = jax.tree.flatten(tree, is_leaf=is_node)
        nodes: list[Node | None] = [None] * len(layout.prefixes)
        places = iter(layout.places)
        for leaf, is_object in zip(leaves, layout.is_object):
            if is_object:
                j = next(places)
                if nodes[j] is None:
                    kind = kind_of(leaf)
                    nodes[j] = Node(leaf, kind, layout.prefixes[j], kind.cells(leaf))
        graph = cls(nodes, list(layout.places), treedef, leaves, list(layout.paths),
                    list(layout.is_object), layout.objects)
        graph.memo["layout"] = layout
        return graph

    def shared(self) -> tuple[int, ...]:
        """Per cell (``cells`` order), the cell that stands for its variable: itself, or
        another cell of the same variable (``Cell.identity``) reached through another node
        (a module and its submodule, two modules bound with one ``Rngs``).  The one that
        stands is in the node with the most cells (the root module before its submodule),
        else the earliest.  Computed once per graph; ``tuple(range(len(cells)))`` when
        nothing is shared."""
        found = self.memo.get("shared")
        if found is None:
            owner: dict[Any, int] = {}
            for j in sorted(range(len(self.nodes)), key=lambda j: (-len(self.nodes[j].cells), j)):
                for c, cell in enumerate(self.nodes[j].cells):
                    owner.setdefault(cell.identity, self._start(j) + c)
            found = self.memo["shared"] = tuple(owner[cell.identity] for _, cell in self.cells)
        return found

    def sources(self, first: Sequence[int]) -> tuple[int, ...]:
        """Per cell, the cell whose value a call reads for its variable: ``shared``'s, unless
        a node of ``first`` (a ``grad``'s differentiated arguments) holds the variable too,
        then the first such node's cell, so the whole gradient is theirs."""
        shared = self.shared()
        pick = {s: s for s in shared}
        for j in reversed(first):
            for c in range(len(self.nodes[j].cells)):
                i = self._start(j) + c
                pick[shared[i]] = i
        return tuple(pick[s] for s in shared)

    def _start(self, j: int) -> int:
        return sum(len(n.cells) for n in self.nodes[:j])


class _EachValue:
    """``HeldValues.write`` for Variables that need their ``value`` property (handles,
    copies, a class with its own ``value``)."""

    def __init__(self, variables: list[Variable]):
        self.variables = variables

    def write(self, values: list[Any]) -> None:
        for v, new in zip(self.variables, values):
            if new is not None:
                v.value = new


# Types whose instances are never object nodes and hold none: a call whose positional
# arguments are all such values, nodes, or containers of nodes with a structure watch
# (``_Watch``) may keep its graph.
_PLAIN_BASES = (jax.Array, np.ndarray, np.generic, int, float, complex, str, type(None))
_PLAIN: dict[type, bool] = {}


def _plain(x: Any) -> bool:
    t = type(x)
    found = _PLAIN.get(t)
    if found is None:
        found = _PLAIN[t] = issubclass(t, _PLAIN_BASES) and not is_node(x)
    return found


# Pytree types that are mutable Python objects: per type, the Python containers (dicts,
# lists, sets) whose contents are an instance's structure, and those of them that change
# only through code that calls ``structure_changed`` (``register_mutable``).
_MUTABLE: list[tuple[type, Callable[[Any], list[Any]], Callable[[Any], list[Any]]]] = []
_TAG = operator.attrgetter("value")
# Pytree types whose structure cannot change after they are made.
_FROZEN = (tuple, type(None))
# Bumped by every change of a guarded container (``structure_changed``).
_epoch = [0]


def structure_changed() -> None:
    """Says that a guarded container (``register_mutable``) may have changed: each kept graph
    compares its guarded containers again on its next call."""
    _epoch[0] += 1


def _no_containers(_: Any) -> list[Any]:
    return []


def register_mutable(type_: type, parts: Callable[[Any], list[Any]],
                     guarded: Callable[[Any], list[Any]] = _no_containers) -> None:
    """Lets an argument holding instances of ``type_`` (an object a transform's caller keeps
    and changes between calls) have its graph kept: ``parts(x)`` are the dicts, lists and
    sets whose contents are ``x``'s structure, which a kept graph compares on every call;
    ``guarded(x)`` more of them, which change only through code that calls
    ``structure_changed`` (a type's own methods, on containers private to it), compared
    only on a call after such a change.  A container any code may change without varjax
    running (an instance's ``__dict__``: ``object.__setattr__`` writes it) is a part."""
    _MUTABLE.append((type_, parts, guarded))


def _parts_of(x: Any) -> tuple[Callable[[Any], list[Any]], Callable[[Any], list[Any]]] | None:
    if type(x) in (dict, list):
        return lambda c: [c], _no_containers
    return next(((parts, guarded) for t, parts, guarded in _MUTABLE if isinstance(x, t)), None)


class _Containers:
    """Python containers and what they held, compared by identity in C
    (``map(operator.is_, ...)``): an equal object is a change too (a Variable compares
    equal to an array of its value).  Where CPython keeps dict version tags
    (``dict_versions``) the dicts are compared only when a tag moved: a kept train step's
    modules' ``__dict__``s are then checked in one read each."""

    def __init__(self) -> None:
        self.mappings: list[tuple[dict, int, Any, tuple]] = []
        self.sequences: list[tuple[list, int, tuple]] = []
        self.sets: list[tuple[set, frozenset]] = []
        self.versions: list[Any] | None = []
        self.tags: list[int] = []

    def add(self, p: Any) -> None:
        if isinstance(p, dict):
            self.mappings.append((p, len(p), frozenset(p), tuple(p.values())))
            reader = version_reader(p)
            if reader is None or self.versions is None:
                self.versions = None
            else:
                self.versions.append(reader)
                self.tags.append(reader.value)
        elif isinstance(p, list):
            self.sequences.append((p, len(p), tuple(p)))
        else:
            self.sets.append((p, frozenset(p)))

    def same_mappings(self) -> bool:
        """Whether each dict holds the same keys and the same objects, compared entry by
        entry (where no version tag says so at once)."""
        is_ = operator.is_
        for d, n, keys, values in self.mappings:
            if len(d) != n or not all(map(is_, d.values(), values)) or d.keys() != keys:
                return False
        return True

    def unchanged(self) -> bool:
        if self.versions is None or list(map(_TAG, self.versions)) != self.tags:
            if not self.same_mappings():
                return False
            if self.versions is not None:      # changed and changed back: the same again
                self.tags = list(map(_TAG, self.versions))
        is_ = operator.is_
        for seq, n, items in self.sequences:
            if len(seq) != n or not all(map(is_, seq, items)):
                return False
        for s, frozen in self.sets:
            if s != frozen:
                return False
        return True


class _Watch:
    """A check that the structure of some arguments is what it was when they were added,
    for a kept graph: every mutable container in them (``register_mutable``) holds the same
    objects by identity, with the same keys, and every node's own watch says the same.  It
    runs on every call, so the guarded containers are compared only when
    ``structure_changed`` was called since they last were (then, found unchanged, the
    watch takes the new epoch)."""

    def __init__(self) -> None:
        self.parts, self.guarded = _Containers(), _Containers()
        self.nodes: list[tuple[Callable[[], Hashable], Hashable]] = []
        self.stamp = _epoch[0]

    def add(self, arg: Any) -> bool:
        """Watches ``arg``; False when it holds a pytree of a type of unknown mutability (a
        user's class): such an argument is walked on every call."""
        kind = kind_of(arg)
        if kind is not None:
            watch = kind.watch(arg)
            if watch is not None:
                self.nodes.append((watch, watch()))
            return True
        children, treedef = jax.tree_util.tree_flatten(arg, is_leaf=lambda y: y is not arg)
        if jax.tree_util.treedef_is_leaf(treedef):
            return True
        found = _parts_of(arg)
        if found is None and not isinstance(arg, _FROZEN):
            return False
        if found is not None:
            for p in found[0](arg):
                self.parts.add(p)
            for p in found[1](arg):
                self.guarded.add(p)
        return all(map(self.add, children))

    def unchanged(self) -> bool:
        if self.stamp != _epoch[0]:
            if not self.guarded.unchanged():
                return False
            self.stamp = _epoch[0]
        if not self.parts.unchanged():
            return False
        for watch, seen in self.nodes:
            if watch() != seen:
                return False
        return True


class _Kept:
    """A graph kept for calls on the same objects: it holds them (so their ``id``s are not
    reused while it lives) and the watch of their structure."""

    __slots__ = ("graph", "count", "objects", "plain", "watch")

    def __init__(self, graph: Graph, args: tuple, watch: _Watch):
        self.graph, self.count = graph, len(args)
        self.objects = [(i, a) for i, a in enumerate(args) if not _plain(a)]
        self.plain = [i for i, a in enumerate(args) if _plain(a)]
        self.watch = watch
        graph.node_args = tuple(i for i, _ in self.objects)

    @classmethod
    def of(cls, graph: Graph, args: tuple) -> "_Kept | None":
        """A kept graph of ``args``, or None when an argument cannot be watched."""
        watch = _Watch()
        if not all(watch.add(a) for a in args if not _plain(a)):
            return None
        return cls(graph, args, watch)

    def matches(self, args: tuple) -> bool:
        if len(args) != self.count:
            return False
        for i, obj in self.objects:
            if args[i] is not obj:
                return False
        for i in self.plain:
            if not _PLAIN.get(type(args[i])):
                return False
        return self.watch.unchanged()


class ArgumentGraphs:
    """The argument graphs of a transformed function's last few calls.

    A train step is called again and again on the same model and optimizer state, and
    finding their nodes and cells anew each time would cost more than JAX's dispatch.  A
    call whose positional arguments are plain values (arrays, numbers), nodes, or
    containers of nodes whose structure can be watched (``_Watch``: an NNX module,
    a list of Variables), with no keyword arguments, reuses the graph of an earlier call
    made outside any trace on the same objects, while their watches say the same.  ``SIZE``
    bounds the objects kept alive."""

    SIZE = 4

    def __init__(self) -> None:
        self._kept: list[_Kept] = []

    def of(self, args: tuple, kwargs: dict, make: Callable[[], Graph]) -> Graph:
        if not kwargs:
            for n, kept in enumerate(self._kept):
                if kept.matches(args):
                    if n:
                        self._kept.insert(0, self._kept.pop(n))
                    return kept.graph
        graph = make()
        if not kwargs and active() is None:
            kept = _Kept.of(graph, args)
            if kept is not None:
                self._kept.insert(0, kept)
                del self._kept[self.SIZE:]
        return graph
