"""NNX's graph and state functions over NNX objects: ``state``, ``split``, ``merge``,
``update``, ``graphdef``, ``clone``, ``unpack``/``GraphState``, ``flatten``/``unflatten``,
``to_pure_dict``/``replace_by_pure_dict``.  The walk itself is ``varjax.nnx.graphlib``.

An NNX object's state is its leaves, found by the one walk of its children
(``varjax.nnx.pytree.children``, flax.nnx's order): the Variables themselves (the same
objects, as NNX's ``state`` returns them), raw array attributes, and each RNG stream's
key and count as the ``RngKey``/``RngCount`` Variables flax.nnx holds there (views that
read and write the stream, ``varjax.nnx.rng_variables``).  Each leaf is named by its path
in the object, as flax.nnx names it (attribute names, list indices,
``rngs/<stream>/count``), so the ``to_pure_dict`` of a varjax model's state and of the same
flax.nnx model's hold the same paths, and checkpoints interchange.  ``merge`` gives a
stream the values of its key and count (varjax's streams hold arrays, not Variables), so
a merged stream draws on its own, where flax.nnx's shares its Variables with the split
one's.  The ``GraphDef`` records the walk: each object's one-level treedef (which
rebuilds it) and, in graph mode, a reference where an object is met again, so ``merge``
rebuilds shared objects shared.  ``graph=False`` (tree mode) refuses shared Variables.
"""
from __future__ import annotations

from typing import Any, Iterator, MutableMapping

import jax
import jax.numpy as jnp

from varjax.ir import errors
from varjax.ir.typing import Filter, Key, Node, PureDict, PyTree, StateLike
from varjax.nnx.filterlib import to_predicate
from varjax.nnx.graphlib import GraphDef, build, build_from_states, flat_of, flatten_graph, nested
from varjax.nnx.pytree import Pytree, _Container
from varjax.nnx.rng_variables import FIELDS, stream_variables
from varjax.nnx.statelib import FlatState, State
from varjax.trace.rngs import Rngs, RngStream
from varjax.trace.variable import Variable

__all__ = ["GraphDef", "GraphState", "PureState", "graphdef", "state", "split", "merge", "unpack",
           "flatten", "unflatten", "update", "clone", "set_child", "to_pure_dict", "replace_by_pure_dict"]

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


def graphdef(node: Node, /, *, graph: bool | None = None) -> GraphDef:
    """``node``'s structure (``split``'s first result)."""
    return flatten_graph(node, graph)[0]


def _partition(entries: list, filters: tuple) -> list[State]:
    predicates = [to_predicate(f) for f in filters]
    parts: list[dict] = [{} for _ in predicates]
    for path, leaf in entries:
        for i, p in enumerate(predicates):
            if p(path, leaf):
                parts[i][path] = leaf
                break
    return [nested(part) for part in parts]


def state(node: Node, *filters: Filter, graph: bool | None = None
          ) -> State | tuple[State, ...]:
    """The leaves of ``node`` as a ``State`` (several filters: one ``State`` each, a leaf
    in the first whose filter matches)."""
    _, entries = flatten_graph(node, graph)
    parts = _partition(entries, filters or (...,))
    return parts[0] if len(parts) == 1 else tuple(parts)


def split(node: Node, *filters: Filter, graph: bool | None = None) -> tuple:
    """``(graphdef, state, ...)``: the object's structure and its leaves, one ``State`` per
    filter (no filter: one with everything); a leaf no filter matches is an error."""
    g, entries = flatten_graph(node, graph)
    parts = _partition(entries, filters or (...,))
    placed = {p for s in parts for p in (_flat_paths(s))}
    if len(placed) != len(entries):
        left = next(p for p, _ in entries if p not in placed)
        raise errors.InvalidVariablesError(
            f"split: the leaf at {'/'.join(map(str, left))} matches none of the filters.",
            path=tuple(map(str, left)), **errors.where(),
            fix="add a last filter ... to collect the rest")
    return (g, *parts)


def _flat_paths(s: Any) -> set:
    return {()} if isinstance(s, Variable) else set(s.flat())


