"""Lifted ``scan``, ``remat_scan``, ``while_loop`` and ``fori_loop``.

``scan`` puts every variable in one of three groups, first matching filter
first: ``variable_axes`` (one slice per step, stacked along the axis, like
``xs``/``ys``), ``variable_broadcast`` (one value for all steps, read-only)
and ``variable_carry`` (threaded through the steps, like the carry).

Beyond Linen, carry and broadcast variables may be *created* in the body: the
first step is then peeled -- run once before ``lax.scan`` to create them -- and
the remaining steps are scanned.  A creation shows when the scanned step returns
variables it was not given, which stops that trace; the body is then traced
twice more (the peeled step and the scan).  Every other scan traces it once.
``while_loop`` cannot peel (the loop may run zero times), so a creation in its
body raises ``VariableCreationError``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from varjax.ir import errors, filters
from varjax.ir.protocols import LiftableModule
from varjax.ir.typing import ArrayLike, AxesPrefix, CollectionFilter, Passes, PyTree, Target
from varjax.lifting.groups import Group, set_aside
from varjax.lifting.region import DerivedKeys, lift
from varjax.objects import control_flow as objects
from varjax.trace.context import site
from varjax.transforms.calls import checkpoint
from varjax.transforms.common import (
    NO_INIT,
    apply_to,
    axis_names,
    call_direct,
    filter_items,
    has_axis,
    lift_methods,
    object_options,
    reject,
    rng_groups,
    traced_numbers,
    unbound,
)


class _Broadcast:
    """The ``in_axes`` entry of a scan argument that every step sees whole."""

    def __repr__(self) -> str:
        return "vj.broadcast"


broadcast = _Broadcast()


def _move(tree: Any, src: int, dst: int) -> Any:
    return tree if src == dst else jax.tree.map(lambda x: jnp.moveaxis(x, src, dst), tree)


def scan(target: Target, variable_axes: Mapping[Any, int] | None = None,
         variable_broadcast: CollectionFilter = False, variable_carry: CollectionFilter = False,
         split_rngs: Mapping[Any, bool] | None = None, in_axes: AxesPrefix = 0,
         out_axes: AxesPrefix = 0, length: int | None = None, reverse: bool = False,
         unroll: int = 1,
         data_transform: Callable[..., Any] | None = None,
         metadata_params: Mapping[str, Any] | None = None,
         methods: Sequence[str] | Mapping[str, Mapping[str, Any]] | None = None,
         check_constancy_invariants: bool = True, passes: Passes = ()) -> Target:
    """Lifted ``jax.lax.scan`` (Linen's ``nn.scan``): the body is
    ``fn(carry, *xs) -> (carry, ys)`` (after the module, if any).

    ``in_axes`` gives each ``xs`` argument's scanned axis, or ``vj.broadcast``;
    ``out_axes`` where each output of ``ys`` is stacked: an axis, or a pytree prefix of
    ``ys`` with axes at its leaves (Linen's ``vj.broadcast`` outputs are not supported).
    Under Linen's RNG convention the body is traced once before the loop, as Linen does
    to check that broadcast variables are loop invariants: that trace creates the
    broadcast variables and advances the draw counts, so keys equal Linen's
    (``check_constancy_invariants=False`` skips it, as in Linen).  The loop's own trace is
    then that trace with its draw counts moved, not a second run of the body's Python
    (``lifting.body.with_counts_moved``), so nested scans run their body once.
    ``metadata_params={nn.PARTITION_NAME: name}`` inserts ``name`` into the partition
    names of boxed variables at their scanned axis, as Linen does (a kernel stacked over
    layers reads ``P('layers', ...)``); ``data_transform`` is not supported.  ``passes``:
    passes run on the body's IR, after those of the enclosing program (``vj.lift``)."""
    reject(data_transform is not None, "scan", "data_transform is not supported.",
           "annotate shardings inside the body instead")
    _check_out_axes(out_axes)
    if isinstance(methods, Mapping):
        return lift_methods(target, "scan", methods, lambda options, names: scan(
            target, **options, methods=names))
    axes = filter_items(variable_axes, "variable_axes")
    n_ax = len(axes)
    var_filters = (*[f for f, _ in axes], filters.freeze(variable_broadcast),
                   filters.freeze(variable_carry))
    rng_filters, split = rng_groups(split_rngs)

    def transform(region: Callable, groups: tuple, rngs: tuple, carry: Any, *xs: Any) -> Any:
        carry = traced_numbers(carry)  # every step sees the carry the loop sees
        xs_axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(xs)
        scanned_xs = [_move(x, ax, 0) if ax is not broadcast else None
                      for x, ax in zip(xs, xs_axes)]
        n = length
        for tree in (scanned_xs, [_move(g, ax, 0) for g, (_, ax) in zip(groups[:n_ax], axes)]):
            leaves = jax.tree.leaves(tree)
            if n is None and leaves:
                n = leaves[0].shape[0]
        reject(n is None, "scan", "the number of steps is unknown: no scanned argument or "
               "variable shows it.", "pass length=")
        kept, aside = set_aside(groups[:n_ax], lambda i, x: has_axis(x, axes[i][1], n))
        kept = axis_names(kept, [ax for _, ax in axes], metadata_params, add=False)
        scanned_vars = [_move(g, ax, 0) for g, (_, ax) in zip(kept, axes)]
        keys = tuple({s: jax.random.split(k, n) for s, k in g.items()} if do else None
                     for g, do in zip(rngs, split))

        def step(carry, carried, bcast, sliced, peeled=False, probe=False):
            var_slices, key_slices, x_slices = sliced
            gs = (*var_slices, bcast, carried)
            ks = tuple(k if k is not None else g for k, g in zip(key_slices, rngs))
            xs_now = [x if ax is not broadcast else whole
                      for x, whole, ax in zip(x_slices, xs, xs_axes)]
            if probe:
                return region.traffic(gs, ks, carry, *xs_now)
            out, gs_out = region(gs, ks, carry, *xs_now)
            reject(not (isinstance(out, (tuple, list)) and len(out) == 2), "scan",
                   "the body must return (carry, ys).", "return a pair from the body")
            if not peeled:
                _check_step(bcast, carried, gs_out[n_ax], gs_out[n_ax + 1])
            return out[0], gs_out[n_ax + 1], gs_out[n_ax], (out[1], gs_out[:n_ax])

        sliced = (scanned_vars, keys, scanned_xs)
        carried, bcast = groups[n_ax + 1], groups[n_ax]
        if check_constancy_invariants and region.linen is not None:
            bcast = _linen_pretrace(region, step, (carry, carried, bcast), sliced, n, reverse,
                                    n_ax)
        try:
            carry_out, carried_out, stacked = _scan(step, carry, carried, bcast, sliced, n,
                                                    reverse, unroll)
            carry, carried = carry_out, carried_out
        except _Peel:
            # The body creates carry or broadcast variables: run the first step on its own to
            # create them, then scan the others with the variables existing.
            first = n - 1 if reverse else 0
            at_first = jax.tree.map(lambda x: x[first], sliced)
            carry, carried, bcast, (ys0, vars0) = step(carry, carried, bcast, at_first, True)
            first_part = jax.tree.map(lambda x: jnp.asarray(x)[None], (ys0, vars0))
            if n == 1:
                stacked = first_part
            else:
                rest = jax.tree.map(lambda x: x[:-1] if reverse else x[1:], sliced)
                carry, carried, stacked = _scan(step, carry, carried, bcast, rest, n - 1, reverse,
                                                unroll)
                parts = (stacked, first_part) if reverse else (first_part, stacked)
                stacked = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *parts)
        ys, var_out = stacked
        ys = _stack_outputs(ys, out_axes)
        var_out = axis_names([_move(g, 0, ax) for g, (_, ax) in zip(var_out, axes)],
                             [ax for _, ax in axes], metadata_params, add=True)
        var_out = [{**a, **g} for a, g in zip(aside, var_out)]
        return (carry, ys), (*var_out, bcast, carried)

    return apply_to(target, "scan", lambda fn: lift(
        transform, fn, variables=var_filters, rngs=rng_filters, name="scan", passes=passes,
        fix="add '{collection}' to variable_axes, variable_broadcast or variable_carry"),
        methods, object_options(
            "scan", lambda fn: objects.scan(fn, length=length, reverse=reverse, unroll=unroll,
                                           passes=passes),
            variable_axes=(variable_axes, None), variable_broadcast=(variable_broadcast, False),
            variable_carry=(variable_carry, False), split_rngs=(split_rngs, None),
            in_axes=(in_axes, 0), out_axes=(out_axes, 0), metadata_params=(metadata_params, None)))


def _check_out_axes(out_axes: AxesPrefix) -> None:
    """``out_axes`` holds axes only: a loop-invariant (``vj.broadcast``) output, which Linen
    computes once outside the loop, is refused rather than stacked."""
    for ax in jax.tree.leaves(out_axes, is_leaf=lambda x: x is broadcast):
        reject(ax is broadcast, "scan", "out_axes=vj.broadcast (an output computed once, "
               "outside the loop) is not supported.", "return it as part of the carry instead")
        reject(not isinstance(ax, int), "scan", f"out_axes has {ax!r}; its leaves are the axes "
               "along which ys are stacked.", "give an int, or a pytree prefix of ys of ints")


def _stack_outputs(ys: PyTree, out_axes: AxesPrefix) -> PyTree:
    """``ys`` (stacked along axis 0 by ``lax.scan``) with each part's axis at its
    ``out_axes`` entry."""
    try:
        return jax.tree.map(lambda ax, y: _move(y, 0, ax), out_axes, ys)
    except ValueError as e:
        raise errors.TransformError(
            f"vj.scan: out_axes {out_axes!r} is not a pytree prefix of the body's ys ({e}).",
            **site(), fix="give one axis, or one per part of ys") from None


def _scan(step: Callable, carry: Any, carried: Any, bcast: Any, sliced: Any, length: int,
          reverse: bool, unroll: int) -> tuple:
    def body(c, x):
        carry, carried = c
        carry, carried, _, ys = step(carry, carried, bcast, x)
        return (carry, carried), ys
    (carry, carried), stacked = jax.lax.scan(body, (carry, carried), sliced, length=length,
                                             reverse=reverse, unroll=unroll)
    return carry, carried, stacked


def _linen_pretrace(region: Any, step: Callable, state: tuple, sliced: Any, n: int,
                    reverse: bool, n_ax: int) -> Group:
    """Linen's extra trace of a scan body before the loop, on the first step's inputs:
    the draw counts advance as it did, and broadcast variables the body creates come from
    it (so from the keys Linen gives them).  Returns the broadcast group for the loop.  The
    region keeps the trace, and the loop's call (same types, later counts) is served from
    it with the counts moved."""
    carry, carried, bcast = state
    at_first = jax.tree.map(lambda x: x[n - 1 if reverse else 0], sliced)
    start = region.linen.snapshot()
    made = step(carry, carried, bcast, at_first, probe=True).creates
    creates_bcast = any(region.group_of(k) == n_ax for k in made)
    if not creates_bcast or any(region.group_of(k) == n_ax + 1 for k in made):
        return bcast   # a created carry variable: the first step is peeled (below)
    region.linen.restore(start)
    return step(carry, carried, bcast, at_first, peeled=True)[2]


class _Peel(Exception):
    """Raised out of a scan step whose body created a carry or broadcast variable."""


def _check_step(bcast: Group, carried: Group, bcast_out: Group, carried_out: Group) -> None:
    """After one step inside the loop: a created carry or broadcast variable means the first
    step must be peeled (``_Peel``); a write to an existing broadcast variable is an error."""
    if any(k not in carried for k in carried_out) or any(k not in bcast for k in bcast_out):
        raise _Peel()
    for key in sorted(bcast_out):
        reject(bcast_out[key] is not bcast[key], "scan", f"variable "
               f"{errors.format_path(key[1])} is in variable_broadcast, which is read-only "
               "inside the loop, but the body writes it.", "move its collection to variable_carry",
               key)


def remat_scan(target: Target, lengths: Sequence[int] = (),
               policy: Callable[..., bool] | None = None,
               variable_broadcast: CollectionFilter = False,
               variable_carry: CollectionFilter = False,
               variable_axes: Mapping[Any, int] | None = None,
               split_rngs: Mapping[Any, bool] | None = None) -> Target:
    """``scan`` of ``remat`` nested once per entry of ``lengths``: the body
    ``fn(carry) -> carry`` runs ``prod(lengths)`` times with O(sum(lengths)) memory for
    the backward pass; variables get one leading axis per level (Linen's defaults:
    every collection scanned, every stream split)."""
    kw = dict(variable_broadcast=variable_broadcast, variable_carry=variable_carry,
              variable_axes={True: 0} if variable_axes is None else variable_axes,
              split_rngs={True: True} if split_rngs is None else split_rngs)
    reject(not lengths, "remat_scan", "lengths is empty.", "pass lengths=(n,) or (n, m, ...)")

    def nest(fn: Callable, depth: int) -> Callable:
        inner = fn if depth == len(lengths) - 1 else nest(fn, depth + 1)

        def step(*args: Any) -> Any:
            return inner(*args), ()
        step.__name__ = getattr(fn, "__name__", "body")
        looped = scan(checkpoint(step, policy=policy, prevent_cse=depth == len(lengths) - 1),
                      length=lengths[depth], **kw)
        return lambda *args: looped(*args)[0]
    return apply_to(target, "remat_scan", lambda fn: nest(fn, 0))


@errors.api_boundary
def while_loop(cond_fn: Callable, body_fn: Callable, mdl: LiftableModule | PyTree,
               init: PyTree = NO_INIT, carry_variables: CollectionFilter = False,
               broadcast_variables: CollectionFilter = True,
               split_rngs: Mapping[Any, bool] | None = None, passes: Passes = ()) -> PyTree:
    """Lifted ``jax.lax.while_loop``: ``cond_fn(mdl, c) -> bool``, ``body_fn(mdl, c) -> c``
    (without ``mdl`` when it is None).  Carry variables are threaded through the loop,
    broadcast ones are read-only; a split stream draws a fresh key per iteration.
    ``passes``: passes run on ``cond_fn``'s and ``body_fn``'s IR (``vj.lift``).

    Without ``init``, JAX's signature in object mode: ``while_loop(cond_fun, body_fun,
    init_val)``, objects in ``init_val`` carried (``varjax.objects.control_flow``)."""
    if init is NO_INIT:
        object_options("while_loop", lambda f: f, carry_variables=(carry_variables, False),
                       broadcast_variables=(broadcast_variables, True),
                       split_rngs=(split_rngs, None))(cond_fn)
        return objects.while_loop(cond_fn, body_fn, mdl, passes=passes)
    rng_filters, split = rng_groups(split_rngs)
    var_filters = (filters.freeze(carry_variables), filters.freeze(broadcast_variables))

    def transform(cond_region: Callable, body_region: Callable, groups: tuple, rngs: tuple,
                  init: Any) -> Any:
        carried, bcast = groups

        # Linen's per-iteration keys: fold_in(key, i) for body_fn, fold_in(key, -i) for
        # cond_fn; else a distinct number per iteration and function.
        linen = body_region.linen is not None

        def keys_at(i: Any, which: int) -> tuple:
            data = (i if which else -i) if linen else 2 * i + which
            return tuple(DerivedKeys(g, lambda k: jax.random.fold_in(k, data))
                         if do else g for g, do in zip(rngs, split))
        zero = jnp.zeros((), jnp.int32)

        def cond(state):
            i, c, cv = state
            out, gs_out = cond_region((cv, bcast), keys_at(i, 0), c)
            _check_loop_step("cond_fn", (cv, bcast), gs_out)
            return out

        def body(state):
            i, c, cv = state
            c, gs_out = body_region((cv, bcast), keys_at(i, 1), c)
            _check_loop_step("body_fn", (cv, bcast), gs_out)
            return i + 1, c, gs_out[0]
        _, out, carried = jax.lax.while_loop(cond, body, (zero, init, carried))
        return out, (carried, bcast)

    lifted = lift(transform, unbound(cond_fn), unbound(body_fn), variables=var_filters,
                  rngs=rng_filters, name="while_loop", passes=passes,
                  fix="add '{collection}' to carry_variables (mutable) or broadcast_variables")
    return call_direct(lifted, mdl, init)


def _check_loop_step(what: str, given: tuple[Group, Group], returned: tuple[Group, Group]) -> None:
    """``cond_fn``/``body_fn`` of ``while_loop`` returned ``returned`` for the (carry,
    broadcast) groups ``given``: a variable it created, or a write anywhere but to a carry
    variable in ``body_fn``, is an error."""
    for group, (before, after) in enumerate(zip(given, returned)):
        for key in sorted(after):
            if key not in before:
                raise errors.VariableCreationError(
                    f"vj.while_loop: {what} creates variable {errors.format_path(key[1])}; "
                    "a loop carry needs a value before the loop, and the loop may run zero "
                    "times.", collection=key[0], path=key[1], **site(),
                    fix="create it before the loop (call body_fn once first, or initialise "
                        "it in setup)")
            reject(after[key] is not before[key] and (what == "cond_fn" or group == 1),
                   "while_loop", f"{what} writes variable {errors.format_path(key[1])}, which "
                   f"is {'read-only in cond_fn' if what == 'cond_fn' else 'a broadcast variable'}.",
                   "write it in body_fn, with its collection in carry_variables", key)


@errors.api_boundary
def fori_loop(lower: int, upper: ArrayLike, body_fn: Callable, mdl: LiftableModule | PyTree,
              init: PyTree = NO_INIT, carry_variables: CollectionFilter = False,
              broadcast_variables: CollectionFilter = True,
              split_rngs: Mapping[Any, bool] | None = None, passes: Passes = ()) -> PyTree:
    """Lifted ``jax.lax.fori_loop``: ``body_fn(mdl, i, c) -> c`` for ``lower <= i < upper``
    (``body_fn(i, c)`` when ``mdl`` is None); built on ``while_loop``.  Without ``init``,
    JAX's ``fori_loop(lower, upper, body_fun, init_val)`` in object mode."""
    if init is NO_INIT:
        object_options("fori_loop", lambda f: f, carry_variables=(carry_variables, False),
                       broadcast_variables=(broadcast_variables, True),
                       split_rngs=(split_rngs, None))(body_fn)
        return objects.fori_loop(lower, upper, body_fn, mdl, passes=passes)
    # The bounds travel in the loop state, not in closures: a traced ``upper`` is an
    # array of the enclosing trace, and the bodies are traced on their own.
    def cond(*a: Any) -> Any:
        i, end, _ = a[-1]
        return i < end

    def body(*a: Any) -> Any:
        i, end, c = a[-1]
        return i + 1, end, body_fn(*a[:-1], i, c)
    _, _, out = while_loop(cond, body, mdl, (jnp.asarray(lower, jnp.int32),
                                             jnp.asarray(upper, jnp.int32), init),
                           carry_variables, broadcast_variables, split_rngs, passes)
    return out

