"""NNX's ``scan`` (and its ``Carry`` marker) in graph mode, on varjax's object-mode ``scan``.

``nnx.scan`` describes each positional argument by an ``in_axes`` entry: ``Carry`` (at most
one, the loop carry), an int (the axis it is scanned along) or ``None`` (the same every
step); ``out_axes`` says the same of what the function returns.  That desugars onto
``vj.scan``'s ``(carry, xs) -> (carry, ys)`` as flax.nnx's own graph-mode scan does:

* the carry is the ``Carry`` argument *and* the broadcast (``None``) arguments: a broadcast
  module's Variable updates are carried from step to step, and afterwards its Variables get
  their values from before the scan back, as flax.nnx's graph mode keeps none of them;
* the scanned arguments, their axis moved to 0, are the ``xs``: a stack of layers made with
  ``nnx.vmap`` is applied one layer per step, and its Variables' updates come back stacked;
* the outputs at int axes are the ``ys``, stacked along that axis.

The carry returned holds the caller's objects (their Variables hold the final values), as in
flax.nnx, when the function returns each carry object in the place it came in (without graph
updates, new objects holding the caller's Variables, as flax.nnx returns them then); a
structural change inside is a ``TransformError``, as flax.nnx refuses it too; elsewhere
``transform_checks`` refuses what object mode cannot keep (an argument's object returned
as an output).  ``StateAxes`` prefixes, a module scanned along
an axis other than 0, ``transform_metadata`` and ``_split_transpose`` are refused by name.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from varjax.nnx.config import resolve
from varjax.nnx.transform_checks import (
    as_decorator,
    as_given,
    checked,
    no_argument_returned,
    objects_in,
    positional,
    refuse_bound_method,
    refuse_options,
    same_carry_objects,
)
from varjax.objects import control_flow, split_merge
from varjax.trace.unprovided import not_provided

__all__ = ["scan", "Carry"]


class Carry:
    """Marks the argument (``in_axes``) and the output (``out_axes``) of ``nnx.scan`` that is
    the loop carry."""


def _is_axis(x: Any) -> bool:
    return x is None or x is Carry


def _axes_leaves(name: str, axes: Any) -> list[tuple[Any, Any]]:
    """``(path, entry)`` of ``axes``, checked as flax.nnx checks them: ``Carry`` only at the
    top level and once; every entry an int, ``None`` or ``Carry`` (``StateAxes`` is not
    built)."""
    leaves = jax.tree_util.tree_leaves_with_path(
        axes, is_leaf=lambda x: _is_axis(x) or not isinstance(x, (tuple, list, dict)))
    carries = [p for p, x in leaves if x is Carry]
    for path in carries:
        if len(path) > isinstance(axes, tuple):
            raise ValueError(f"Carry must be a top-level argument, it cannot be nested. "
                             f"Found Carry inside {name} at path {jax.tree_util.keystr(path)}")
    if len(carries) > 1:
        raise ValueError(f"Found multiple Carry definitions in {name}")
    for _, x in leaves:
        if not (_is_axis(x) or isinstance(x, int) and not isinstance(x, bool)):
            not_provided(f"nnx.scan({name}={type(x).__name__}(...))",
                         f"an {name} entry other than an int, None or nnx.Carry (a StateAxes "
                         "prefix: an axis per filter of a module's state) is not built yet.",
                         f"give an int, None or nnx.Carry per argument in {name}; to scan "
                         "part of a module's state, split it (nnx.split) and pass the states "
                         "with their own axes", by="varjax.nnx")
    return leaves


def _check_axes(in_axes: Any, out_axes: Any) -> None:
    outs = _axes_leaves("out_axes", out_axes)
    for path, x in outs:
        if x is None:
            raise ValueError(f"Cannot broadcast output state. Got out_axes=None at: "
                             f"out_axes{jax.tree_util.keystr(path)}")
    ins = _axes_leaves("in_axes", in_axes)
    if any(x is Carry for _, x in ins) != any(x is Carry for _, x in outs):
        raise ValueError("If one of in_axes or out_axes has Carry, the other must also have "
                         f"Carry. Got in_axes={in_axes!r}, out_axes={out_axes!r}")


def _move(tree: Any, axes: Any, to_front: bool, what: str) -> Any:
    """``tree`` with each leaf's scanned axis (``axes``, a prefix of ints) moved to 0
    (``to_front``) or from 0 back; a Variable is moved only at axis 0 (not built else)."""
    def one(axis: int, sub: Any) -> Any:
        if axis == 0:
            return sub
        if objects_in(sub):
            not_provided(f"nnx.scan over a module at {what} {axis}",
                         "objects are scanned along axis 0 only in varjax.nnx.",
                         "stack the module's Variables along axis 0 (nnx.vmap's default)",
                         by="varjax.nnx")
        return jax.tree.map(lambda x: jnp.moveaxis(x, axis, 0) if to_front
                            else jnp.moveaxis(x, 0, axis), sub)
    return jax.tree.map(one, axes, tree, is_leaf=_is_axis)


def _places(axes: tuple) -> tuple[int | None, tuple[int, ...], tuple[int, ...]]:
    """Where the carry, the broadcast and the scanned arguments are."""
    return (next((i for i, a in enumerate(axes) if a is Carry), None),
            tuple(i for i, a in enumerate(axes) if a is None),
            tuple(i for i, a in enumerate(axes) if a is not None and a is not Carry))


def _carry_kept(what: str, step: Callable, args: tuple, out: Any) -> None:
    """The step returns the carry's objects in their places, and no argument's object
    among its outputs."""
    same_carry_objects(what, step, args[0], out[0], _moved)
    no_argument_returned(what, step, args, out[1])


def _per_arg(in_axes: Any, n: int) -> tuple:
    return in_axes if isinstance(in_axes, tuple) else (in_axes,) * n


def scan(f: Callable | None = None, *, length: int | None = None, reverse: bool = False,
         unroll: int | bool = 1, _split_transpose: bool = False, in_axes: Any = (Carry, 0),
         out_axes: Any = (Carry, 0), transform_metadata: Mapping[str, Any] | None = None,
         graph: bool | None = None, graph_updates: bool | None = None) -> Any:
    """``jax.lax.scan`` over NNX objects: the ``Carry`` argument and the broadcast ones are
    carried (their Variable updates written back), the others scanned along their axis."""
    refuse_options("scan", _split_transpose=(_split_transpose, False))
    updates = resolve(graph, graph_updates)[1]
    if transform_metadata:
        not_provided("nnx.scan(transform_metadata=...)", "this option is not built yet.",
                     "call nnx.scan without transform_metadata", by="varjax.nnx")
    _check_axes(in_axes, out_axes)
    out_carry = next((i for i, x in enumerate(out_axes) if x is Carry), None) \
        if isinstance(out_axes, tuple) else (Carry if out_axes is Carry else None)

    def build(fn: Callable) -> Callable:
        refuse_bound_method(fn, "scan")

        @functools.cache
        def steps(n: int, carry_at: int | None, fixed: tuple[int, ...],
                  scanned: tuple[int, ...]) -> Callable:
            """The ``(carry, xs)`` step calling ``fn`` with its ``n`` arguments in place,
            one per argument layout, so ``checked`` keeps one per layout too."""
            def step(c: Any, x: Any) -> Any:
                full: list[Any] = [None] * n
                if carry_at is not None:
                    full[carry_at] = c[0]
                for i, a in zip(fixed + scanned, c[1] + x):
                    full[i] = a
                out = fn(*full)
                if out_carry is None:
                    return (None, c[1]), out
                if out_carry is Carry:
                    return (out, c[1]), None
                return (out[out_carry], c[1]), out[:out_carry] + out[out_carry + 1:]
            step.__name__ = getattr(fn, "__name__", "the function")
            return checked(step, "scan", _carry_kept, loop=True)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            args = positional(fn, args, kwargs)
            if in_axes is Carry and len(args) != 1:
                raise ValueError("When in_axes=Carry, the function must take exactly one "
                                 f"argument, got {len(args)} arguments.")
            axes = _per_arg(in_axes, len(args))
            if len(axes) != len(args):
                raise ValueError(f"nnx.scan: in_axes has {len(axes)} entries and the "
                                 f"function was given {len(args)} arguments.")
            carry_at, fixed, scanned = _places(axes)
            init = (args[carry_at] if carry_at is not None else None,
                    tuple(args[i] for i in fixed))
            xs = tuple(_move(args[i], axes[i], True, "in_axes") for i in scanned)
            run = control_flow.scan(steps(len(args), carry_at, fixed, scanned), length=length,
                                    reverse=reverse, unroll=unroll)
            kept = [(a, split_merge.state(a)) for a in init[1] if objects_in(a)]
            (carry, _), ys = run(init, xs)
            for a, before in kept:      # flax.nnx keeps none of their updates
                split_merge.update(a, before)
            carry = as_given(init[0], carry, updates)
            if out_carry is Carry:
                return carry
            ys = _move(ys, out_axes if out_carry is None else
                       out_axes[:out_carry] + out_axes[out_carry + 1:], False, "out_axes")
            if out_carry is None:
                return ys
            return ys[:out_carry] + (carry,) + ys[out_carry:]
        return call
    return as_decorator(f, build)


def _moved() -> None:
    not_provided("a nnx.scan function returning carry objects in other places",
                 "flax.nnx refuses a carry whose objects are not the ones it was given; "
                 "varjax.nnx returns the caller's objects only where they stay in place.",
                 "return each carry object in the place it came in; swap Variable values "
                 "instead", by="varjax.nnx")
