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

With graph updates (the default) both carry NNX's graph updates as ``nnx.jit`` does
(``graph_updates``): an argument's object the function returns is the caller's own, and a
structural change to an argument's module (a ``sow``, a new, removed or changed attribute)
reaches the caller's module, its new arrays and Variables coming out with the module's own
entry (``P()``: once; ``P('data')``/an axis: sharded or stacked), as flax.nnx gives the
arguments back with their ``in_specs``/``in_axes``.  JAX takes the output prefix before the
function runs, so the changes come out as one entry per argument object (``per_object``),
whose prefix is known then.  Without graph updates a structural change or an argument's
Variable returned is refused, as in ``nnx.jit``.  A change to a module whose entry is split
by filters (a ``StateSharding``/``StateAxes``) is ``NotProvidedError``.

A ``StateAxes`` in ``pmap``'s ``out_axes`` is ``nnx.vmap``'s (``output_axes``).
``pmap``'s ``static_broadcasted_argnums``, ``backend`` and ``donate_argnums`` are
``jax.pmap``'s (a donated module's Variables all come back; an object in a static argument
is flax.nnx's ``ValueError``), and its ``transform_metadata`` is ``nnx.vmap``'s
(``metadata_option``).
"""
from __future__ import annotations

import functools
from collections.abc import Set as AbstractSet
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from varjax.ir import errors
from varjax.ir.typing import AxesPrefix, AxisName, ShardingLike
from varjax.nnx import output_axes
from varjax.nnx.config import resolve
from varjax.nnx.filter_maps import FilterMap, StateSharding
from varjax.nnx.graph_updates import (
    carrying,
    entries_of_objects,
    finish,
    gathered,
    objects_with_paths,
    per_object,
)
from varjax.nnx.metadata_option import with_partition
from varjax.nnx.prefixes import prefix
from varjax.nnx.state_axes import StateAxes
from varjax.nnx.transform_checks import (
    as_decorator,
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


_BY_FILTER = object()    # an object whose entry is split by filters (a StateSharding's)


def _object_entries(prefix: Any, args: tuple, kwargs: dict, at_keyword: Any) -> tuple:
    """Each argument object's entry of the call's prefix, in ``objects_with_paths`` order
    (keyword arguments' at ``at_keyword``): the entry covering it, or ``_BY_FILTER`` for a
    module whose Variables the prefix reaches one by one (``nnx.prefix`` of a
    ``StateSharding``/``StateAxes``).  A changed object's new children come out with it."""
    per_arg = tuple(prefix) if isinstance(prefix, (tuple, list)) else (prefix,) * len(args)
    found = entries_of_objects((per_arg, at_keyword), (args, kwargs))
    return tuple(found.get(id(x), _BY_FILTER)
                 for _, x in objects_with_paths({"args": args, "kwargs": kwargs}))


def _whole_changes_only(p: Callable, what: str, entries: tuple) -> Callable:
    """``p`` refusing, while tracing, a structural change to a module whose entry is split
    by filters: its new Variables would each need their filter's entry, and JAX takes the
    output prefix before the function runs."""
    by_filter = [i for i, e in enumerate(entries) if e is _BY_FILTER]
    if not by_filter:
        return p

    @functools.wraps(p)
    def checked(*args: Any, **kwargs: Any) -> Any:
        (out, per), result = p(*args, **kwargs)
        for i in by_filter:
            if per[0][i] is not None:
                not_provided(f"a structural change inside nnx.{what} to a module split by "
                             "filters",
                             "a module whose entry is a StateSharding/StateAxes gained, lost "
                             "or changed an attribute; its new Variables would need their "
                             "filter's entry, which JAX takes before the function runs.",
                             f"make the change outside nnx.{what}, or give the module one "
                             "entry", by="varjax.nnx")
        return (out, per), result
    return checked


def _mapped(fn: Callable, what: str, prefix_of: Callable[[tuple], Any], unmapped: Any,
            make: Callable[[Callable, Result, Any, tuple], Callable], modes: tuple[bool, bool],
            donated: tuple[int, ...] = ()) -> Callable:
    """``fn`` under a mapping JAX transform (``make(pure, result_prefix, prefix,
    changes_prefix)``): each Variable's update, and each Variable made under a module, comes
    back along its module's entry of the call's prefix (``prefix_of(args)``); what a
    ``capture`` collected, along ``unmapped``.  With graph updates, an argument's object
    returned is the caller's and a structural change reaches the caller's object
    (``graph_updates``), its new children along the object's entry (``changes_prefix``);
    ``donated`` arguments' Variables all come back (object mode's ``_donated``)."""
    refuse_bound_method(fn, what)
    pure = objects._Pure(per_object(carrying(fn, what, *modes)), arg_names(fn),
                         donated=donated)

    def call(*args: Any, **kwargs: Any) -> Any:
        prefix = prefix_of(args)
        graph = pure.originals(args, kwargs)
        nodes = objects._node_axes(prefix, args, kwargs, graph, f"nnx.{what}")
        cells = objects._cell_axes(graph, nodes, f"nnx.{what}")
        entries = graph.memo.get("object_entries")     # once per (kept) argument graph
        if entries is None:
            entries = graph.memo["object_entries"] = _object_entries(prefix, args, kwargs, 0)
        changes = (tuple(unmapped if e is _BY_FILTER else e for e in entries), unmapped)
        result = Result(cells, nodes, unmapped)
        (out, per), result = pure.get(
            graph, lambda p: make(_whole_changes_only(p, what, entries), result, prefix,
                                  changes),
            (tuple(cells), entries))(*args, **kwargs)
        graph.write_back(result.updates, result.created)
        return finish(args, kwargs, out, gathered(per))
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
    modes = resolve(graph, graph_updates)
    for name, specs in (("in_specs", in_specs), ("out_specs", out_specs)):
        _plain_prefix("shard_map", name, specs, PartitionSpec, "PartitionSpec", StateSharding,
                      modes[0])

    split_specs = output_axes.out_prefix(out_specs, StateSharding, PartitionSpec())

    def build(fn: Callable) -> Callable:
        def make(p: Callable, result: Result, specs: Any, changes: tuple) -> Callable:
            return jax.shard_map(p, mesh=mesh, in_specs=specs,
                                 out_specs=((split_specs, changes), result),
                                 axis_names=axis_names, check_vma=check_vma)

        def positional_only(*args: Any) -> Any:
            return output_axes.joined(out_specs, mapped(*args), args, StateSharding)
        refuse_bound_method(fn, "shard_map")
        mapped = _mapped(output_axes.split_outputs(fn, out_specs, modes[1], StateSharding),
                         "shard_map", _by_filters(in_specs, PartitionSpec), PartitionSpec(),
                         make, modes)
        return functools.wraps(fn)(positional_only)
    return as_decorator(f, build)


def _argnums(given: int | Iterable[int]) -> tuple[int, ...]:
    return (given,) if isinstance(given, int) else tuple(given)


def _no_static_objects(nums: tuple[int, ...], args: tuple) -> None:
    """An argument holding an NNX object at ``static_broadcasted_argnums`` is refused with
    the ``ValueError`` flax.nnx raises there (JAX's, for its non-hashable state): a static
    argument is hashed into the compiled function, so its Variables would not be traced."""
    for i in nums:
        found = objects_in(args[i]) if -len(args) <= i < len(args) else []
        if found:
            raise errors.ConfigError(
                f"nnx.pmap: argument {i}, in static_broadcasted_argnums, holds a "
                f"{type(found[0]).__name__}; a static "
                "argument is hashed into the compiled function, so its Variables would not be "
                "traced (flax.nnx refuses it too, as a non-hashable static argument).",
                **errors.where(), fix="pass the module as a mapped or broadcast (None) argument")


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
    ``static_broadcasted_argnums``, ``backend`` and ``donate_argnums`` are ``jax.pmap``'s: a
    donated module's Variables all come back, written or not, as in flax.nnx; a static
    argument may hold no object (flax.nnx's ``ValueError``).  ``transform_metadata`` as
    ``nnx.vmap``'s (``metadata_option``)."""
    static, donated = _argnums(static_broadcasted_argnums), _argnums(donate_argnums)
    modes = resolve(graph, graph_updates)
    _plain_prefix("pmap", "in_axes", in_axes, int, "int", StateAxes, modes[0])
    _plain_prefix("pmap", "out_axes", out_axes, int, "int", StateAxes, modes[0])
    axes_of = _by_filters(in_axes, int)
    stacked = output_axes.out_prefix(out_axes)

    def build(fn: Callable) -> Callable:
        def make(p: Callable, result: Result, in_axes: Any, changes: tuple) -> Callable:
            return jax.pmap(p, axis_name=axis_name, in_axes=in_axes,
                            out_axes=((stacked, changes), result),
                            static_broadcasted_argnums=static,
                            devices=devices, backend=backend, axis_size=axis_size,
                            donate_argnums=donated)

        def prefix_of(args: tuple) -> Any:
            _no_static_objects(static, args)
            return axes_of(args)
        refuse_bound_method(fn, "pmap")
        named = with_partition("pmap", output_axes.split_outputs(fn, out_axes, modes[1]),
                               transform_metadata, in_axes, stacked)
        mapped = _mapped(named, "pmap", prefix_of, 0, make, modes, donated)

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
