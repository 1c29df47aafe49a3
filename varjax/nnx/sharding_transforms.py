"""NNX's device transforms, ``shard_map`` and ``pmap``, and ``transform_metadata``, on
varjax's object mode.

``shard_map``/``pmap`` are ``jax.shard_map``/``jax.pmap`` of the function's functionalized
trace, as ``nnx.vmap`` is ``jax.vmap`` of it: a module argument's Variables are split
along its ``in_specs`` (``in_axes``) entry, each shard's reads and writes are
``var_get``/``var_set`` of the one trace, and a Variable's update comes back with its
module's spec (axis), so a module replicated with ``P()`` must be written the same on
every shard (``check_vma`` says so), one sharded along ``'data'`` comes back sharded.
A Variable made inside comes back with its module's spec; one the function returns, with
``out_specs``, where a ``StateSharding`` entry gives each filter of a returned module's state
its spec (``output_axes``: the module is split inside and merged outside, as in flax.nnx).

``transform_metadata`` is ``vj.transform_metadata`` (``varjax/objects/metadata.py``) with
NNX's signature: placed inside ``nnx.vmap``/``nnx.scan``, it adds the partition name to
the ``out_sharding`` of the Variables crossing it, at their axis.

An ``in_specs`` entry may be a ``StateSharding`` (an ``in_axes`` entry of ``pmap`` a
``StateAxes``), anywhere in the prefix (graph mode, with or without graph updates; tree mode
refuses it, as flax.nnx does): it is made the prefix tree of the part of the arguments under
it (``nnx.prefix`` by its filters), so each Variable is split by its filter's spec (axis).

As in the other ``varjax.nnx`` transforms, a structural change inside, or returning an
argument's object, is refused with ``NotProvidedError`` (``transform_checks``); options not
built (an argument holding an object in ``pmap``'s ``static_broadcasted_argnums`` or
``donate_argnums``) raise it by name.  A ``StateAxes`` in ``pmap``'s ``out_axes`` is
``nnx.vmap``'s (``output_axes``).
``pmap``'s ``static_broadcasted_argnums``, ``backend`` and ``donate_argnums`` are
``jax.pmap``'s, and its ``transform_metadata`` is ``nnx.vmap``'s (``metadata_option``).
"""
from __future__ import annotations

import functools
from collections.abc import Set as AbstractSet
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from varjax.ir.typing import AxesPrefix, AxisName, ShardingLike
from varjax.nnx import output_axes
from varjax.nnx.config import resolve
from varjax.nnx.filter_maps import FilterMap, StateSharding
from varjax.nnx.metadata_option import with_partition
from varjax.nnx.prefixes import prefix
from varjax.nnx.state_axes import StateAxes
from varjax.nnx.transform_checks import (
    as_decorator,
    checked,
    no_argument_returned,
    objects_in,
    positional,
    refuse_bound_method,
)
from varjax.objects import metadata
from varjax.objects import object_transforms as objects
from varjax.objects.run import Result, arg_names
from varjax.trace.unprovided import not_provided

__all__ = ["shard_map", "pmap", "transform_metadata", "StateSharding"]


def _plain_prefix(what: str, name: str, prefix: Any, leaf: type, label: str,
                  by_filter: type | None = None, graph: bool = True) -> None:
    """``NotProvidedError`` for a prefix entry other than a ``leaf``, None or (anywhere in
    the prefix, where ``by_filter`` is given) a ``by_filter`` map; flax.nnx's ``ValueError``
    for a ``by_filter`` map in tree mode (``graph`` False)."""
    for entry in jax.tree.leaves(prefix, is_leaf=lambda x: isinstance(x, (leaf, FilterMap))):
        if by_filter is not None and isinstance(entry, by_filter):
            if not graph:
                raise ValueError(f"`{name}` cannot contain `{by_filter.__name__}` objects when "
                                 "`graph=False`: split the module (nnx.split(model, filter, "
                                 "...)) and pass the states with their own entries, or pass "
                                 "graph=True.")
            continue
        if not isinstance(entry, leaf) or isinstance(entry, bool):
            not_provided(f"nnx.{what}({name}=... {type(entry).__name__} ...)",
                         f"an {name} entry other than a {label}, None"
                         + (f" or a {by_filter.__name__}" if by_filter else "")
                         + " is not built yet.",
                         f"give a {label} or None per argument in {name}; to treat "
                         "part of a module's state apart, split it (nnx.split) and pass the "
                         "states with their own entries", by="varjax.nnx")


