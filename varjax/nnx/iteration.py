"""NNX's ``scan`` (and its ``Carry`` marker) in graph mode, on varjax's object-mode ``scan``.

``nnx.scan`` describes each positional argument by an ``in_axes`` entry: ``Carry`` (at most
one, the loop carry), an int (the axis it is scanned along), ``None`` (the same every step)
or a ``StateAxes`` giving each state of a module one of those (also inside tuples, dicts and
other containers of an argument's entry: ``state_axes.spread`` makes each part there an argument of its
own); ``out_axes`` says the same of what the function returns.  That desugars onto
``vj.scan``'s ``(carry, xs) -> (carry, ys)`` as flax.nnx's own graph-mode scan does:

* a ``StateAxes`` argument is split into one state per filter (``state_axes.split_by``),
  each state a part with its own axis, and merged again inside every step;
* the carry is the ``Carry`` argument, the states at ``Carry`` (their updates carried from
  step to step and kept) and the broadcast (``None``) parts.  With graph updates a
  broadcast object's Variables get their values back at the end of every step, so each
  step sees the values it was given and none of its updates is kept (an RNG stream there
  draws the same key every step: recurrent dropout's one mask); without them a broadcast
  argument's updates are carried and kept, as flax.nnx's tree-style scan keeps them, while
  a ``StateAxes`` state at ``None`` keeps its meaning (flax.nnx refuses ``StateAxes`` there);
* the scanned parts, their axis moved to 0, are the ``xs``: a stack of layers made with
  ``nnx.vmap`` is applied one layer per step, and its Variables' updates come back stacked;
* the outputs at int axes are the ``ys``, stacked along that axis; a module made inside and
  returned at a ``StateAxes`` entry has each state stacked along its filter's axis.

The carry returned holds the caller's objects (their Variables hold the final values), as in
flax.nnx, when the function returns each carry object in the place it came in (without graph
updates, new objects holding the caller's Variables, as flax.nnx returns them then); one
that returns them in other places is refused with ``CarryIdentityError`` (a ``ValueError``,
as flax.nnx's; ``carry_moves``); a structural change inside is a ``TransformError``, as
flax.nnx refuses it too.  An argument's module returned among the stacked outputs along
the axis it is scanned along is the caller's own (``graph_updates.given_back``/``resolved``);
at another axis, or broadcast, it is flax.nnx's ``ValueError`` (``InconsistentAliasError``).
``transform_metadata={nnx.PARTITION_NAME: name}`` removes the scanned axis's
name from a Variable's ``out_sharding`` as it enters a step and adds it as it leaves
(``metadata_option``); ``_split_transpose`` is passed on to ``jax.lax.scan`` (which, in JAX
0.10, takes it and ignores it).  A module (or state) scanned along an axis other than 0 is
scanned as a copy with that axis moved to 0, whose updates are written back to the caller's
Variables with the axis moved back (``_move``).  A ``StateAxes`` inside an NNX object of
``in_axes`` (an ``nnx.prefix`` tree) gives the part under it an axis per filter, matched
below its place, its ``None`` a ``StateAxes`` ``None`` (beyond flax.nnx, which takes it in no
mode).  ``transform_metadata`` with a ``StateAxes`` in ``out_axes`` is refused by name.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from varjax.ir.typing import Passes, Prefix
from varjax.nnx.carry_moves import WHY_SCAN, refuse_moved
from varjax.nnx.config import resolve
from varjax.nnx.graph import merge
from varjax.nnx.graph_updates import given_back, resolved
from varjax.nnx.metadata_option import with_partition
from varjax.nnx.prefixes import PrefixAxes, axes_by_path
from varjax.nnx.pytree import Pytree
from varjax.nnx.state_axes import (
    StateAxes,
    check_state_axes,
    gathered,
    on_objects_only,
    restacked,
    split_by,
    spread,
    zeros,
)
from varjax.nnx.transform_checks import (
    as_decorator,
    as_given,
    checked,
    objects_in,
    positional,
    refuse_bound_method,
    same_carry_objects,
)
from varjax.objects import control_flow, split_merge
from varjax.trace.unprovided import not_provided
from varjax.trace.variable import Variable

__all__ = ["scan", "Carry"]


class Carry:
    """Marks the argument (``in_axes``) and the output (``out_axes``) of ``nnx.scan`` that is
    the loop carry."""


def _is_axis(x: Any) -> bool:
    return x is None or x is Carry


def _axes_leaves(name: str, axes: Any, graph: bool) -> list[tuple[Any, Any]]:
    """``(path, entry)`` of ``axes``, checked as flax.nnx checks them: ``Carry`` only at the
    top level and once; every entry an int, ``None``, ``Carry`` or (in graph mode) a
    ``StateAxes`` of those."""
    leaves = jax.tree_util.tree_leaves_with_path(
        axes, is_leaf=lambda x: _is_axis(x)
        or not isinstance(x, (tuple, list, dict, Pytree, Variable)))
    carries = [p for p, x in leaves if x is Carry]
    for path in carries:
        if len(path) > isinstance(axes, tuple):
            raise ValueError(f"Carry must be a top-level argument, it cannot be nested. "
                             f"Found Carry inside {name} at path {jax.tree_util.keystr(path)}")
    if len(carries) > 1:
        raise ValueError(f"Found multiple Carry definitions in {name}")
    check_state_axes("scan", name, axes, graph, (int, type(None), type(Carry)))
    for _, x in leaves:
        if not (_is_axis(x) or isinstance(x, (int, StateAxes)) and not isinstance(x, bool)):
            not_provided(f"nnx.scan({name}={type(x).__name__}(...))",
                         f"an {name} entry other than an int, None, nnx.Carry or a "
                         "StateAxes is not built yet.",
                         f"give ints, Nones, nnx.Carry or StateAxes in {name}",
                         by="varjax.nnx")
    return leaves


def _check_axes(in_axes: Any, out_axes: Any, graph: bool) -> None:
    outs = _axes_leaves("out_axes", out_axes, graph)
    for path, x in outs:
        at = f"out_axes{jax.tree_util.keystr(path)}"
        if x is None:
            raise ValueError(f"Cannot broadcast output state. Got out_axes=None at: {at}")
        for f, axis in x.items() if isinstance(x, StateAxes) else ():
            if axis is None or axis is Carry:
                raise ValueError(f"Cannot {'broadcast' if axis is None else 'carry'} output "
                                 f"state. Got StateAxes({{{f}: {axis}}}) at: {at}")
    ins = _axes_leaves("in_axes", in_axes, graph)
    if any(x is Carry for _, x in ins) != any(x is Carry for _, x in outs):
        raise ValueError("If one of in_axes or out_axes has Carry, the other must also have "
                         f"Carry. Got in_axes={in_axes!r}, out_axes={out_axes!r}")


def _move(tree: Any, axes: Any, to_front: bool, moved: list | None = None) -> Any:
    """``tree`` with each leaf's scanned axis (``axes``, a prefix of ints) moved to 0
    (``to_front``) or from 0 back.  A part holding objects (a module, a state) is moved as a
    copy, new Variables holding the moved arrays; for an argument, ``(part, copy, axis)`` is
    added to ``moved`` so ``_moved_back`` writes the copy's updates to the caller's
    Variables."""
    def one(axis: int, sub: Any) -> Any:
        if axis == 0:
            return sub
        copy = jax.tree.map(lambda x: jnp.moveaxis(x, axis, 0) if to_front
                            else jnp.moveaxis(x, 0, axis), sub)
        if moved is not None and objects_in(sub):
            moved.append((sub, copy, axis))
        return copy
    return jax.tree.map(one, axes, tree, is_leaf=_is_axis)


def _moved_back(moved: list) -> None:
    """Each moved argument part given its copy's values after the scan, the axis moved back
    (the RNG keys left out: they do not change, and a transform refuses writing them)."""
    for part, copy, axis in moved:
        state = _without_keys(split_merge.state(copy))
        split_merge.update(part, jax.tree.map(lambda x: jnp.moveaxis(x, 0, axis), state))


class _Layout:
    """Where each part of a call's arguments goes.  An argument at a ``StateAxes`` entry is
    split into one state per filter (``state_axes.split_by``), each state a part with its
    own axis; any other argument is one part.  Parts at ``Carry`` are carried (the
    top-level ``Carry`` argument is the carry ``fn`` returns; a state at ``Carry`` comes
    back as it went in, its Variables updated), parts at ``None`` are broadcast, parts at
    an int are scanned.  ``split_fixed`` are the broadcast states of ``StateAxes`` arguments
    (not of ``nnx.prefix`` trees, but of a ``StateAxes`` in one): given their values back
    every step in both modes."""

    def __init__(self, args: tuple, axes: tuple):
        given, part_axes, self.defs = split_by(args, axes)
        self.parts: list[Any] = []
        self.axes: list[Any] = []
        self.spans: list[tuple[int, int]] = []
        for i, (a, ax) in enumerate(zip(given, part_axes)):
            many = i in self.defs
            self.spans.append((len(self.parts), len(self.parts) + (len(a) if many else 1)))
            self.parts.extend(a if many else (a,))
            self.axes.extend(ax if many else (ax,))
        self.carry_at = next((self.spans[i][0] for i, a in enumerate(axes) if a is Carry), None)
        self.carried = tuple(k for k, a in enumerate(self.axes) if a is Carry
                             and k != self.carry_at)
        self.fixed = tuple(k for k, a in enumerate(self.axes) if a is None)
        self.scanned = tuple(k for k, a in enumerate(self.axes) if a is not None
                             and a is not Carry)
        of_split = {k for i in self.defs for k in range(*self.spans[i])
                    if not isinstance(axes[i], PrefixAxes)
                    or k - self.spans[i][0] in axes[i].restored}
        self.split_fixed = tuple(k for k in self.fixed if k in of_split)

    def key(self) -> tuple:
        """What a traced step depends on: the places and the split arguments' GraphDefs."""
        return (len(self.parts), tuple(self.spans), tuple(sorted(self.defs.items())),
                self.carry_at, self.carried, self.fixed, self.scanned, self.split_fixed)


