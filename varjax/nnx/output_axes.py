"""A ``StateAxes`` entry of ``nnx.vmap``'s or ``nnx.pmap``'s ``out_axes``: the module returned
there comes out with each state of its filters along that filter's axis, ``None`` included
(the state is the same for every member and comes out once, as ``jax.vmap``'s
``out_axes=None`` gives it).  A ``StateSharding`` entry of ``nnx.jit``'s ``out_shardings`` or
``nnx.shard_map``'s ``out_specs`` is the same with a sharding or spec per filter
(``kind=StateSharding``).

``jax.vmap`` (``jax.pmap``) takes ``out_axes`` before tracing, as a prefix of the output, but the returned
module's structure is known only after.  So, as flax.nnx does, the module is split inside
(``split_outputs``) into its ``GraphDef`` (static: a node with no children, so any axis
covers it) and one ``State`` per filter, the entry becomes ``(None, axes)`` (``out_prefix``),
a prefix of that whatever the module holds, and outside ``joined`` merges the parts into
the module.  JAX itself then refuses a state at ``None`` that differs between members.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec

from varjax.ir import errors
from varjax.nnx.filter_maps import FilterMap
from varjax.nnx.graph import merge, split
from varjax.nnx.state_axes import StateAxes
from varjax.nnx.transform_checks import objects_in

__all__ = ["GraphDefLeaf", "split_outputs", "out_prefix", "joined"]


@dataclasses.dataclass(frozen=True)
class GraphDefLeaf:
    """A returned module's ``GraphDef`` in a traced output, its states beside it: a pytree
    with no children."""

    graphdef: Any


jax.tree_util.register_pytree_node(GraphDefLeaf, lambda s: ((), s.graphdef), lambda g, _: GraphDefLeaf(g))


def _is_entry(x: Any) -> bool:
    return x is None or isinstance(x, (FilterMap, PartitionSpec))


def _by_state(out_axes: Any, kind: type[FilterMap]) -> bool:
    return any(isinstance(e, kind) for e in jax.tree.leaves(out_axes, is_leaf=_is_entry))


@dataclasses.dataclass(frozen=True)
class _Given:
    """In place of a ``GraphDef``: the output is the argument object at ``index`` of
    ``objects_in(args)``, given back to the caller as its own (graph updates)."""

    index: int


def split_outputs(fn: Callable, out_axes: Any, updates: bool,
                  kind: type[FilterMap] = StateAxes, what: str = "") -> Callable:
    """``fn`` returning, at each ``kind`` entry, ``(GraphDef, states)``: the module there
    split by the entry's filters (``fn`` itself when ``out_axes`` has none).  An
    argument's object there is not split: with graph updates it comes back as ``_Given``
    (and no states), so ``joined`` returns the caller's object, as flax.nnx does; without
    them it is left for ``graph_updates.carrying`` to refuse.  Given ``what`` (``nnx.jit``'s
    ``out_shardings``, whose argument's Variables come back with their ``in_shardings``),
    an argument's object there is refused, as flax.nnx refuses it."""
    if not _by_state(out_axes, kind):
        return fn

    @functools.wraps(fn)
    def parts(*args: Any, **kwargs: Any) -> Any:
        given = {id(x): j for j, x in enumerate(objects_in(args))}

        def part(entry: Any, out: Any) -> Any:
            if not isinstance(entry, kind):
                return out
            if id(out) in given and what:
                raise errors.InconsistentAliasError(
                    f"{what}: an argument's {type(out).__name__} is returned at a "
                    f"{kind.__name__} entry; its Variables come back with the argument's own "
                    "entry, so it cannot take this one too (flax.nnx refuses this aliasing "
                    "too).", **errors.where(),
                    fix="return a new module, or give that output None")
            if id(out) in given:
                return (GraphDefLeaf(_Given(given[id(out)])), ((),) * len(entry)) \
                    if updates else out
            graphdef, *states = split(out, *entry.filters)
            return GraphDefLeaf(graphdef), tuple(states)
        return jax.tree.map(part, out_axes, fn(*args, **kwargs), is_leaf=_is_entry)
    return parts


def out_prefix(out_axes: Any, kind: type[FilterMap] = StateAxes, whole: Any = None) -> Any:
    """``out_axes`` with each ``kind`` entry made ``(whole, its values)``: the prefix of
    ``split_outputs``'s output (``whole`` covers the ``GraphDefLeaf``, which has no leaves:
    ``None`` for an axis or sharding, ``P()`` for a ``shard_map`` spec)."""
    return jax.tree.map(lambda e: (whole, tuple(e.values())) if isinstance(e, kind) else e,
                        out_axes, is_leaf=_is_entry)


def joined(out_axes: Any, out: Any, args: tuple, kind: type[FilterMap] = StateAxes) -> Any:
    """``out`` with each module split by ``split_outputs`` merged back, and each argument's
    object there the caller's own (of ``args``)."""
    if not _by_state(out_axes, kind):
        return out

    def one(entry: Any, o: Any) -> Any:
        if not isinstance(entry, kind):
            return o
        if isinstance(o[0].graphdef, _Given):
            return objects_in(args)[o[0].graphdef.index]
        return merge(o[0].graphdef, *o[1])
    return jax.tree.map(one, out_axes, out, is_leaf=_is_entry)