def _mapped(fn: Callable, what: str, prefix_of: Callable[[tuple], Any], unmapped: Any,
            make: Callable[[Callable, Result, Any], Callable]) -> Callable:
    """``fn`` under a mapping JAX transform (``make(pure, result_prefix, prefix)``): each
    Variable's update, and each Variable made under a module, comes back along its module's
    entry of the call's prefix (``prefix_of(args)``); what a ``capture`` collected, along
    ``unmapped``."""
    refuse_bound_method(fn, what)
    pure = objects._Pure(checked(fn, what, no_argument_returned), arg_names(fn))

    def call(*args: Any, **kwargs: Any) -> Any:
        prefix = prefix_of(args)
        graph = pure.originals(args, kwargs)
        nodes = objects._node_axes(prefix, args, kwargs, graph, f"nnx.{what}")
        cells = objects._cell_axes(graph, nodes, f"nnx.{what}")
        result = Result(cells, nodes, unmapped)
        out, result = pure.get(graph, lambda p: make(p, result, prefix),
                               (tuple(cells),))(*args, **kwargs)
        graph.write_back(result.updates, result.created)
        return out
    return objects.wrapper(fn, call)


def _by_filters(given: Any, leaf: type) -> Callable[[tuple], Any]:
    """The call's prefix (``in_specs``/``in_axes``): each ``FilterMap`` entry
    (``StateSharding``, ``StateAxes``), wherever it is, made the prefix tree of the part of
    the arguments under it (``nnx.prefix`` by its filters), a JAX prefix the transform
    takes."""
    entries = tuple(given) if isinstance(given, list) else given
    if not any(isinstance(e, FilterMap) for e in jax.tree.leaves(
            entries, is_leaf=lambda x: isinstance(x, (leaf, FilterMap)))):
        return lambda args: entries

    def of(args: tuple) -> Any:
        per_arg = entries if isinstance(entries, tuple) else (entries,) * len(args)
        return jax.tree.map(lambda e, a: prefix(a, e.map_prefix) if isinstance(e, FilterMap)
                            else e, per_arg, args,
                            is_leaf=lambda x: x is None or isinstance(x, (leaf, FilterMap)))
    return of


def shard_map(f: Callable | None = None, *, mesh: Mesh | AbstractMesh, in_specs: ShardingLike,
              out_specs: ShardingLike, axis_names: AbstractSet[AxisName] = frozenset(),
              check_vma: bool = True, graph: bool | None = None,
              graph_updates: bool | None = None) -> Callable[..., Any]:
    """``jax.shard_map`` over NNX objects: a module argument's Variables are split by its
    ``in_specs`` entry (``P()``: replicated; a ``StateSharding``: a spec per filter of its
    state) and their updates come back with it."""
    for name, specs in (("in_specs", in_specs), ("out_specs", out_specs)):
        _plain_prefix("shard_map", name, specs, PartitionSpec, "PartitionSpec", StateSharding,
                      resolve(graph)[0])

    split_specs = output_axes.out_prefix(out_specs, StateSharding, PartitionSpec())

    def build(fn: Callable) -> Callable:
        def make(p: Callable, result: Result, specs: Any) -> Callable:
            return jax.shard_map(p, mesh=mesh, in_specs=specs, out_specs=(split_specs, result),
                                 axis_names=axis_names, check_vma=check_vma)

        def positional_only(*args: Any) -> Any:
            return output_axes.joined(out_specs, mapped(*args), args, StateSharding)
        refuse_bound_method(fn, "shard_map")
        mapped = _mapped(output_axes.split_outputs(fn, out_specs, False, StateSharding),
                         "shard_map",
                         _by_filters(in_specs, PartitionSpec),
                         PartitionSpec(), make)
        return functools.wraps(fn)(positional_only)
    return as_decorator(f, build)


def _argnums(given: int | Iterable[int]) -> tuple[int, ...]:
    return (given,) if isinstance(given, int) else tuple(given)