def _arguments(key: tuple, parts: list[Any]) -> tuple:
    """The function's arguments from its parts: each split one merged from its states (their
    Variables, so their updates are the caller's)."""
    _, spans, defs, *_ = key
    defs = dict(defs)
    return tuple(merge(defs[i], *parts[a:b]) if i in defs else parts[a]
                 for i, (a, b) in enumerate(spans))


def _by_path(arg: Any, entry: Any) -> Any:
    """An argument's entry, a prefix tree over its objects (``nnx.prefix``) made one filter
    per path (``prefixes.axes_by_path``), so each Variable is scanned, carried or broadcast
    by its own axis; a ``StateAxes`` in the tree gives the part under it one per filter."""
    if _is_axis(entry) or isinstance(entry, (int, StateAxes)) or not objects_in(arg):
        return entry
    return axes_by_path(entry, _is_axis)


def _without_keys(state: Any) -> Any:
    """``state`` less its RNG keys: a stream's key is fixed inside a transform (only its count
    moves), and writing it, even with its own value, is refused there."""
    if not isinstance(state, dict):
        return state
    return {k: _without_keys(v) for k, v in state.items()
            if not jax.dtypes.issubdtype(getattr(v, "dtype", None), jax.dtypes.prng_key)}


def _per_arg(in_axes: Any, n: int) -> tuple:
    return in_axes if isinstance(in_axes, tuple) else (in_axes,) * n


