"""NNX's graph and state functions over NNX objects: ``state``, ``split``, ``merge``,
``update``, ``graphdef``, ``clone``, ``to_pure_dict``/``replace_by_pure_dict``.

An NNX object is a pytree (``varjax.nnx.pytree``), so its structure is a JAX treedef with
its Variables as leaves, and its state is what sits at those leaves: the Variables
themselves (the same objects, as NNX's ``state`` returns them), raw array attributes, and
the key and count of each ``Rngs`` stream.  Each leaf is named by its path in the object,
as flax.nnx names it (attribute names, list indices, ``rngs/<stream>/key``), so the
``to_pure_dict`` of a varjax model's state and of the same flax.nnx model's hold the same
paths, and checkpoints interchange.  ``merge`` is ``treedef.unflatten`` of the leaves a
state gives.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import jax

from varjax.ir import errors
from varjax.nnx.filterlib import to_predicate
from varjax.nnx.pytree import Pytree, _Container
from varjax.nnx.statelib import State
from varjax.trace.rngs import Rngs, RngStream
from varjax.trace.variable import Variable, held

__all__ = ["GraphDef", "graphdef", "state", "split", "merge", "update", "clone",
           "to_pure_dict", "replace_by_pure_dict"]


def _is_leaf(x: Any) -> bool:
    return isinstance(x, Variable)


def _entries(node: Any, path: tuple = (), seen: dict | None = None
             ) -> Iterator[tuple[tuple, Any]]:
    """``(path, leaf)`` for every leaf of ``node``, in JAX's flatten order (Variables as
    leaves), named as flax.nnx names them.  An object reached again (a submodule held at
    two attributes) is named by its first path, as NNX lists a shared object once: its
    leaves come again, with the paths they have there."""
    seen = {} if seen is None else seen
    if isinstance(node, (Variable, Pytree, Rngs, RngStream)):
        path = seen.setdefault(id(node), path)
    if isinstance(node, Variable):
        yield path, node
    elif isinstance(node, _Container):
        for key, value in node._items():
            if isinstance(value, (Variable, Pytree, Rngs, RngStream)) or _is_array(value):
                yield from _entries(value, (*path, key), seen)
    elif isinstance(node, Pytree):
        for name in sorted(node.__dict__.get("_nnx_data", ())):
            yield from _entries(node.__dict__[name], (*path, name), seen)
    elif isinstance(node, Rngs):
        for name, stream in node._streams.items():
            yield from _entries(stream, (*path, name), seen)
    elif isinstance(node, RngStream):
        yield (*path, "key"), node.key
        yield (*path, "count"), node.count
    elif node is not None:
        for key, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_leaf)[0]:
            yield (*path, *(_key_name(k) for k in key)), leaf


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _key_name(k: Any) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


@dataclasses.dataclass(frozen=True)
class GraphDef:
    """The static part of an object: its treedef with Variables as leaves, and each leaf's
    path.  Hashable, so it can be a static argument."""

    treedef: Any
    paths: tuple[tuple, ...]

    def merge(self, *states: Any) -> Any:
        return merge(self, *states)


def _flat(node: Any) -> tuple[GraphDef, list[tuple[tuple, Any]]]:
    leaves, treedef = jax.tree.flatten(node, is_leaf=_is_leaf)
    entries = list(_entries(node))
    if len(entries) != len(leaves) or any(e is not leaf for (_, e), leaf in zip(entries, leaves)
                                          if isinstance(leaf, Variable)):
        raise errors.InvalidVariablesError(
            f"the leaves of {type(node).__name__} could not be named by path (a data "
            "attribute holds a pytree nnx does not know).", **errors.where(),
            fix="hold Variables, NNX objects, Rngs and arrays in data attributes")
    return GraphDef(treedef, tuple(p for p, _ in entries)), entries


def graphdef(node: Any) -> GraphDef:
    return _flat(node)[0]


def _partition(entries: list, filters: tuple) -> list[State]:
    predicates = [to_predicate(f) for f in filters]
    parts: list[dict] = [{} for _ in predicates]
    for path, leaf in entries:
        for i, p in enumerate(predicates):
            if p(path, leaf):
                parts[i][path] = leaf
                break
    return [State.from_flat(part) for part in parts]


def state(node: Any, *filters: Any) -> Any:
    """The leaves of ``node`` as a ``State`` (several filters: one ``State`` each, a leaf
    in the first whose filter matches)."""
    _, entries = _flat(node)
    parts = _partition(entries, filters or (...,))
    return parts[0] if len(parts) == 1 else tuple(parts)


def split(node: Any, *filters: Any) -> tuple:
    """``(graphdef, state, ...)``: the object's structure and its leaves, one ``State`` per
    filter (no filter: one with everything); a leaf no filter matches is an error."""
    g, entries = _flat(node)
    parts = _partition(entries, filters or (...,))
    placed = sum(len(p.flat()) for p in parts)
    if placed != len(dict(entries)):
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
    return g.treedef.unflatten([flat[p] for p in g.paths])


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


def clone(node: Any) -> Any:
    """A copy of ``node`` with new Variables holding the same values."""
    g, entries = _flat(node)
    copies = {path: held(type(leaf), leaf.collection, leaf.value, leaf.get_metadata())
              if isinstance(leaf, Variable) else leaf for path, leaf in entries}
    return g.treedef.unflatten([copies[path] for path in g.paths])     # shared stay shared


def to_pure_dict(s: Any) -> dict:
    """A state's nested dict of plain values (Variables replaced by their values)."""
    return (s if isinstance(s, State) else State(s)).to_pure_dict()


def replace_by_pure_dict(s: State, pure: Any) -> None:
    """Puts the values of ``pure`` (as ``to_pure_dict`` gives) into state ``s``."""
    s.replace_by_pure_dict(pure)