def _no_objects_at(what: str, option: str, nums: tuple[int, ...], args: tuple, why: str,
                   fix: str) -> None:
    """``NotProvidedError`` when an argument at ``nums`` holds an NNX object."""
    for i in nums:
        if i < len(args) and objects_in(args[i]):
            not_provided(f"nnx.{what}({option}=...) for an argument holding an object "
                         f"(argument {i}, a {type(args[i]).__name__})", why, fix,
                         by="varjax.nnx")


def pmap(f: Callable | None = None, *, axis_name: AxisName | None = None,
         in_axes: AxesPrefix = 0, out_axes: AxesPrefix = 0,
         static_broadcasted_argnums: int | Iterable[int] = (),
         devices: Sequence[jax.Device] | None = None, backend: str | None = None,
         axis_size: int | None = None, donate_argnums: int | Iterable[int] = (),
         transform_metadata: Mapping[str, Any] | None = None, graph: bool | None = None,
         graph_updates: bool | None = None) -> Callable[..., Any]:
    """``jax.pmap`` over NNX objects: a module argument's Variables are mapped over devices
    along its ``in_axes`` entry (``None``: broadcast) and their updates come back stacked
    along it (a ``StateAxes`` entry: each filter's Variables along its axis; in
    ``out_axes``, a module made inside, as ``nnx.vmap``'s: ``output_axes``); keyword
    arguments are mapped along axis 0, as ``jax.pmap`` maps them.
    ``static_broadcasted_argnums``, ``backend`` and ``donate_argnums`` are ``jax.pmap``'s,
    for arguments that hold no object (a module's Variables not written inside would keep
    donated buffers: varjax writes back only the updates); ``transform_metadata`` as
    ``nnx.vmap``'s (``metadata_option``)."""
    static, donated = _argnums(static_broadcasted_argnums), _argnums(donate_argnums)
    _plain_prefix("pmap", "in_axes", in_axes, int, "int", StateAxes, resolve(graph)[0])
    _plain_prefix("pmap", "out_axes", out_axes, int, "int", StateAxes, resolve(graph)[0])
    axes_of = _by_filters(in_axes, int)
    stacked = output_axes.out_prefix(out_axes)

    def build(fn: Callable) -> Callable:
        def make(p: Callable, result: Result, in_axes: Any) -> Callable:
            return jax.pmap(p, axis_name=axis_name, in_axes=in_axes,
                            out_axes=(stacked, result), static_broadcasted_argnums=static,
                            devices=devices, backend=backend, axis_size=axis_size,
                            donate_argnums=donated)

        def prefix_of(args: tuple) -> Any:
            _no_objects_at("pmap", "static_broadcasted_argnums", static, args,
                           "a static argument is hashed, and its Variables would not be "
                           "traced.", "pass the module as a mapped or broadcast (None) "
                           "argument")
            _no_objects_at("pmap", "donate_argnums", donated, args,
                           "varjax.nnx writes back only the Variables written inside, so "
                           "the others would keep donated (deleted) buffers.",
                           "donate array arguments only")
            return axes_of(args)
        refuse_bound_method(fn, "pmap")
        named = with_partition("pmap", output_axes.split_outputs(fn, out_axes, False), transform_metadata,
                               in_axes, stacked)
        mapped = _mapped(named, "pmap", prefix_of, 0, make)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return output_axes.joined(out_axes, mapped(*args, **kwargs), args)
        return call
    return as_decorator(f, build)


def transform_metadata(f: Callable | None = None, *, in_axes: AxesPrefix = 0,
                       out_axes: AxesPrefix = 0, partition: str | None,
                       graph: bool | None = None) -> Callable[..., Any]:
    """Inside ``nnx.vmap``/``nnx.scan`` (with the same axes): ``partition`` is removed from
    the ``out_sharding`` of the arguments' Variables at their axis while ``f`` runs, put
    back after, and added to the returned Variables' at ``out_axes``."""
    def build(fn: Callable) -> Callable:
        adjusted = metadata.transform_metadata(fn, in_axes=in_axes, out_axes=out_axes,
                                               partition=partition)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return adjusted(*positional(fn, args, kwargs))
        return call
    return as_decorator(f, build)
