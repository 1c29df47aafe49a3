"""NNX's transforms in graph mode, on varjax's object-mode transforms.

An NNX module is a pytree of Variables, so each transform here is the object-mode one
(``varjax.objects.object_transforms``) with NNX's signature: inside, every Variable access
is a ``var_get``/``var_set`` of one functionalized trace, and updates reach the caller's
Variables through the discharge signature.  What NNX adds is desugared:

* ``grad``/``value_and_grad`` differentiate the ``nnx.Param``s of a module argument (or
  what a ``DiffState`` filter selects): the module is ``split`` into that state and the
  rest, ``vj.value_and_grad`` differentiates the first and writes updates of the rest back
  (a BatchNorm's statistics), and the gradient is a ``State``, as NNX returns it;
* NNX's graph updates (``graph=True, graph_updates=True``, the default): a structural change
  to an argument's module inside (a ``sow``, a new or removed attribute) reaches the
  caller's module, and an argument's object the function returns is the caller's own
  (``graph_updates.carrying`` inside the object-mode transform, ``finish`` outside);
* ``graph_updates=False`` carries Variable values only, and tree mode (``graph=False``)
  also refuses shared Variables; there ``grad`` differentiates the whole argument (every
  Variable) and returns a gradient of the argument's type, as flax.nnx does, and a
  ``DiffState`` is refused with flax.nnx's ``ValueError``.

A train step is called again and again on the same modules, so dispatch is object mode's
kept graph (``varjax.objects.graph.ArgumentGraphs``): registered here, an NNX object's or
``State``'s containers are watched by identity, and while they hold the same objects a call
reads the Variables' values flat into one ``jax.jit`` instead of walking the modules.  An
eager ``grad`` reuses one object-mode ``value_and_grad`` per function, options and split
structure (``_object_grad``), so it is traced once, not per call.

Options of flax.nnx's signatures that are not built raise ``NotProvidedError`` when given.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np

from varjax.ir import errors
from varjax.ir.caches import LRU
from varjax.ir.typing import AxisName, Filter, Passes, ShardingLike
from varjax.nnx.config import resolve
from varjax.nnx.filter_maps import StateSharding
from varjax.nnx.graph import merge, split, state
from varjax.nnx.graph_updates import carrying, finish
from varjax.nnx.graphlib import flat_of
from varjax.nnx.jit_shardings import in_prefix, needs_graph_updates, static_positions
from varjax.nnx.output_axes import joined, out_prefix, split_outputs
from varjax.nnx.pytree import Pytree, private_containers
from varjax.nnx.state_ops import from_flat_state
from varjax.nnx.statelib import State
from varjax.nnx.transform_checks import as_decorator, refuse_options
from varjax.nnx.variablelib import Param, RngCount
from varjax.objects import inspection
from varjax.objects import object_transforms as objects
from varjax.objects.aliasing import register_aliased
from varjax.objects.graph import register_mutable
from varjax.passes.framework.pipeline import parse_entries

__all__ = ["jit", "grad", "value_and_grad", "remat", "DiffState"]


def _structure(obj: Any) -> list[Any]:
    """An NNX object's structure, as Python containers compared on every call: its
    attributes, and the plain dicts, lists and sets among them (a static list) that any
    code may change.  The containers only ``varjax.nnx``'s own methods change (its data
    names, a ``List``'s elements: ``private_containers``) are compared only after one of
    them ran.  Registered so that object mode keeps the graph of a call on the same modules
    (``varjax.objects.graph.ArgumentGraphs``) while these hold the same objects: a train
    step's repeated ``nnx.jit`` call then reads its Variables' values without walking the
    modules."""
    attributes = vars(obj)
    private = set(map(id, private_containers(obj)))
    return [c for c in (attributes, *(v for v in attributes.values()
                                      if type(v) in (dict, list, set)))
            if id(c) not in private]


def _mapping(state: State) -> list[Any]:
    """A ``State``'s structure: its mapping (the one attribute it has, set when it is made),
    which only ``State``'s methods change."""
    return [vars(state)["_mapping"]]


register_mutable(Pytree, _structure, private_containers)
register_mutable(State, lambda _: [], _mapping)
# An NNX object held at two places of a transform's arguments is one object inside, as in
# flax.nnx's graph mode (``varjax.objects.aliasing``).
register_aliased(Pytree)


