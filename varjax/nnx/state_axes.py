"""``nnx.StateAxes``: an ``in_axes`` entry giving a module's state an axis per filter.

flax.nnx's graph mode lets ``vmap`` map part of a module and broadcast the rest:
``in_axes=(nnx.StateAxes({nnx.Param: 0, ...: None}), 0)``.  It is the Tree Mode note's
"Prefix filters" rewrite, done for the user: the module is ``split`` into one state per
filter, each state is passed with its axis, and inside the function ``merge`` makes the
module again from the states (their Variables, so their updates come back to the caller's).
``split_by`` and ``merged`` are those two halves; the transform keeps one traced function per
``GraphDef``s (``split`` gives equal ones for an unchanged structure).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from varjax.nnx.filter_maps import FilterMap
from varjax.nnx.graph import merge, split
from varjax.nnx.transform_checks import objects_in
from varjax.trace.unprovided import not_provided
from varjax.trace.variable import Variable

__all__ = ["StateAxes"]


class StateAxes(FilterMap):
    """Per filter of a module's state, the axis its Variables are mapped along (``None``:
    broadcast; in ``nnx.scan`` also ``nnx.Carry``): ``StateAxes({nnx.Param: 0, ...: None})``;
    the first filter that matches a Variable gives its axis, and every Variable must match
    one."""

    _name = "StateAxes"

    @property
    def axes(self) -> tuple[int | None | type, ...]:
        return self._values


def split_by(args: tuple, in_axes: tuple) -> tuple[tuple, tuple, dict[int, Any]]:
    """``args`` with each argument at a ``StateAxes`` entry split into its states (a tuple,
    one per filter), the ``in_axes`` for them (the axes, a tuple), and the ``GraphDef`` of
    each split argument by position."""
    given, axes, defs = list(args), list(in_axes), {}
    for i, entry in enumerate(in_axes):
        if isinstance(entry, StateAxes):
            defs[i], *states = split(args[i], *entry.filters)
            given[i], axes[i] = tuple(states), entry.axes
    return tuple(given), tuple(axes), defs


def merged(defs: Mapping[int, Any], args: tuple) -> tuple:
    """``args`` with each split argument made a module again from its states."""
    return tuple(merge(defs[i], *a) if i in defs else a for i, a in enumerate(args))


def _entries(axes: Any) -> list[tuple[Any, Any]]:
    """``(path, entry)`` of a prefix of axes, a ``StateAxes`` one entry."""
    return jax.tree_util.tree_leaves_with_path(
        axes, is_leaf=lambda x: x is None or isinstance(x, StateAxes))


def check_state_axes(what: str, name: str, axes: Any, graph: bool, allowed: tuple) -> None:
    """The ``StateAxes`` entries of ``name`` (``in_axes``/``out_axes`` of ``nnx.<what>``) as
    flax.nnx allows them: in graph mode only (tree mode is flax's ``ValueError``), each axis
    of an ``allowed`` type; one per argument (or output), not nested in a prefix (not built
    here: ``NotProvidedError``)."""
    for path, entry in _entries(axes):
        if not isinstance(entry, StateAxes):
            continue
        if not graph:
            raise ValueError(f"`{name}` cannot contain `StateAxes` objects when `graph=False`: "
                             "split the module (nnx.split(model, filter, ...)) and pass the "
                             "states with their own axes, or pass graph=True.")
        if len(path) > isinstance(axes, tuple):
            not_provided(f"nnx.{what}({name}=...) with a StateAxes nested in a prefix",
                         "a StateAxes is built as a whole argument's (or output's) entry.",
                         f"give the module its own entry in {name}", by="varjax.nnx")
        for f, axis in entry.items():
            if not isinstance(axis, allowed) or isinstance(axis, bool):
                raise ValueError(f"Invalid axes {axis} for filter {f} at "
                                 f"{name}{jax.tree_util.keystr(path)}")


def on_objects_only(what: str, args: tuple, axes: tuple) -> None:
    """flax.nnx's ``ValueError`` for a ``StateAxes`` entry of an argument holding no NNX
    object: it has no state to split."""
    for i, (a, entry) in enumerate(zip(args, axes)):
        if isinstance(entry, StateAxes) and not objects_in(a):
            raise ValueError(f"Cannot use StateAxes on non-graph nodes, found {entry} "
                             f"args[{i}] of nnx.{what}")


def zeros(axes: Any) -> Any:
    """``axes`` with each ``StateAxes`` entry ``0``: what the transform stacks along before
    ``restacked`` moves each state's Variables to its own axis."""
    return jax.tree.map(lambda e: 0 if isinstance(e, StateAxes) else e, axes,
                        is_leaf=lambda x: x is None or isinstance(x, StateAxes))


def restacked(out: Any, axes: Any) -> Any:
    """``out`` (stacked along 0 at ``StateAxes`` entries) with each state of an object there
    stacked along its filter's axis instead: its Variables' values get that axis moved from
    0 (they are the output's new Variables, made by the transform)."""
    entries = axes if isinstance(axes, tuple) else (axes,)
    outs = out if isinstance(axes, tuple) else (out,)
    for entry, sub in zip(entries, outs):
        if not isinstance(entry, StateAxes):
            continue
        _, *states = split(sub, *entry.filters)
        for state, axis in zip(states, entry.axes):
            if axis != 0:
                for v in jax.tree.leaves(state, is_leaf=_is_variable):
                    v.value = jax.tree.map(lambda x: jnp.moveaxis(x, 0, axis), v.value)
    return out


def _is_variable(x: Any) -> bool:
    return isinstance(x, Variable)
