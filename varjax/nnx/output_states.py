"""A ``StateSharding`` entry of ``nnx.shard_map``'s ``out_specs``: the module returned there
comes out split by the entry's filters, each part with its spec, as flax.nnx 0.12.8 gives it.

JAX takes ``out_specs`` before tracing, as a prefix of the output, but the returned module's
structure is known only after.  So, as flax.nnx does, the function's module is split inside
(``split_by_state``) into its ``GraphDef`` (static: a node with no children, so any spec
covers it) and one ``State`` per filter, and the entry becomes ``(P(), specs)``
(``by_state_specs``), a prefix of that whatever the module holds; outside, ``joined`` merges
the parts into the module.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec

from varjax.nnx.filter_maps import StateSharding
from varjax.nnx.graph import merge, split
from varjax.nnx.output_axes import GraphDefLeaf

__all__ = ["split_by_state", "by_state_specs", "joined"]


def _is_entry(x: Any) -> bool:
    return x is None or isinstance(x, (PartitionSpec, StateSharding))


def _has_state_sharding(out_specs: Any) -> bool:
    return any(isinstance(e, StateSharding) for e in jax.tree.leaves(out_specs,
                                                                    is_leaf=_is_entry))


def split_by_state(fn: Callable, out_specs: Any) -> Callable:
    """``fn`` returning, at each ``StateSharding`` entry, ``(GraphDef, states)``: the module
    there split by the entry's filters (``fn`` itself when ``out_specs`` has none)."""
    if not _has_state_sharding(out_specs):
        return fn

    def part(spec: Any, out: Any) -> Any:
        if not isinstance(spec, StateSharding):
            return out
        graphdef, *states = split(out, *spec.filters)
        return GraphDefLeaf(graphdef), tuple(states)

    @functools.wraps(fn)
    def parts(*args: Any, **kwargs: Any) -> Any:
        return jax.tree.map(part, out_specs, fn(*args, **kwargs), is_leaf=_is_entry)
    return parts


def by_state_specs(out_specs: Any) -> Any:
    """``out_specs`` with each ``StateSharding`` made ``(P(), its specs)``: the prefix of
    ``split_by_state``'s output."""
    return jax.tree.map(lambda e: (PartitionSpec(), tuple(e.shardings))
                        if isinstance(e, StateSharding) else e, out_specs, is_leaf=_is_entry)


def joined(out_specs: Any, out: Any) -> Any:
    """``out`` with each split module of ``split_by_state`` merged back."""
    if not _has_state_sharding(out_specs):
        return out
    return jax.tree.map(lambda e, o: merge(o[0].graphdef, *o[1])
                        if isinstance(e, StateSharding) else o, out_specs, out, is_leaf=_is_entry)
