"""flax.nnx's ``to_tree``/``from_tree`` and ``NodeStates`` (its ``extract`` module): a pytree
holding NNX objects turned into a pure pytree and back.

``to_tree`` replaces each NNX object or Variable in a pytree by a ``NodeStates`` (its
``GraphDef`` and states, by default ``split``'s), all split in one ``split_context``, so an
object reachable from two places of the pytree is split once and referred to after; a pure
pytree goes where a plain JAX function or transform takes one.  ``from_tree`` merges them
back in one ``merge_context``, which rebuilds the sharing.  ``prefix`` gives each part of
the pytree a value (as a JAX prefix of it) that ``split_fn``/``merge_fn`` receive, and an
object or Variable reached under two different prefix values is an error, as its states
could not follow both.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Iterable

import jax

from varjax.ir import errors
from varjax.ir.typing import Node, Prefix, PyTree
from varjax.nnx.contexts import MergeContext, SplitContext, merge_context, split_context
from varjax.nnx.graphlib import GraphDef, is_graph_node
from varjax.nnx.state_ops import iter_graph
from varjax.nnx.statelib import State
from varjax.trace.variable import Variable

__all__ = ["NodeStates", "to_tree", "from_tree", "default_split_fn", "merge_tree_node",
           "is_tree_node"]

_MISSING: Any = object()


@dataclasses.dataclass(frozen=True)
class NodeStates:
    """An object in a pure pytree: its ``GraphDef`` (static) and states (the pytree's
    leaves), with ``metadata`` (static) for a custom ``split_fn``."""

    _graphdef: GraphDef | None
    states: tuple
    metadata: Hashable = None

    @property
    def graphdef(self) -> GraphDef:
        if self._graphdef is None:
            raise errors.MissingVariableError(
                "this NodeStates holds no GraphDef (it was made by from_states or "
                "from_prefixes).", **errors.where(), fix="make it with NodeStates.from_split")
        return self._graphdef

    @property
    def state(self) -> State | Variable | Prefix:
        """The one state (an error if there are several)."""
        if len(self.states) != 1:
            raise errors.InvalidVariablesError(
                f"this NodeStates holds {len(self.states)} states, not one.",
                **errors.where(), fix="read .states")
        return self.states[0]

    @classmethod
    def from_split(cls, graphdef: GraphDef | None, state: State | Variable, /,
                   *states: State | Variable, metadata: Hashable = None) -> "NodeStates":
        return cls(graphdef, (state, *states), metadata)

    @classmethod
    def from_states(cls, state: State | Variable, *states: State | Variable) -> "NodeStates":
        return cls(None, (state, *states), None)

    @classmethod
    def from_prefixes(cls, prefixes: Iterable[Prefix], /, *,
                      metadata: Hashable = None) -> "NodeStates":
        return cls(None, tuple(prefixes), metadata)


jax.tree_util.register_dataclass(NodeStates, data_fields=["_graphdef", "states"],
                                 meta_fields=["metadata"])


def default_split_fn(ctx: SplitContext, path: tuple, prefix: Prefix, leaf: Node) -> NodeStates:
    """``split``'s ``GraphDef`` and state of ``leaf``, in the shared context."""
    return NodeStates.from_split(*ctx.split(leaf))


def merge_tree_node(ctx: MergeContext, path: tuple, prefix: Prefix, leaf: NodeStates) -> Node:
    """The object of a ``NodeStates``, in the shared context."""
    if not isinstance(leaf, NodeStates):
        raise errors.InvalidVariablesError(
            f"from_tree: expected a NodeStates at {jax.tree_util.keystr(path)}, got "
            f"{type(leaf).__name__}.", **errors.where(), fix="pass what to_tree returned")
    return ctx.merge(leaf.graphdef, *leaf.states)


def is_tree_node(x: object) -> bool:
    """Whether ``x`` is a ``NodeStates`` (an object ``to_tree`` replaced)."""
    return isinstance(x, NodeStates)


