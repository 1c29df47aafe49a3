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

An argument's ``in_axes`` entry may be a ``StateAxes`` (graph mode, with or without graph
updates): the module is split into a state per filter, each mapped along its axis, and
merged again inside (``state_axes``).

Not built, refused with ``NotProvidedError`` by name: ``StateAxes`` in ``out_axes`` or
nested in an argument's prefix, ``transform_metadata``, ``spmd_axis_name``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax

from varjax.nnx.config import resolve
from varjax.nnx.graph_updates import carrying, finish
from varjax.nnx.state_axes import StateAxes, merged, split_by
from varjax.nnx.transform_checks import (
    as_decorator,
    positional,
    refuse_bound_method,
    refuse_options,
)
from varjax.objects import object_transforms as objects
from varjax.trace.unprovided import not_provided

__all__ = ["vmap"]


def _int_axes(name: str, axes: Any) -> None:
    """``in_axes``/``out_axes`` are a prefix of ints and Nones (``StateAxes`` entries, of
    ints and Nones, only per argument of ``in_axes``); anything else there is not built."""
    if name == "in_axes" and isinstance(axes, tuple):
        axes = tuple(a.axes if isinstance(a, StateAxes) else a for a in axes)
    for leaf in jax.tree.leaves(axes):
        if not isinstance(leaf, int) or isinstance(leaf, bool):
            not_provided(f"nnx.vmap({name}={type(leaf).__name__}(...))",
                         f"an {name} entry other than an int, None or (per argument of "
                         "in_axes) a StateAxes is not built yet.",
                         f"give an int or None per argument in {name}; to map part of a "
                         "module's state, split it (nnx.split) and pass the states with "
                         "their own axes", by="varjax.nnx")


def vmap(f: Callable | None = None, *, in_axes: Any = 0, out_axes: Any = 0,
         axis_name: Any = None, axis_size: int | None = None, spmd_axis_name: Any = None,
         transform_metadata: Mapping[str, Any] | None = None, graph: bool | None = None,
         graph_updates: bool | None = None) -> Any:
    """``jax.vmap`` over NNX objects: a module argument's Variables are mapped along its
    ``in_axes`` entry (``None``: broadcast), and their updates come back to it."""
    refuse_options("vmap", spmd_axis_name=(spmd_axis_name, None))
    modes = resolve(graph, graph_updates)
    by_state = isinstance(in_axes, tuple) and any(isinstance(a, StateAxes) for a in in_axes)
    if by_state and not modes[0]:
        raise ValueError("`in_axes` cannot contain `StateAxes` objects when `graph=False`: "
                         "split the module (nnx.split(model, filter, ...)) and pass the "
                         "states with their own axes, or pass graph=True.")
    if transform_metadata:
        not_provided("nnx.vmap(transform_metadata=...)", "this option is not built yet.",
                     "call nnx.vmap without transform_metadata", by="varjax.nnx")
    _int_axes("in_axes", in_axes)
    _int_axes("out_axes", out_axes)

    def build(fn: Callable) -> Callable:
        refuse_bound_method(fn, "vmap")
        mapped = None if by_state else objects.vmap(
            carrying(fn, "vmap", *modes), in_axes=in_axes, out_axes=(out_axes, 0),
            axis_size=axis_size, axis_name=axis_name)
        made: dict[tuple, Callable] = {}     # per GraphDefs of the split arguments

        def by_states(args: tuple) -> Any:
            given, axes, defs = split_by(args, in_axes)
            key = tuple(sorted(defs.items()))
            found = made.get(key)
            if found is None:
                carried = carrying(fn, "vmap", *modes)
                found = made[key] = objects.vmap(
                    lambda *a: carried(*merged(defs, a)), in_axes=axes,
                    out_axes=(out_axes, 0), axis_size=axis_size, axis_name=axis_name)
            return found(*given)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            args = positional(fn, args, kwargs)
            return finish(args, {}, *(by_states(args) if by_state else mapped(*args)))
        return call
    return as_decorator(f, build)