def jit(fun: Callable | None = None, *, in_shardings: ShardingLike = None,
        out_shardings: ShardingLike = None, static_argnums: int | Sequence[int] | None = None,
        static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None,
        donate_argnames: str | Sequence[str] | None = None, keep_unused: bool = False,
        device: jax.Device | None = None, backend: str | None = None, inline: bool = False,
        graph: bool | None = None, graph_updates: bool | None = None,
        passes: Passes = ()) -> Callable[..., Any]:
    """``jax.jit`` over NNX objects: Variable updates come back to the caller's objects.
    ``passes`` (beyond flax.nnx: pass instances or pipeline strings) run on the step's IR,
    every Variable of its objects a variable of it, as ``apply(passes=...)`` runs them on a
    Linen model: ``stop-gradient{collection=params}`` freezes the Params of a train step.
    ``in_shardings``/``out_shardings``/``static_argnames`` are flax.nnx's
    (``jit_shardings``): a module argument's Variables come in, and their updates out,
    with its ``in_shardings`` entry (a ``StateSharding``: per filter of its state); a
    module made inside and returned at a ``StateSharding`` entry of ``out_shardings`` is
    split by its filters, each state on its sharding, and merged outside (``output_axes``).
    ``donate_argnums``/``donate_argnames`` donate a module argument's Variables, each given
    back (written or not), as in flax.nnx; ``keep_unused``, ``device``, ``backend`` and
    ``inline`` are ``jax.jit``'s."""
    modes = resolve(graph, graph_updates)
    needs_graph_updates("out_shardings", out_shardings, all(modes))
    sharded = in_shardings is not None or out_shardings is not None

    def build(f: Callable) -> Callable:
        nums, names = static_positions(f, static_argnums, static_argnames)
        donated, donated_names = static_positions(f, donate_argnums, donate_argnames)
        by_state = split_outputs(f, out_shardings, True, StateSharding, "nnx.jit(out_shardings)")
        jitted = objects.jit(carrying(by_state, "jit", *modes), static_argnums=nums,
                             static_argnames=names, donate_argnums=donated,
                             donate_argnames=donated_names, keep_unused=keep_unused,
                             device=device, backend=backend, inline=inline,
                             in_shardings=in_prefix(in_shardings, nums, all(modes))
                             if sharded else None,
                             out_shardings=(out_prefix(out_shardings, StateSharding), None)
                             if sharded else None,
                             passes=passes)

        @functools.wraps(f)
        def call(*args: Any, **kwargs: Any) -> Any:
            out = finish(args, kwargs, *jitted(*args, **kwargs))
            return joined(out_shardings, out, args, StateSharding) if by_state is not f else out
        return inspection.mark(call, *inspection.marked_step(jitted))
    return as_decorator(fun, build)


@dataclasses.dataclass(frozen=True)
class DiffState:
    """Differentiate argument ``argnum`` with respect to what ``filter`` selects."""

    argnum: int
    filter: Filter


def _diff_states(argnums: Any, updates: bool) -> tuple[tuple[DiffState, ...], bool]:
    """``argnums`` as ``DiffState``s (an int: the argument's ``Param``s, with graph updates;
    every Variable, without), and whether it was a sequence.  Without graph updates a
    ``DiffState`` is refused with flax.nnx's ``ValueError``."""
    many = not isinstance(argnums, (int, DiffState))
    items = argnums if many else (argnums,)
    for a in items:
        if isinstance(a, DiffState) and not updates:
            raise ValueError(
                "`argnums` cannot contain `DiffState` objects when `graph=False` or "
                "`graph_updates=False`: there nnx.grad differentiates whole arguments, as "
                "jax.grad does. Split the module (nnx.split(model, nnx.Param, ...)) and pass "
                "the states as arguments, or pass graph=True and graph_updates=True.")
    everything = Param if updates else ...
    return tuple(a if isinstance(a, DiffState) else DiffState(a, everything)
                 for a in items), many


_GRADS = LRU()    # (fn, graph, updates, has_aux, argnums, defs, count, passes, holomorphic)