def _is_object(x: Any) -> bool:
    return isinstance(x, Variable) or is_graph_node(x)


def _with_prefixes(tree: Any, prefix: Any, is_leaf: Callable[[Any], bool]
                   ) -> tuple[list[tuple[Any, Any, Any]], Any]:
    """``(keypath, leaf, prefix value)`` for each leaf of ``tree`` (``prefix`` a JAX prefix
    of it: each of its leaves, ``None`` included, stands for a whole subtree), and the
    treedef."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    if prefix is _MISSING or prefix is None:
        return [(p, leaf, prefix) for p, leaf in leaves], treedef
    values: list[Any] = []
    jax.tree.map(lambda p, sub: values.extend([p] * len(jax.tree.leaves(sub, is_leaf=is_leaf))),
                 prefix, tree, is_leaf=lambda x: x is None or is_leaf(x))
    return [(p, leaf, v) for (p, leaf), v in zip(leaves, values)], treedef


def _check_aliasing(node: Any, prefix: Any, seen: dict[int, list[tuple[tuple, Any]]]) -> None:
    for path, value in iter_graph(node, graph=True):
        if _is_object(value):
            seen.setdefault(id(value), []).append((path, prefix))
            places = seen[id(value)]
            if any(p != places[0][1] for _, p in places):
                shown = "; ".join(f"{'/'.join(map(str, q)) or '<root>'}: {p!r}" for q, p in places)
                raise errors.InconsistentAliasError(
                    f"to_tree: a {type(value).__name__} is reached under different prefixes "
                    f"({shown}).", **errors.where(),
                    fix="give every place of a shared object the same prefix")


def to_tree(tree: PyTree, /, *, prefix: Prefix = _MISSING,
            split_fn: Callable[[SplitContext, tuple, Prefix, Any], Any] = default_split_fn,
            map_non_graph_nodes: bool = False, ctxtag: Hashable | None = None,
            check_aliasing: bool = True) -> PyTree:
    """``tree`` with each NNX object and Variable replaced by ``split_fn``'s result (a
    ``NodeStates``), all split in one context (module docstring); with
    ``map_non_graph_nodes`` the other leaves too."""
    leaves, treedef = _with_prefixes(tree, prefix, _is_object)
    seen: dict[int, list[tuple[tuple, Any]]] = {}
    out = []
    with split_context(ctxtag) as ctx:
        for path, leaf, leaf_prefix in leaves:
            if _is_object(leaf):
                if check_aliasing and prefix is not _MISSING and prefix is not None:
                    _check_aliasing(leaf, leaf_prefix, seen)
                leaf = split_fn(ctx, path, leaf_prefix, leaf)
            elif map_non_graph_nodes:
                leaf = split_fn(ctx, path, leaf_prefix, leaf)
            out.append(leaf)
    return treedef.unflatten(out)


def from_tree(tree: PyTree, /, *, prefix: Prefix = _MISSING,
              merge_fn: Callable[[MergeContext, tuple, Prefix, Any], Any] = merge_tree_node,
              is_node_leaf: Callable[[Any], bool] = is_tree_node,
              is_leaf: Callable[[Any], bool] = is_tree_node, map_non_graph_nodes: bool = False,
              is_inner: bool | None = None, ctxtag: Hashable | None = None) -> PyTree:
    """``to_tree`` undone: each ``NodeStates`` (what ``is_node_leaf`` accepts) merged back
    with ``merge_fn``, all in one context, so shared objects come back shared."""
    leaves, treedef = _with_prefixes(tree, prefix, is_leaf)
    out = []
    with merge_context(ctxtag, is_inner) as ctx:
        for path, leaf, leaf_prefix in leaves:
            if map_non_graph_nodes or is_node_leaf(leaf) or isinstance(leaf, Variable):
                leaf = merge_fn(ctx, path, leaf_prefix, leaf)
            out.append(leaf)
    return treedef.unflatten(out)
