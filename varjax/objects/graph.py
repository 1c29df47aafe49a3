"""The nodes of an argument tree, their cells, and where each cell lives.

``Graph.of(tree)`` walks a pytree (arguments of a transformed function, or the
node given to ``vj.split``) and finds every object node in it.  Each cell gets a
full path: the node's key path in the tree (``model``, ``opt/0``) followed by the
cell's path inside the node.  A node or variable reached twice is kept once: the
second place is an *alias* of the first (``aliases``), so sharing survives a
round trip through JAX, which copies each place separately.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from varjax import errors
from varjax.objects.nodes import Cell, NodeKind, is_node, kind_of
from varjax.primitives import Path


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


@dataclasses.dataclass
class Graph:
    """The nodes of a tree, in tree order, without repeats; ``places`` maps each node
    position of the tree (leaf index when nodes are leaves) to its node index."""

    nodes: list[Node]
    places: list[int]
    treedef: Any
    leaves: list[Any]
    paths: list[tuple[str, ...]]     # per leaf, its key path (``()`` with ``paths=False``)
    is_object: list[bool]            # per leaf

    @classmethod
    def of(cls, tree: Any, paths: bool = True) -> "Graph":
        """``paths=False``: skip the key paths (``prefix`` is ``()``), for a caller that
        only writes back; a call's trace needs them (``run.graph_of``)."""
        if paths:
            with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)
        else:
            leaves, treedef = jax.tree.flatten(tree, is_leaf=is_node)
            with_paths = [((), leaf) for leaf in leaves]
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
        return cls(nodes, places, treedef, [leaf for _, leaf in with_paths], names, is_object)

    @property
    def cells(self) -> list[tuple[Node, Cell]]:
        return [(n, c) for n in self.nodes for c in n.cells]

    def shared_cells(self) -> list[tuple[Cell, Node, Node]]:
        """Variables reached through two different nodes (one module root seen through
        two of its modules): ``(cell, first node, second node)``."""
        first: dict[Any, Node] = {}
        shared = []
        for node, cell in self.cells:
            other = first.setdefault(cell.identity, node)
            if other is not node:
                shared.append((cell, other, node))
        return shared

    def check_unshared(self, what: str) -> None:
        """``TransformError`` when two different nodes share a variable: object mode
        would see two variables where the program has one."""
        for cell, a, b in self.shared_cells():
            raise errors.TransformError(
                f"{what}: variable {errors.format_path(cell.path)} of collection "
                f"'{cell.collection}' is reached through two different objects, "
                f"{errors.format_path(a.prefix)} and {errors.format_path(b.prefix)}.",
                collection=cell.collection, path=b.prefix + cell.path, **errors.where(),
                fix="pass the object that holds the variable once (the root module made by "
                    "bind, not it and one of its submodules)")