def _object_grad(fn: Callable, graph: bool, updates: bool, has_aux: bool, argnums: Any,
                 defs: tuple, count: int, passes: tuple, holomorphic: bool) -> Callable:
    """The object-mode ``value_and_grad`` of ``fn`` through ``carrying`` (its aux and the
    changes come out as the aux), over arguments split by ``defs`` (per split argument
    its ``GraphDef``; ``count`` arguments in all) or, with no ``defs``, over the whole
    arguments.  One per function, options and split structure, so that an eager
    ``nnx.grad(f)(model)`` called again (a new ``nnx.grad`` each time, as in a loop
    body) reuses its functionalized trace instead of tracing ``f`` again.  ``passes``:
    parsed, run on ``fn``'s IR before it is differentiated."""
    key = (fn, graph, updates, has_aux, argnums, defs, count, passes, holomorphic)
    found = _GRADS.get(key)
    if found is None:
        carried = carrying(fn, "grad", graph, updates)

        def loss(*a: Any) -> Any:
            out, changes = carried(*a)
            return (out[0], (out[1], changes)) if has_aux else (out, (None, changes))
        graphdefs = dict(defs)
        order = sorted(graphdefs)

        def inner(*a: Any) -> Any:
            rests = dict(zip(order, a[count:]))
            merged = {i: merge(graphdefs[i], a[i], rests[i]) for i in order}
            out = loss(*(merged.get(i, a[i]) for i in range(count)))
            for i in order:
                _streams_back(merged[i], rests[i])
            return out
        found = _GRADS[key] = objects.value_and_grad(inner if defs else loss,
                                                     argnums=argnums, has_aux=True,
                                                     holomorphic=holomorphic, passes=passes)
    return found


def _streams_back(merged: Any, rest: Any) -> None:
    """Writes the count of each RNG stream of ``merged`` into ``rest``'s ``RngCount`` (a
    view of the caller's stream, which object mode writes back):
    ``merge`` gives a stream the values of its key and count, so a Dropout's draws inside
    the function would not otherwise advance the caller's stream, as flax.nnx's do."""
    now = flat_of(state(merged))
    for path, leaf in flat_of(rest).items():
        mine = now.get(path)
        # a draw moves a stream's count only (its key is fixed inside a transform)
        if isinstance(leaf, RngCount) and mine is not None and mine is not leaf:
            leaf.value = mine.value


def _real_inputs(args: Sequence[Any], diffs: Sequence[DiffState]) -> None:
    """jax.grad's refusal of integer inputs, for every leaf differentiated (a counter, an RNG
    stream's count or key): object mode would give each a float0 gradient, as jax.grad with
    ``allow_int=True`` does; flax.nnx raises jax.grad's ``TypeError``, naming the dtype."""
    for d in diffs:
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[d.argnum])[0]:
            dtype = jax.dtypes.result_type(leaf) if not hasattr(leaf, "dtype") else leaf.dtype
            if not jax.dtypes.issubdtype(dtype, np.inexact):
                raise TypeError(
                    "grad requires real- or complex-valued inputs (input dtype that is a "
                    f"sub-dtype of np.inexact), but got {dtype} at argument {d.argnum}"
                    f"{jax.tree_util.keystr(path)}. If you want to use Boolean- or "
                    "integer-valued inputs, use vjp or set allow_int to True.")


def _shared_as(args: Sequence[Any], grads: Any, diffs: Sequence[DiffState], many: bool) -> Any:
    """Graph mode without graph updates: each module argument's gradient rebuilt over the
    argument's own graph, so a submodule held at two attributes is one object in it, as
    in flax.nnx (object mode returns the argument's pytree copy, the child twice: the
    gradient summed at its first path, zeros at the second)."""
    def shared(arg: Any, grad: Any) -> Any:
        if not isinstance(arg, Pytree):
            return grad
        graphdef, own = split(arg)
        flat = flat_of(state(grad, graph=False))
        return merge(graphdef, from_flat_state({p: flat[p] for p in flat_of(own)}))
    if not many:
        return shared(args[diffs[0].argnum], grads)
    return tuple(shared(args[d.argnum], g) for d, g in zip(diffs, grads))


