"""``nnx.StateAxes``: an ``in_axes`` entry giving a module's state an axis per filter.

flax.nnx's graph mode lets ``vmap`` map part of a module and broadcast the rest:
``in_axes=(nnx.StateAxes({nnx.Param: 0, ...: None}), 0)``.  It is the Tree Mode note's
"Prefix filters" rewrite, done for the user: the module is ``split`` into one state per
filter, each state is passed with its axis, and inside the function ``merge`` makes the
module again from the states (their Variables, so their updates come back to the caller's).
``split_by`` and ``merged`` are those two halves; the transform keeps one traced function per
``GraphDef``s (``split`` gives equal ones for an unchanged structure).

A ``StateAxes`` may also sit inside an argument's entry, under tuples, dicts and the like:
``in_axes=((state_axes, 0), None)`` for ``f((model, x), y)``.  flax.nnx splits each node at a
``StateAxes`` wherever it is, exactly as a whole argument's; so here ``spread`` makes such an
argument one argument per leaf of its entry (the part under it), every ``StateAxes`` then a
whole argument's entry, and ``gathered`` puts the parts back together inside.  One inside an
NNX object of the prefix (an ``nnx.prefix`` tree whose leaf, or a module-shaped prefix whose
submodule entry, is a ``StateAxes``) gives the part under it an axis per filter, its paths
below that place (``prefixes.axes_by_path``); flax.nnx takes it in no mode.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from varjax.ir.typing import Prefix
from varjax.nnx.filter_maps import FilterMap
from varjax.nnx.graph import merge, split
from varjax.nnx.pytree import Pytree
from varjax.nnx.transform_checks import objects_in
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


def nests_state_axes(axes: Prefix) -> bool:
    """Whether a ``StateAxes`` is anywhere in ``axes``."""
    return any(isinstance(e, StateAxes) for _, e in _entries(axes))


def _spread_leaf(x: Any) -> bool:
    """An entry ``spread`` does not go into: ``None``, a ``StateAxes``, or an NNX object (an
    ``nnx.prefix`` tree, its argument's entry as it is)."""
    return x is None or isinstance(x, (StateAxes, Pytree))


def spread(what: str, args: tuple, axes: tuple) -> tuple[tuple, tuple, tuple]:
    """``args`` (one ``axes`` entry each) with each argument whose entry holds a ``StateAxes``
    under containers (tuples, dicts, any pytree but an NNX object) made one argument per leaf
    of that entry (the part of the
    argument under it, as JAX matches a prefix), and the leaves as their entries; with the
    ``layout`` (hashable) that ``gathered`` puts the arguments back together by."""
    if len(axes) != len(args):
        raise ValueError(f"nnx.{what}: in_axes has {len(axes)} entries and the function "
                         f"was given {len(args)} arguments.")
    given, entries, layout = [], [], []
    for a, entry in zip(args, axes):
        if isinstance(entry, StateAxes) or not nests_state_axes(entry):
            given.append(a)
            entries.append(entry)
            layout.append(None)
            continue
        leaves, treedef = jax.tree.flatten(entry, is_leaf=_spread_leaf)
        given.extend(treedef.flatten_up_to(a))
        entries.extend(leaves)
        layout.append(treedef)
    return tuple(given), tuple(entries), tuple(layout)


def gathered(layout: tuple, args: tuple) -> tuple:
    """The arguments ``spread`` gave ``layout`` for, from their parts ``args``."""
    out, k = [], 0
    for treedef in layout:
        n = 1 if treedef is None else treedef.num_leaves
        out.append(args[k] if treedef is None else treedef.unflatten(args[k:k + n]))
        k += n
    return tuple(out)


def _entries(axes: Any) -> list[tuple[Any, Any]]:
    """``(path, entry)`` of a prefix of axes, a ``StateAxes`` one entry."""
    return jax.tree_util.tree_leaves_with_path(axes, is_leaf=_is_entry)


def check_state_axes(what: str, name: str, axes: Any, graph: bool, allowed: tuple) -> None:
    """The ``StateAxes`` entries of ``name`` (``in_axes``/``out_axes`` of ``nnx.<what>``),
    anywhere in it, as flax.nnx allows them: in graph mode only (tree mode is flax's
    ``ValueError``), each axis of an ``allowed`` type."""
    for path, entry in _entries(axes):
        if not isinstance(entry, StateAxes):
            continue
        if not graph:
            raise ValueError(f"`{name}` cannot contain `StateAxes` objects when `graph=False`: "
                             "split the module (nnx.split(model, filter, ...)) and pass the "
                             "states with their own axes, or pass graph=True.")
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
                        is_leaf=_is_entry)


def restacked(out: Any, axes: Any) -> Any:
    """``out`` (stacked along 0 at ``StateAxes`` entries, wherever they are in ``axes``) with
    each state of an object there stacked along its filter's axis instead: its Variables'
    values get that axis moved from 0 (they are the output's new Variables, made by the
    transform)."""
    entries, treedef = jax.tree.flatten(axes, is_leaf=_is_entry)
    for entry, sub in zip(entries, treedef.flatten_up_to(out)):
        if not isinstance(entry, StateAxes):
            continue
        _, *states = split(sub, *entry.filters)
        for state, axis in zip(states, entry.axes):
            if axis != 0:
                for v in jax.tree.leaves(state, is_leaf=_is_variable):
                    v.value = jax.tree.map(lambda x: jnp.moveaxis(x, 0, axis), v.value)
    return out


def _is_entry(x: Any) -> bool:
    return x is None or isinstance(x, StateAxes)


def _is_variable(x: Any) -> bool:
    return isinstance(x, Variable)
