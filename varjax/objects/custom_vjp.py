"""Object-mode ``vj.custom_vjp``: ``jax.custom_vjp`` over objects, their Variables read and
written as IR effects of one trace.

``fn`` and ``fwd`` run through ``run`` (a functionalized trace) on JAX's copies of the
arguments, so the Variables they update come out of the call as its ``Result`` and are
written back to the caller's objects, as for every object-mode transform.  ``bwd`` gets
what ``jax.custom_vjp``'s gets: the ``nondiff_argnums`` arguments first, then ``fwd``'s
residuals and the output's cotangent, and returns one cotangent per other argument, shaped
like it (a module of cotangents for a module).

A Variable updated inside is an output of the call too.  Its cotangent (what later uses of
the updated value send back) is handed to ``bwd`` when ``bwd`` takes an ``updates_g``
keyword: the arguments' structure, each updated Variable holding its cotangent and every
other leaf None.  Otherwise it is dropped, as flax.nnx's ``custom_vjp`` drops it: the
update is a constant of the derivative (a BatchNorm's running statistics under ``grad``).

``defvjp(fwd, bwd, symbolic_zeros=True)`` is ``jax.custom_vjp``'s: ``fwd`` gets each array
of the differentiated arguments as a ``CustomVJPPrimal(value, perturbed)``, a Variable's
value included (so ``fwd`` reads ``v.value.value``, and writes a plain value), and
``bwd`` gets ``SymbolicZero`` for each cotangent that is zero, ``updates_g``'s too.  A
Variable's value there is no array, so ``fwd`` cannot run as a trace of Variable effects:
it runs on JAX's copies of the arguments directly, and the Variables whose values it
replaced are its updates (``_primal_call``), as flax.nnx's tree-mode ``custom_vjp`` finds
them.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal

from varjax.ir import errors
from varjax.objects.aliasing import shared_again
from varjax.objects.graph import ArgumentGraphs, Graph
from varjax.objects.object_transforms import dealias
from varjax.objects.run import Result, arg_names, graph_of, run
from varjax.trace.variable import Variable

__all__ = ["custom_vjp"]


def _takes_updates_g(bwd: Callable) -> bool:
    try:
        return "updates_g" in inspect.signature(bwd).parameters
    except (TypeError, ValueError):
        return False


class custom_vjp:  # noqa: N801  (named as jax.custom_vjp, which it mirrors)
    """``jax.custom_vjp`` over objects (see the module docstring): ``f =
    vj.custom_vjp(fn, nondiff_argnums=...); f.defvjp(fwd, bwd)``, ``fwd(*args) -> (out,
    residuals)``, ``bwd(*nondiff_args, residuals, g[, updates_g=...]) -> cotangents``."""

    def __init__(self, fn: Callable, *, nondiff_argnums: Sequence[int] = ()):
        functools.update_wrapper(self, fn)
        self.fn, self.nondiff_argnums = fn, tuple(nondiff_argnums)
        self.names = arg_names(fn)
        self.fwd: Callable | None = None
        self.bwd: Callable | None = None
        self.symbolic_zeros = False
        self._graphs = ArgumentGraphs()

    def defvjp(self, fwd: Callable, bwd: Callable, symbolic_zeros: bool = False) -> None:
        self.fwd, self.bwd, self.symbolic_zeros = fwd, bwd, symbolic_zeros

    @errors.api_boundary
    def __call__(self, *args: Any) -> Any:
        if self.fwd is None or self.bwd is None:
            raise errors.TransformError(
                f"vj.custom_vjp: {self._name()} was called before defvjp(fwd, bwd).",
                **errors.where(), fix="call f.defvjp(fwd, bwd) first")
        graph = self._graphs.of(args, {}, lambda: graph_of(args, {}, self.names))
        layout, shared = graph.layout(), graph.shared()
        diff = [i for i in range(len(args)) if i not in self.nondiff_argnums]
        avals = [jax.tree.map(jax.typeof, args[i]) for i in diff]
        nondiff = _Nondiff(args, self.nondiff_argnums)

        def traced(fn: Callable, xs: tuple) -> tuple[Any, Result]:
            a = nondiff.args(xs[:len(diff)], xs[len(diff):])
            a, _ = dealias(a, {}, layout.places)
            return run(fn, a, {}, graph=Graph.copies(layout, (a, {})), shared=shared)

        def forward(*xs: Any) -> tuple[tuple[Any, Result], Any]:
            if self.symbolic_zeros:
                arrays = _values(xs[len(diff):])
                a, _ = dealias(nondiff.args(xs[:len(diff)], arrays), {}, layout.places)
                (out, residuals), result = _primal_call(self.fwd, a, layout)
                return (out, result), (residuals, arrays)
            (out, residuals), result = traced(self.fwd, xs)
            return (out, result), (residuals, xs[len(diff):])

        # The Variables' treedefs, read now: at bwd time an enclosing trace may be gone.
        structures = ([jax.tree.structure(n.obj) if isinstance(n.obj, Variable) else None
                       for n in graph.nodes] if _takes_updates_g(self.bwd) else None)

        def backward(saved: Any, cotangent: Any) -> tuple:
            (residuals, arrays), (g, result_g) = saved, cotangent
            extra = ({} if structures is None else
                     {"updates_g": _updates_g(graph, structures, result_g.updates)})
            cotangents = tuple(self.bwd(*nondiff.values(arrays), residuals, g, **extra))
            if len(cotangents) != len(diff):
                raise errors.TransformError(
                    f"vj.custom_vjp: the bwd of {self._name()} returned {len(cotangents)} "
                    f"cotangents for {len(diff)} differentiable arguments.", **errors.where(),
                    fix="return one cotangent per argument not in nondiff_argnums")
            return (*(jax.tree.map(_cotangent, ct, x, is_leaf=lambda c: c is None)
                      for ct, x in zip(cotangents, avals)), *(None for _ in arrays))
        f = jax.custom_vjp(lambda *xs: traced(self.fn, xs))
        f.defvjp(forward, backward, symbolic_zeros=self.symbolic_zeros)
        out, result = f(*(args[i] for i in diff), *nondiff.arrays)
        graph.write_back(result.updates, result.created)
        return out

    def _name(self) -> str:
        return getattr(self.fn, "__name__", "the function")


class _Nondiff:
    """The ``nondiff_argnums`` arguments, passed to ``jax.custom_vjp`` as their array leaves
    (inputs whose cotangent is zero, kept as residuals for ``bwd``) and their other leaves
    (static): JAX refuses a tracer in its own ``nondiff_argnums``, and a nondiff object's
    Variables are traced under ``jit``."""

    def __init__(self, args: tuple, nums: tuple[int, ...]):
        self.nums, self.n = sorted(nums), len(args)
        self.trees, self.leaves, self.arrays = [], [], []
        for i in self.nums:
            leaves, tree = jax.tree.flatten(args[i])
            self.trees.append(tree)
            self.leaves.append(leaves)
            self.arrays += [x for x in leaves if isinstance(x, jax.Array)]

    def values(self, arrays: Sequence[Any]) -> list[Any]:
        """The nondiff arguments, in order, their array leaves ``arrays``."""
        given = iter(arrays)
        return [jax.tree.unflatten(tree, [next(given) if isinstance(x, jax.Array) else x
                                          for x in leaves])
                for tree, leaves in zip(self.trees, self.leaves)]

    def args(self, diff: Sequence[Any], arrays: Sequence[Any]) -> tuple:
        """All arguments, in order: ``diff`` at the other positions."""
        nondiff, diff = dict(zip(self.nums, self.values(arrays))), iter(diff)
        return tuple(nondiff[i] if i in nondiff else next(diff) for i in range(self.n))


def _values(tree: Any) -> Any:
    """``tree`` with each ``CustomVJPPrimal`` its value (the nondiff arguments' arrays,
    which ``jax.custom_vjp`` sees as differentiated)."""
    return jax.tree.map(lambda p: p.value, tree, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))


def _primal_call(fwd: Callable, args: tuple, layout: Any) -> tuple[Any, Result]:
    """``fwd(*args)`` on JAX's copies as they are (``symbolic_zeros``: their Variables hold
    ``CustomVJPPrimal``s, which no trace of Variable effects can read), and the ``Result``
    of its updates: each Variable whose value ``fwd`` replaced, by cell."""
    graph = Graph.copies(layout, (args, {}))
    before = [cell.get() for _, cell in graph.cells]
    if layout.shares_objects:      # a module held twice is one inside, as in every trace
        args, _ = shared_again((args, {}), layout.objects)
    out = fwd(*args)
    updates = [None if (now := cell.get()) is was else now
               for (_, cell), was in zip(graph.cells, before)]
    return out, Result(updates, [{} for _ in graph.nodes], {})


def _updates_g(graph: Graph, structures: list[Any], cotangents: list[Any]) -> tuple:
    """The arguments' structure with each Variable updated inside holding its update's
    cotangent (a Variable of its class) and every other leaf None.  Only Variables passed
    as nodes (NNX modules hold theirs so) are covered: another node's updates (an ``Rngs``'
    counts, a bound module's) have None."""
    per_node: list[Any] = []
    start = 0
    for node, structure in zip(graph.nodes, structures):
        stop = start + len(node.cells)
        ct = cotangents[start] if stop == start + 1 else None
        if structure is not None and ct is not None:
            per_node.append(jax.tree.unflatten(structure, [ct]))
        else:
            per_node.append(None)
        start = stop
    places = iter(graph.places)
    leaves = [per_node[next(places)] if is_object else None for is_object in graph.is_object]
    args, _ = jax.tree.unflatten(graph.treedef, leaves)
    return tuple(args)


def _cotangent(ct: Any, aval: Any) -> Any:
    """A cotangent JAX accepts for a primal of type ``aval``: ``float0`` for integers, and
    None (JAX's zero, for a whole subtree) as it is."""
    if ct is None or jnp.issubdtype(aval.dtype, jnp.inexact):
        return ct
    return jnp.zeros(aval.shape, jax.dtypes.float0)
