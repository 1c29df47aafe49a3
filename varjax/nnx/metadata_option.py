"""The ``transform_metadata`` option of ``nnx.vmap``, ``nnx.pmap`` and ``nnx.scan``.

``transform_metadata={nnx.PARTITION_NAME: 'layers'}`` is flax.nnx's shorthand for placing
``nnx.transform_metadata(in_axes=..., out_axes=..., partition='layers')`` inside the
transform, with the transform's own axes: each argument Variable's ``out_sharding`` loses
the partition name at its mapped axis while the function runs (it sees one member's
shape) and gets it back after; each Variable it returns gets it at its ``out_axes`` entry.
So this is ``vj.transform_metadata`` (``varjax/objects/metadata.py``) wrapped around the
function, a loop's ``nnx.Carry`` entries (not mapped) treated as ``None``.

As in flax.nnx, a mapping without ``PARTITION_NAME`` changes nothing.  With it, each other
key's value is put in (and taken out) at the axis of each Variable's metadata entry of that
name that is a tuple (``extra=('x', 'y')`` becomes ``('L', 'x', 'y')``), and a Variable's
``on_remove_axis``/``on_add_axis`` hooks run once per Variable and crossing
(``vj.transform_metadata``'s ``names`` and ``add_axis``).  An argument's
``StateAxes`` entry, or one nested in its entry, gives each of its Variables its filter's
axis (``nnx.prefix``);
``nnx.vmap`` hands its outputs here already split by their ``StateAxes`` (``output_axes``),
and one in ``nnx.scan``'s ``out_axes`` is refused by name.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax

from varjax.ir.axis_metadata import PARTITION_NAME
from varjax.nnx.prefixes import prefix
from varjax.nnx.state_axes import StateAxes
from varjax.objects import metadata
from varjax.trace.unprovided import not_provided


def _is_entry(x: Any) -> bool:
    return x is None or isinstance(x, StateAxes)


def _plain(what: str, axes: Any, not_mapped: Callable[[Any], bool], name: str) -> Any:
    """``axes`` with each entry ``not_mapped`` says is no axis (``nnx.Carry``) made None; a
    ``StateAxes`` entry is kept for ``in_axes`` (``_by_variable``) and refused in
    ``out_axes``."""
    def entry(x: Any) -> Any:
        if isinstance(x, StateAxes):
            if name == "in_axes":
                return x
            not_provided(f"nnx.{what}(transform_metadata=...) with a StateAxes in out_axes",
                         "the partition name is added to outputs at int axes only.",
                         "give the outputs int axes, or place nnx.transform_metadata(...) "
                         "inside the transform", by="varjax.nnx")
        return None if not_mapped(x) else x
    return jax.tree.map(entry, axes, is_leaf=lambda x: _is_entry(x) or not_mapped(x))


def _by_variable(axes: tuple, args: tuple, not_mapped: Callable[[Any], bool]) -> tuple:
    """``axes`` (one entry per argument) with each ``StateAxes`` made the prefix tree of the
    argument under it (``nnx.prefix`` by its filters), each Variable at its filter's axis
    (``nnx.Carry``: None)."""
    def entry(e: Any, a: Any) -> Any:
        if not isinstance(e, StateAxes):
            return e
        return jax.tree.map(lambda x: None if not_mapped(x) else x, prefix(a, e.map_prefix),
                            is_leaf=lambda x: x is None or not_mapped(x))
    return jax.tree.map(entry, axes, args, is_leaf=_is_entry)


def with_partition(what: str, fn: Callable, transform_metadata: Mapping[str, Any] | None,
                   in_axes: Any, out_axes: Any,
                   not_mapped: Callable[[Any], bool] = lambda x: False) -> Callable:
    """``fn`` with the names of ``transform_metadata`` removed from its arguments'
    Variables at ``in_axes`` and added to its outputs' at ``out_axes`` (the module
    docstring); ``fn`` itself where the mapping has no ``PARTITION_NAME``."""
    if not transform_metadata or PARTITION_NAME not in transform_metadata:
        return fn
    name = transform_metadata[PARTITION_NAME]
    others = {k: v for k, v in transform_metadata.items() if k != PARTITION_NAME}
    ins = _plain(what, in_axes, not_mapped, "in_axes")
    outs = _plain(what, out_axes, not_mapped, "out_axes")

    @functools.wraps(fn)
    def named(*args: Any, **kwargs: Any) -> Any:
        """Keyword arguments (``nnx.pmap`` maps them along axis 0) are passed after the
        positional ones, at axis 0."""
        n, keys = len(args), tuple(kwargs)
        axes = (tuple(ins) if isinstance(ins, (tuple, list)) else (ins,) * n) + (0,) * len(keys)
        axes = _by_variable(axes, args + tuple(kwargs.values()), not_mapped)
        adjusted = metadata.transform_metadata(
            lambda *a: fn(*a[:n], **dict(zip(keys, a[n:]))), in_axes=axes, out_axes=outs,
            partition=name, names=others)
        return adjusted(*args, *kwargs.values())
    return named