def scan(f: Callable | None = None, *, length: int | None = None, reverse: bool = False,
         unroll: int | bool = 1, _split_transpose: bool = False,
         in_axes: Prefix = (Carry, 0), out_axes: Prefix = (Carry, 0),
         transform_metadata: Mapping[str, Any] | None = None, graph: bool | None = None,
         graph_updates: bool | None = None, passes: Passes = ()) -> Callable[..., Any]:
    """``jax.lax.scan`` over NNX objects: the ``Carry`` argument is carried, the others
    scanned along their axis or broadcast; a ``StateAxes`` entry gives each state of a
    module its own (``Carry``, ``None`` or an int).  ``transform_metadata={nnx.PARTITION_NAME:
    name}`` takes ``name`` out of a scanned argument's Variables' ``out_sharding`` at its
    axis inside each step and adds it to the stacked outputs' (``metadata_option``).
    ``passes`` (beyond flax.nnx, as ``nnx.jit``'s) run on the step's IR before JAX scans
    it."""
    modes = resolve(graph, graph_updates)
    _check_axes(in_axes, out_axes, modes[0])
    out_carry = next((i for i, x in enumerate(out_axes) if x is Carry), None) \
        if isinstance(out_axes, tuple) else (Carry if out_axes is Carry else None)
    ys_axes = out_axes if out_carry is None or out_carry is Carry else \
        out_axes[:out_carry] + out_axes[out_carry + 1:]

    def build(fn: Callable) -> Callable:
        refuse_bound_method(fn, "scan")
        named = with_partition("scan", fn, transform_metadata, in_axes, out_axes, _is_axis)

        @functools.cache
        def steps(key: tuple, arg_carry: int | None, layout: tuple) -> Callable:
            """The ``(carry, xs)`` step calling ``fn`` with its arguments made of the parts,
            one per layout (``_Layout.key``, and ``state_axes.spread``'s ``layout`` of the
            arguments holding a nested ``StateAxes``), so ``checked`` keeps one per layout
            too.  With
            graph updates a broadcast object's Variables are given back their values at the
            end of every step, so each step sees the same ones (flax.nnx's graph mode passes
            every step the states it was given)."""
            n, _, _, carry_at, carried, fixed, scanned, split_fixed = key
            restored = fixed if modes[1] else split_fixed
            body = checked(named, "scan", _carry_kept(arg_carry, out_carry))

            def step(c: Any, x: Any) -> Any:
                parts: list[Any] = [None] * n
                if carry_at is not None:
                    parts[carry_at] = c[0]
                for k, a in zip(carried + fixed + scanned, c[1] + c[2] + x):
                    parts[k] = a
                kept = [(a, _without_keys(split_merge.state(a))) for k, a in zip(fixed, c[2])
                        if k in restored and objects_in(a)]
                args = gathered(layout, _arguments(key, parts))
                out = body(*args)
                for a, before in kept:
                    split_merge.update(a, before)
                if out_carry is Carry:
                    return (out, c[1], c[2]), None
                ys = out if out_carry is None else out[:out_carry] + out[out_carry + 1:]
                ys = given_back("scan", args, ys, _per_arg(in_axes, len(args)), ys_axes,
                                modes[1])
                return (None if out_carry is None else out[out_carry], c[1], c[2]), ys
            step.__name__ = getattr(fn, "__name__", "the function")
            return step

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            args = positional(fn, args, kwargs)
            if in_axes is Carry and len(args) != 1:
                raise ValueError("When in_axes=Carry, the function must take exactly one "
                                 f"argument, got {len(args)} arguments.")
            axes = _per_arg(in_axes, len(args))
            parts, part_axes, layout = spread("scan", args, axes)
            on_objects_only("scan", parts, part_axes)
            lay = _Layout(parts, tuple(_by_path(a, e) for a, e in zip(parts, part_axes)))
            arg_carry = next((i for i, a in enumerate(axes) if a is Carry), None)
            init = (lay.parts[lay.carry_at] if lay.carry_at is not None else None,
                    tuple(lay.parts[k] for k in lay.carried),
                    tuple(lay.parts[k] for k in lay.fixed))
            moved: list = []
            xs = tuple(_move(lay.parts[k], lay.axes[k], True, moved) for k in lay.scanned)
            run = control_flow.scan(steps(lay.key(), arg_carry, layout), length=length,
                                    reverse=reverse, unroll=unroll,
                                    _split_transpose=_split_transpose, passes=passes)
            (carry, _, _), ys = run(init, xs)
            _moved_back(moved)
            carry = as_given(init[0], carry, modes[1])
            if out_carry is Carry:
                return carry
            ys = resolved(args, restacked(_move(ys, zeros(ys_axes), False), ys_axes))
            if out_carry is None:
                return ys
            return ys[:out_carry] + (carry,) + ys[out_carry:]
        return call
    return as_decorator(f, build)


def _carry_kept(arg_carry: int | None, out_carry: Any) -> Callable:
    """The check of what ``fn`` returns: the carry's objects in their places (moved:
    ``carry_moves.refuse_moved``); an argument's object among the other outputs is
    ``given_back``'s, in the step."""
    def check(what: str, fn: Callable, args: tuple, out: Any) -> None:
        if out_carry is not None:
            new = out if out_carry is Carry else out[out_carry]
            carry = args[arg_carry]
            same_carry_objects(what, fn, carry, new, functools.partial(
                refuse_moved, what, fn, carry, new, WHY_SCAN))
    return check
