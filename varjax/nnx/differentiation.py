"""NNX's ``jvp``, ``vjp`` and ``custom_vjp``.

``custom_vjp`` is object mode's (``varjax/objects/custom_vjp.py``): ``fun`` and ``fwd`` run
as one functionalized trace each, their Variable reads and writes IR effects, and updates
come back to the caller's objects.  flax.nnx 0.12.8 has two forms, both built:

* with graph updates (the default; ``_StateCotangents``): ``bwd(*nondiff, res,
  (input_updates_g, out_g))`` gets, per differentiated module argument, the ``State`` of
  the cotangents of its Variables after the call (what later uses of them send back), and
  returns a ``State`` per module;
* ``graph_updates=False`` or ``graph=False`` (``_SameTypeCotangents``): ``jax.custom_vjp``'s
  form, ``bwd(*nondiff, res, g)`` returning a module of cotangents for a module, and
  ``updates_g=`` (the updated Variables' cotangents) when ``bwd`` declares it.

In both a Variable may be updated inside (a BatchNorm's statistics under ``grad``), as in
flax.nnx 0.12.8 (which does not enforce the Tree Mode note's "differentiable Variables may
not be updated"): its update is written back, and its cotangent is ``bwd``'s to use.

``jvp``/``vjp`` are ``jax.jvp``/``jax.vjp`` of object mode's run of ``f`` (as ``vj.grad``
is ``jax.value_and_grad`` of it): one functionalized trace over JAX's copies of the primals,
its Variable reads and writes IR effects, the updates written back to the caller's
objects afterwards (a module passed twice is one object inside).  A module argument's
tangent or cotangent is a module of the same structure, as flax.nnx returns it.  flax.nnx
0.12.8 runs them only without graph updates (its default raises ``NotImplementedError``);
so does varjax.nnx, with the same error.  In tree mode (``graph=False``) they run the same
way, the primals taken as trees: a Variable reached twice among them is refused, as flax.nnx
refuses it.  A ``DiffState(argnum, filter)`` in ``custom_vjp``'s ``nondiff_argnums`` (graph
updates) makes only the Variables ``filter`` selects differentiable, as in flax.nnx.
``reduce_axes`` (which JAX no longer has: ``jax.vjp`` raises ``NotImplementedError`` for
it, as flax.nnx does) is refused by name.

``defvjp(fwd, bwd, symbolic_zeros=True)`` is ``jax.custom_vjp``'s, as in flax.nnx:
``fwd`` gets a ``CustomVJPPrimal(value, perturbed)`` for each array argument and, without
graph updates, a module whose Variables hold one each (``m.x.get_value().value``;
``m.x.set_value(new)`` updates it), and ``bwd`` gets ``SymbolicZero`` for each zero
cotangent (an unused output, a Variable update nothing later reads in ``updates_g``).  With
graph updates flax.nnx fails on a module argument (its fwd's Variables hold
``CustomVJPPrimal``s, which JAX refuses as outputs: a ``TypeError``); varjax raises
``InvalidVariablesError`` (a ``TypeError``) naming the Variable, before ``fwd`` runs.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import jax

from varjax.ir import errors
from varjax.ir.typing import AxisName, Filter, Passes
from varjax.nnx.config import resolve
from varjax.nnx.filterlib import to_predicate
from varjax.nnx.pytree import Pytree
from varjax.nnx.statelib import State
from varjax.nnx.transform_checks import (
    as_decorator,
    objects_in,
    positional,
    refuse_bound_method,
)
from varjax.nnx.transforms import DiffState
from varjax.objects import object_transforms as objects
from varjax.objects.custom_vjp import custom_vjp as object_custom_vjp
from varjax.objects.run import arg_names
from varjax.passes.framework.pipeline import parse_entries
from varjax.trace.unprovided import not_provided
from varjax.trace.variable import Variable

__all__ = ["jvp", "vjp", "custom_vjp"]


def _modes(what: str, graph: bool | None, graph_updates: bool | None) -> bool:
    """Whether the call is in graph mode, after flax.nnx's refusal of graph updates (the
    settings of ``nnx.set_graph_mode``/``set_graph_updates`` where the arguments are None)."""
    graph, updates = resolve(graph, graph_updates)
    if updates:
        raise NotImplementedError(f"graph-mode with graph_updates is not supported for "
                                  f"nnx.{what}. Set graph=False or graph_updates=False.")
    return graph


def _trees_only(what: str, graph: bool, primals: Any) -> None:
    """Tree mode (``graph=False``) takes the primals as trees: a Variable (or module, or
    stream) reached twice among them is refused, as flax.nnx refuses it with a
    ``ValueError``.  Graph mode takes it as one object (object mode's own)."""
    if graph:
        return
    seen: set[int] = set()
    for x in objects_in(primals):
        if id(x) in seen:
            raise errors.InconsistentAliasError(
                f"nnx.{what}: a {type(x).__name__} is reached twice among the primals; tree "
                "mode (graph=False) takes trees, without shared references (flax.nnx "
                "refuses this Variable aliasing too).", **errors.where(),
                fix="pass each Variable once (nnx.clone() makes a copy), or call it with "
                    "graph=True, graph_updates=False")
        seen.add(id(x))


def _traced(what: str, f: Callable, primals: tuple, has_aux: bool,
            passes: Any) -> tuple[Callable, Any]:
    """``f`` as object mode runs it (``object_transforms._Pure``: one functionalized trace
    over JAX's copies of the primals, its Variable accesses IR effects), returning its
    output and ``(aux, Result)`` for a JAX transform with ``has_aux``; and the primals'
    graph, to write the ``Result``'s updates back to the caller's objects."""
    def checked(*args: Any) -> Any:
        out = f(*args)
        if objects_in(out[0] if has_aux else out):
            not_provided(f"returning an object from nnx.{what}",
                         "its Variables would hold the transform's tracers.",
                         "return arrays", by="varjax.nnx")
        return out
    pure = objects._Pure(checked, arg_names(f), parse_entries(passes))
    graph = pure.originals(primals, {})

    def make(p: Callable) -> Callable:
        def split_aux(*args: Any) -> Any:
            out, result = p(*args)
            out, aux = out if has_aux else (out, None)
            return out, (aux, result)
        return split_aux
    return pure.get(graph, make), graph


def vjp(f: Callable | None = None, *primals: Any, has_aux: bool = False,
        reduce_axes: Sequence[AxisName] = (), graph: bool | None = None,
        graph_updates: bool | None = None, passes: Passes = ()
        ) -> tuple[Any, ...] | Callable[..., Any]:
    """``jax.vjp`` over NNX objects: ``(out, vjp_fn)`` (``(out, vjp_fn, aux)``), where
    ``vjp_fn(g)`` returns one cotangent per primal, a module's a module of cotangents.
    ``passes`` (beyond flax.nnx, as ``nnx.jit``'s) run on ``f``'s IR before JAX
    differentiates it."""
    in_graph = _modes("vjp", graph, graph_updates)
    if reduce_axes:
        not_provided("nnx.vjp(reduce_axes=...)", "JAX no longer has this option: jax.vjp "
                     "raises NotImplementedError for it ('deprecated'), and flax.nnx 0.12.8 "
                     "raises the same.", "call nnx.vjp without reduce_axes; sum the "
                     "cotangents over the axis (jax.lax.psum) instead", by="varjax.nnx")
    if f is None:
        return functools.partial(vjp, has_aux=has_aux, graph=graph, graph_updates=graph_updates,
                                 passes=passes)
    refuse_bound_method(f, "vjp")
    if not primals:
        return functools.partial(vjp, f, has_aux=has_aux, graph=graph,
                                 graph_updates=graph_updates, passes=passes)
    _trees_only("vjp", in_graph, primals)
    fn, graph = _traced("vjp", f, primals, has_aux, passes)
    out, vjp_fn, (aux, result) = jax.vjp(fn, *primals, has_aux=True)
    graph.write_back(result.updates, result.created)
    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


def jvp(f: Callable | None = None, primals: tuple | None = None,
        tangents: tuple | None = None, *, has_aux: bool = False, graph: bool | None = None,
        graph_updates: bool | None = None, passes: Passes = ()
        ) -> tuple[Any, ...] | Callable[..., Any]:
    """``jax.jvp`` over NNX objects: a module's tangent is a module of tangents;
    ``(out, tangent_out)`` (``(out, tangent_out, aux)``); ``passes`` as ``vjp``'s."""
    in_graph = _modes("jvp", graph, graph_updates)
    if f is None:
        return functools.partial(jvp, has_aux=has_aux, graph=graph, graph_updates=graph_updates,
                                 passes=passes)
    refuse_bound_method(f, "jvp")
    if primals is None:
        return functools.partial(jvp, f, has_aux=has_aux, graph=graph,
                                 graph_updates=graph_updates, passes=passes)
    _trees_only("jvp", in_graph, primals)
    fn, graph = _traced("jvp", f, tuple(primals), has_aux, passes)
    out, tangent, (aux, result) = jax.jvp(fn, tuple(primals), tuple(tangents), has_aux=True)
    graph.write_back(result.updates, result.created)
    return (out, tangent, aux) if has_aux else (out, tangent)


def _key_name(k: Any) -> Any:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def _variables(module: Any) -> list[tuple[tuple, Variable]]:
    """``(path, Variable)`` for each Variable of ``module``, named as ``nnx.state`` names
    it (attribute names, element indices)."""
    found = jax.tree_util.tree_flatten_with_path(module, is_leaf=lambda x: isinstance(x, Variable))
    return [(tuple(_key_name(k) for k in path), v) for path, v in found[0]
            if isinstance(v, Variable)]


def _touching(f: Callable, modules: Callable[[tuple], list[int]]) -> Callable:
    """``f`` writing every Variable of the differentiated module arguments first: so each is
    an output of the call (its value unchanged unless ``f`` changes it), and what later uses
    send back to it reaches ``bwd`` as ``input_updates_g``, as flax.nnx's graph-updates form
    hands out the cotangent of each module's whole state."""
    @functools.wraps(f)
    def touched(*args: Any) -> Any:
        for i in modules(args):
            for _, v in _variables(args[i]):
                v.value = v.value
        return f(*args)
    return touched


class _StateCotangents:
    """flax.nnx's default ``custom_vjp`` (graph updates): ``bwd(*nondiff, res, (input_updates_g,
    out_g))``, ``input_updates_g`` holding per differentiated argument the ``State`` of a
    module's update cotangents (None for another argument), and ``bwd`` returning a
    ``State`` for a module (its Variables missing from it get zero).  An argument given as
    ``DiffState(argnum, filter)`` is differentiated only in the Variables ``filter`` selects
    (``diff``): the others get zero, and ``bwd`` may not return them.  Built on object mode's
    ``custom_vjp`` with ``updates_g``: the module's Variables are all written (``_touching``),
    and ``State``s are read from and made into modules of cotangents by path."""

    def __init__(self, fun: Callable, nondiff_argnums: tuple[int, ...],
                 diff: Mapping[int, Filter]):
        functools.update_wrapper(self, fun)
        self.fun, self.nums, self.diff = fun, nondiff_argnums, diff
        self.custom = object_custom_vjp(_touching(fun, self._modules), nondiff_argnums=nondiff_argnums)

    def _modules(self, args: tuple) -> list[int]:
        return [i for i, a in enumerate(args) if i not in self.nums and isinstance(a, Pytree)]

    def defvjp(self, fwd: Callable, bwd: Callable, symbolic_zeros: bool = False) -> None:
        forward = _without_modules(fwd, self._modules) if symbolic_zeros else \
            _touching(fwd, self._modules)

        def backward(*rest: Any, updates_g: tuple) -> tuple:
            *nondiff, residual, g = rest
            diff = [i for i in range(len(updates_g)) if i not in self.nums]
            modules = [isinstance(updates_g[i], Pytree) for i in diff]
            given = tuple(State.from_flat(dict(_variables(updates_g[i]))) if m else None
                          for i, m in zip(diff, modules))
            tangents = bwd(*nondiff, residual, (given, g))
            return tuple(_module_of(updates_g[i], t, self.diff.get(i)) if m else t
                         for i, m, t in zip(diff, modules, tangents))
        self.custom.defvjp(forward, backward, symbolic_zeros=symbolic_zeros)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = positional(self.fun, args, kwargs)
        for i in self.nums:
            if i < len(args) and objects_in(args[i]):
                raise TypeError("Passing integers to nondiff_argnums for graph nodes arguments "
                                f"in custom_vjp is not supported. Got False at path [{i}] for "
                                f"value {type(args[i]).__name__}.")
        return self.custom(*args)


def _without_modules(fwd: Callable, modules: Callable[[tuple], list[int]]) -> Callable:
    """``fwd`` refusing a differentiated module argument (``symbolic_zeros`` with graph
    updates): its Variables would hold ``CustomVJPPrimal``s as the state the graph-updates
    form returns, where flax.nnx fails with JAX's ``TypeError``."""
    @functools.wraps(fwd)
    def checked(*args: Any) -> Any:
        for i in modules(args):
            path, v = next(iter(_variables(args[i])), ((), None))
            raise errors.InvalidVariablesError(
                f"nnx.custom_vjp: with symbolic_zeros=True, fwd would get argument {i}'s "
                f"module with its Variables holding CustomVJPPrimal values, and with graph "
                "updates their state is an output of fwd, which JAX refuses (flax.nnx fails "
                "with a TypeError there).", path=path,
                collection=getattr(v, "collection", None), **errors.where(),
                fix="use nnx.custom_vjp(..., graph_updates=False) (bwd then returns a module "
                    "of cotangents), or defvjp without symbolic_zeros")
        return fwd(*args)
    return checked


def _module_of(template: Any, given: Any, only: Filter | None) -> Any:
    """The module of cotangents ``bwd`` means by the ``State`` ``given``: ``template`` (the
    module's update cotangents) with each Variable replaced by ``given``'s at its path, or
    by None (a zero) where ``given`` has none; with ``only`` (a ``DiffState``'s filter), a
    Variable it does not select is None, and ``given`` having one is a ``TransformError``
    (flax.nnx's is JAX's ``TypeError`` on the cotangents' structure)."""
    if not isinstance(given, State):
        raise errors.TransformError(
            f"nnx.custom_vjp: bwd returned {type(given).__name__} for a module argument; with "
            "graph updates its cotangent is a State.", **errors.where(),
            fix="return a State (e.g. nnx.clone of the input_updates_g entry, its leaves set)")
    flat = given.flat()
    leaves, tree = jax.tree.flatten(template, is_leaf=lambda x: isinstance(x, Variable))
    by_path = dict(_variables(template))
    out = []
    differentiable = to_predicate(only) if only is not None else lambda p, v: True
    for path, v in zip(by_path, leaves):
        leaf = flat.get(path)
        if not differentiable(path, v):
            if leaf is not None:
                raise errors.TransformError(
                    f"nnx.custom_vjp: bwd returned a cotangent for {'/'.join(map(str, path))}, "
                    f"which the argument's DiffState filter ({only!r}) leaves out: it is not "
                    "differentiated.", path=path, **errors.where(),
                    fix="leave it out of the State bwd returns (del state[...])")
            out.append(None)
            continue
        if leaf is not None and not isinstance(leaf, Variable):
            leaf = jax.tree.unflatten(jax.tree.structure(v), [leaf])
        out.append(leaf)
    return jax.tree.unflatten(tree, out)


class _SameTypeCotangents:
    """flax.nnx's ``custom_vjp(graph_updates=False)`` (and tree mode): object mode's
    ``custom_vjp`` itself, ``bwd(*nondiff, res, g[, updates_g=...])`` returning a module of
    cotangents for a module, as ``jax.custom_vjp`` over pytrees."""

    def __init__(self, fun: Callable, nondiff_argnums: tuple[int, ...]):
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.custom = object_custom_vjp(fun, nondiff_argnums=nondiff_argnums)

    def defvjp(self, fwd: Callable, bwd: Callable, symbolic_zeros: bool = False) -> None:
        self.custom.defvjp(fwd, bwd, symbolic_zeros=symbolic_zeros)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.custom(*positional(self.fun, args, kwargs))


def custom_vjp(fun: Callable | None = None, *, nondiff_argnums: tuple[int | DiffState, ...] = (),
               graph: bool | None = None, graph_updates: bool | None = None
               ) -> Callable[..., Any]:
    """flax.nnx's ``custom_vjp``: with graph updates (the default) ``_StateCotangents``,
    without ``_SameTypeCotangents``; a decorator with options too."""
    graph, updates = resolve(graph, graph_updates)
    seen: set[int] = set()
    for a in nondiff_argnums:
        if isinstance(a, DiffState) and not updates:
            raise ValueError("`nondiff_argnums` cannot contain `DiffState` objects when "
                             "`graph=False` or `graph_updates=False`: pass graph=True and "
                             "graph_updates=True, or remove the DiffState.")
        index = a.argnum if isinstance(a, DiffState) else a
        if index in seen:
            raise ValueError(f"argnum {index} is repeated in nondiff_argnums")
        seen.add(index)
    nums = tuple(a for a in nondiff_argnums if not isinstance(a, DiffState))
    diff = {a.argnum: a.filter for a in nondiff_argnums if isinstance(a, DiffState)}

    def build(f: Callable) -> Any:
        refuse_bound_method(f, "custom_vjp")
        return _StateCotangents(f, nums, diff) if updates else _SameTypeCotangents(f, nums)
    return as_decorator(fun, build)