def merge(graphdef_or_graphstate: GraphDef | GraphState, /, *states: StateLike | Variable,
          copy: bool = False, recreate_variables: bool = True) -> Node:
    """The object a ``GraphDef`` describes, its leaves from ``states`` (the Variables
    themselves, as NNX's ``merge`` uses them; copies with ``copy``; a plain value made a
    Variable of the split one's type again unless ``recreate_variables=False``).  Or the
    object of ``GraphState``s (``unpack``'s), which carry their ``GraphDef``."""
    g, states = _graphdef_and_states("merge", graphdef_or_graphstate, states)
    return build_from_states(g, tuple(_as_state(s) for s in states), copy=copy,
                             recreate=recreate_variables)


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


def _as_state(s: Any) -> Any:
    if isinstance(s, GraphState):
        return s.state
    return s if isinstance(s, (State, Variable)) else State(s)


def _set(node: Any, path: tuple, value: Any) -> None:
    """Writes ``value`` at ``path`` in ``node`` (``set_child`` at its parent; into
    ``node`` itself, a bare Variable, at path ``()``)."""
    if not path:
        node.value = value.value if isinstance(value, Variable) else value
        return
    *head, last = path
    parent = node
    for k in head:
        parent = _child(parent, k)
    set_child(parent, last, value)


def set_child(parent: Node, key: Key, value: Node | PyTree) -> None:
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
    if isinstance(parent, RngStream) and k in FIELDS:
        return stream_variables(parent)[k]
    return getattr(parent, k)


def update(node: Node, *states: StateLike | Variable) -> None:
    """Writes the leaves of ``states`` into ``node``, in place."""
    known = set(graphdef(node).paths)
    for s in states:
        for path, value in flat_of(_as_state(s)).items():
            if path not in known:
                raise errors.MissingVariableError(
                    f"update: {type(node).__name__} has no leaf at {'/'.join(map(str, path))}.",
                    path=tuple(map(str, path)), **errors.where(),
                    fix="update with a state of this object (nnx.state(node))")
            _set(node, path, value)


def clone(node: Node, variables: bool = True, *, arrays: bool = False,
          graph: bool | None = None) -> Node:
    """A copy of ``node``'s structure (graph mode: what is shared in ``node`` is shared in
    the copy) holding new Variables with the same values, or ``node``'s own Variables with
    ``variables=False``; with ``arrays`` the values are copied too."""
    if arrays and not variables:
        raise errors.ConfigError(
            "clone(arrays=True) copies the arrays into new Variables, so it needs "
            "variables=True.", **errors.where(), fix="drop variables=False")
    g, entries = flatten_graph(node, graph)
    leaves = dict(entries)
    if arrays:
        leaves = {p: jax.tree.map(jnp.copy, v) for p, v in leaves.items()}
    return build(g, leaves.__getitem__, copy=variables and not arrays)


def unpack(node: Node, *filters: Filter, graph: bool | None = None
           ) -> GraphState | tuple[GraphState, ...]:
    """``split`` with the ``GraphDef`` carried by each state: one ``GraphState`` per filter
    (none or one filter: one ``GraphState``), which ``merge`` takes alone."""
    g, *states = split(node, *filters, graph=graph)
    out = tuple(GraphState(g, s) for s in states)
    return out[0] if len(out) == 1 else out


def flatten(node: Node, /, *, with_paths: bool = True, graph: bool | None = None
            ) -> tuple[GraphDef, FlatState | list[PyTree]]:
    """``(graphdef, leaves)``: a ``FlatState`` of ``(path, leaf)`` in path order, or with
    ``with_paths=False`` the list of plain values (each Variable's value), which
    ``unflatten`` makes Variables of again."""
    g, entries = flatten_graph(node, graph)
    if with_paths:
        return g, FlatState(entries, sort=False)
    return g, [leaf.value if isinstance(leaf, Variable) else leaf for _, leaf in entries]


def unflatten(graphdef: GraphDef, state: StateLike | FlatState | list[PyTree], /, *,
              copy_variables: bool = False, recreate_variables: bool = True) -> Node:
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
        flat = dict(state) if isinstance(state, FlatState) else flat_of(_as_state(state))
    return merge(graphdef, nested(flat), copy=copy_variables,
                 recreate_variables=recreate_variables)


def to_pure_dict(s: StateLike) -> dict:
    """A state's nested dict of plain values (Variables replaced by their values)."""
    return (s if isinstance(s, State) else State(s)).to_pure_dict()


def replace_by_pure_dict(s: State, pure: PureDict) -> None:
    """Puts the values of ``pure`` (as ``to_pure_dict`` gives) into state ``s``."""
    s.replace_by_pure_dict(pure)