def value_and_grad(f: Callable | None = None, *,
                   argnums: int | DiffState | Sequence[int | DiffState] = 0,
                   has_aux: bool = False, holomorphic: bool = False, allow_int: bool = False,
                   reduce_axes: Sequence[AxisName] = (), graph: bool | None = None,
                   graph_updates: bool | None = None, passes: Passes = ()) -> Callable[..., Any]:
    """``jax.value_and_grad`` over NNX objects: a module argument's gradient is the ``State``
    of its ``nnx.Param``s (or of a ``DiffState``'s filter); the rest of its Variables keep
    the updates the function made.  ``passes`` (beyond flax.nnx, as ``jit``'s) run on the
    function's IR before it is differentiated: ``stop-gradient{collection=params}`` makes
    the Params' gradient zero while the rest of the step runs."""
    refuse_options("value_and_grad", reduce_axes=(reduce_axes, ()))
    parsed = parse_entries(passes)
    graph, updates = resolve(graph, graph_updates)
    diffs, many = _diff_states(argnums, updates)
    jax_argnums = tuple(d.argnum for d in diffs) if many else diffs[0].argnum

    def build(fn: Callable) -> Callable:
        def differentiated(defs: tuple = (), count: int = 0) -> Callable:
            return _object_grad(fn, graph, updates, has_aux, jax_argnums, defs, count, parsed,
                                holomorphic)

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            for d in diffs:
                if d.argnum >= len(args):
                    raise errors.TransformError(
                        f"nnx.grad: argnums names argument {d.argnum}, and the function was "
                        f"given {len(args)}.", **errors.where(), fix="pass that argument")
            if not updates:     # the whole arguments, as jax.grad (the Tree Mode note)
                if not allow_int:
                    _real_inputs(args, diffs)
                (value, (aux, _)), grads = differentiated()(*args)
                if graph:
                    grads = _shared_as(args, grads, diffs, many)
                return ((value, aux) if has_aux else value), grads
            given = list(args)
            defs, rests = {}, {}
            for d in diffs:
                if isinstance(given[d.argnum], Pytree):
                    defs[d.argnum], given[d.argnum], rests[d.argnum] = split(
                        given[d.argnum], d.filter, ...)
            if not allow_int:
                _real_inputs(given, diffs)
            order = sorted(rests)
            vg = differentiated(tuple(defs.items()), len(args))
            (value, (aux, changes)), grads = vg(*given, *(rests[i] for i in order))
            aux = finish(args, {}, aux, changes)
            return ((value, aux) if has_aux else value), grads
        return call
    return as_decorator(f, build)


def grad(f: Callable | None = None, *, argnums: int | DiffState | Sequence[int | DiffState] = 0,
         has_aux: bool = False, holomorphic: bool = False, allow_int: bool = False,
         reduce_axes: Sequence[AxisName] = (), graph: bool | None = None,
         graph_updates: bool | None = None, passes: Passes = ()) -> Callable[..., Any]:
    """``value_and_grad`` without the value (with ``has_aux``: ``(grads, aux)``)."""
    def build(fn: Callable) -> Callable:
        vg = value_and_grad(fn, argnums=argnums, has_aux=has_aux, holomorphic=holomorphic,
                            allow_int=allow_int, reduce_axes=reduce_axes, graph=graph,
                            graph_updates=graph_updates, passes=passes)

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            value, grads = vg(*args)
            return (grads, value[1]) if has_aux else grads
        return call
    return as_decorator(f, build)


def remat(f: Callable | None = None, *, prevent_cse: bool = True,
          static_argnums: int | Sequence[int] = (), policy: Callable | None = None,
          graph: bool | None = None, graph_updates: bool | None = None,
          passes: Passes = ()) -> Callable[..., Any]:
    """``jax.checkpoint`` over NNX objects (graph updates and ``passes`` as ``jit``'s)."""
    modes = resolve(graph, graph_updates)

    def build(fn: Callable) -> Callable:
        checkpointed = objects.remat(carrying(fn, "remat", *modes), prevent_cse=prevent_cse,
                                     static_argnums=static_argnums, policy=policy,
                                     passes=passes)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return finish(args, kwargs, *checkpointed(*args, **kwargs))
        return call
    return as_decorator(f, build)
