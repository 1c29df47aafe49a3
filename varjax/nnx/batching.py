"""NNX's ``vmap`` in graph mode, on varjax's object-mode ``vmap``.

A module is a pytree of Variables, so ``in_axes`` is JAX's prefix over the arguments: a
module at ``0`` has every Variable (and every ``Rngs`` key and count) mapped along axis 0,
at ``None`` broadcast.  Variable updates come back stacked along their module's axis;
Variables made inside come back stacked along ``out_axes``, so
``vmap(lambda rngs: Model(rngs))(rngs.fork(split=n))`` makes an ensemble, as in flax.nnx.
Keyword arguments are bound to their positions first, as flax.nnx binds them, so
``in_axes`` applies to them too.

With graph updates (the default) a structural change to an argument's module inside
reaches the caller's module, its new arrays and Variables stacked along axis 0, and an
argument's object the function returns is the caller's own (``graph_updates``); without
them only Variable values come back.

An argument's ``in_axes`` entry may be a ``StateAxes``, or hold some under tuples, dicts and
other containers (graph mode, with or without graph updates): each module at one is split into a state
per filter, each mapped along its axis, and merged again inside (``state_axes``).  An
``nnx.prefix`` tree (an NNX object of axes) holding a ``StateAxes`` (at a submodule, or a
Variable) is split the same way by path, the ``StateAxes`` matching the paths below its place
(``prefixes.with_prefix_axes``; beyond flax.nnx, which takes it in no mode).  An
``out_axes`` entry may be a ``StateAxes`` too, anywhere: a module made inside comes back with each state
stacked along its filter's axis, or once where it is ``None`` (``output_axes``).

``transform_metadata={nnx.PARTITION_NAME: name}`` adds the mapped axis's name to each
Variable's ``out_sharding`` as it leaves and removes it as it enters (``metadata_option``).

Not built, refused with ``NotProvidedError`` by name: ``transform_metadata`` keys other than
``PARTITION_NAME``.
``spmd_axis_name`` is ``jax.vmap``'s.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax

from varjax.ir import errors
from varjax.ir.typing import AxisName, Passes, Prefix
from varjax.nnx.config import resolve
from varjax.nnx.graph_updates import carrying, finish
from varjax.nnx.metadata_option import with_partition
from varjax.nnx.output_axes import joined, out_prefix, split_outputs
from varjax.nnx.prefixes import with_prefix_axes
from varjax.nnx.state_axes import (
    StateAxes,
    check_state_axes,
    gathered,
    merged,
    nests_state_axes,
    on_objects_only,
    split_by,
    spread,
    zeros,
)
from varjax.nnx.transform_checks import (
    as_decorator,
    positional,
    refuse_bound_method,
)
from varjax.objects import object_transforms as objects
from varjax.trace.unprovided import not_provided

__all__ = ["vmap"]


def _int_axes(name: str, axes: Any, graph: bool) -> None:
    """``in_axes``/``out_axes`` are a prefix of ints, Nones and ``StateAxes`` of those;
    anything else there is not built."""
    check_state_axes("vmap", name, axes, graph, (int, type(None)))
    for leaf in jax.tree.leaves(zeros(axes)):
        if not isinstance(leaf, int) or isinstance(leaf, bool):
            not_provided(f"nnx.vmap({name}={type(leaf).__name__}(...))",
                         f"an {name} entry other than an int, None or a StateAxes is not "
                         "built yet.", f"give ints, Nones or StateAxes in {name}",
                         by="varjax.nnx")


def vmap(f: Callable | None = None, *, in_axes: Prefix = 0, out_axes: Prefix = 0,
         axis_name: AxisName | None = None, axis_size: int | None = None,
         spmd_axis_name: AxisName | tuple[AxisName, ...] | None = None,
         transform_metadata: Mapping[str, Any] | None = None, graph: bool | None = None,
         graph_updates: bool | None = None, passes: Passes = ()) -> Callable[..., Any]:
    """``jax.vmap`` over NNX objects: a module argument's Variables are mapped along its
    ``in_axes`` entry (``None``: broadcast), and their updates come back to it.
    ``transform_metadata={nnx.PARTITION_NAME: name}`` takes ``name`` out of the arguments'
    Variables' ``out_sharding`` at their axis inside and adds it to the returned ones' at
    ``out_axes`` (``metadata_option``).  ``passes`` (beyond flax.nnx, as ``nnx.jit``'s) run
    on the body's IR, once, before JAX batches it."""
    modes = resolve(graph, graph_updates)
    if isinstance(in_axes, StateAxes):
        raise errors.TransformError(
            "nnx.vmap: in_axes is a StateAxes; in_axes is a prefix of the arguments' tuple, "
            "so a StateAxes is one argument's entry.", **errors.where(),
            fix="in_axes=(state_axes, ...), one entry per argument")
    _int_axes("in_axes", in_axes, modes[0])
    _int_axes("out_axes", out_axes, modes[0])
    given_in_axes, in_axes = in_axes, with_prefix_axes(in_axes)
    by_state = isinstance(in_axes, (tuple, list)) and nests_state_axes(in_axes)
    stacked = out_prefix(out_axes)

    def build(fn: Callable) -> Callable:
        refuse_bound_method(fn, "vmap")
        named = with_partition("vmap", split_outputs(fn, out_axes, modes[1]), transform_metadata,
                               given_in_axes, stacked)
        mapped = None if by_state else objects.vmap(
            carrying(named, "vmap", *modes), in_axes=in_axes, out_axes=(stacked, 0),
            axis_size=axis_size, axis_name=axis_name, spmd_axis_name=spmd_axis_name,
            passes=passes)
        made: dict[tuple, Callable] = {}     # per layout and GraphDefs of the split arguments

        def by_states(args: tuple) -> Any:
            parts, part_axes, layout = spread("vmap", args, tuple(in_axes))
            on_objects_only("vmap", parts, part_axes)
            given, axes, defs = split_by(parts, part_axes)
            key = (layout, tuple(sorted(defs.items())))
            found = made.get(key)
            if found is None:
                carried = carrying(named, "vmap", *modes)
                found = made[key] = objects.vmap(
                    lambda *a: carried(*gathered(layout, merged(defs, a))), in_axes=axes,
                    out_axes=(stacked, 0), axis_size=axis_size, axis_name=axis_name,
                    spmd_axis_name=spmd_axis_name, passes=passes)
            return found(*given)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            args = positional(fn, args, kwargs)
            out = finish(args, {}, *(by_states(args) if by_state else mapped(*args)))
            return joined(out_axes, out, args)
        return call
    return as_decorator(f, build)
