"""Lifted ``jvp``, ``vjp``, ``grad``, ``value_and_grad``, ``custom_vjp`` and
``custom_jvp``.

Variables are differentiated only where a filter says so (``vjp_variables``,
the collections of ``variable_tangents``, ``custom_vjp``'s ``grad_vars``);
all others are constants of the derivative.  Variable gradients and tangents
are Linen's nested ``{collection: {...}}`` dicts, relative to the module.
Writes inside the differentiated function (batch statistics) are kept, with
no derivative.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from varjax.ir.protocols import LiftableModule
from varjax.ir.typing import AxisName, CollectionFilter, Passes, PyTree, StreamFilter
from varjax.lifting.groups import group_to_variables, is_array, partition, variables_to_group
from varjax.lifting.region import lift
from varjax.objects import object_transforms as objects
from varjax.objects.custom_vjp import custom_vjp as object_custom_vjp
from varjax.transforms.common import NO_INIT, call_direct, object_options, reject, unbound


def _zero_tangent(x: Any) -> Any:
    dtype = jnp.result_type(x) if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else None
    if dtype is not None and jnp.issubdtype(dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


def _zeros(tree: Any) -> Any:
    return jax.tree.map(_zero_tangent, tree)


def _no_reduce_axes(name: str, reduce_axes: Any) -> None:
    reject(bool(reduce_axes), name, "reduce_axes is deprecated in JAX and not supported.",
           "sum the gradients yourself (e.g. with jax.lax.psum)")


def jvp(fn: Callable, mdl: LiftableModule | None, primals: tuple, tangents: tuple,
        variable_tangents: Mapping[str, Any], variables: CollectionFilter = True,
        rngs: StreamFilter = True) -> tuple[PyTree, PyTree]:
    """Lifted ``jax.jvp``: ``(fn(mdl, *primals), tangent_out)``.  ``variable_tangents``
    gives tangents for variables (``{'params': {...}}``, relative to ``mdl``); variables
    of collections it does not name have zero tangent."""
    diff = list(variable_tangents)

    def transform(region: Callable, groups: tuple, rngs_: tuple, primals: tuple,
                  tangents: tuple, var_tangents: Any) -> Any:
        d, rest = groups
        given = variables_to_group(var_tangents, region.path)
        d_t = {k: given[k] if k in given else _zero_tangent(v) for k, v in d.items()}

        def f(d, *p):
            return region((d, rest), rngs_, *p)
        (out, gs_out), (out_t, _) = jax.jvp(f, (d, *primals), (d_t, *tangents))
        return (out, out_t), gs_out

    lifted = lift(transform, unbound(fn), variables=(diff, variables), rngs=(rngs,), name="jvp")
    return call_direct(lifted, mdl, tuple(primals), tuple(tangents), dict(variable_tangents))


def _vjp_back(vjp_fn: Callable, cotangent: Any, *, path: tuple) -> tuple:
    var_grads, *arg_grads = vjp_fn(cotangent)
    return (group_to_variables(var_grads, path), *arg_grads)


def vjp(fn: Callable, mdl: LiftableModule | None, *primals: Any, has_aux: bool = False,
        reduce_axes: Sequence[AxisName] = (), vjp_variables: CollectionFilter = "params",
        variables: CollectionFilter = True, rngs: StreamFilter = True,
        multi_scope: bool = False
        ) -> tuple[PyTree, Callable[..., tuple]] | tuple[PyTree, Callable[..., tuple], PyTree]:
    """Lifted ``jax.vjp``: ``(out, vjp_fn)`` (``(out, vjp_fn, aux)`` with ``has_aux``),
    where ``vjp_fn(ct) -> (variable_grads, *primal_grads)`` and ``variable_grads`` covers
    the ``vjp_variables`` collections.  ``vjp_fn`` may be called after the transform, and
    any module the function closes over is lifted, so ``multi_scope`` is always on."""
    _no_reduce_axes("vjp", reduce_axes)

    def transform(region: Callable, groups: tuple, rngs_: tuple, *primals: Any) -> Any:
        # The groups hold the module's own variables (as in Linen) and those of any other
        # module the function reads (varjax.lifting.region hands closures in); all are
        # differentiated, every other variable is a constant.
        d, rest = groups

        def f(d, *p):
            out, gs_out = region((d, rest), rngs_, *p)
            out, aux = out if has_aux else (out, None)
            return out, (aux, gs_out)
        out, vjp_fn, (aux, gs_out) = jax.vjp(f, d, *primals, has_aux=True)
        back = jax.tree_util.Partial(functools.partial(_vjp_back, path=region.path), vjp_fn)
        return ((out, back, aux) if has_aux else (out, back)), gs_out

    lifted = lift(transform, unbound(fn), variables=(vjp_variables, variables), rngs=(rngs,), name="vjp")
    return call_direct(lifted, mdl, *primals)


def value_and_grad(fn: Callable, mdl: LiftableModule | None = NO_INIT, *primals: Any,
                   has_aux: bool = False, reduce_axes: Sequence[AxisName] = (),
                   variables: CollectionFilter = True, rngs: StreamFilter = True,
                   argnums: int | Sequence[int] = 0, passes: Passes = ()
                   ) -> tuple[PyTree, PyTree] | Callable[..., Any]:
    """Lifted ``jax.value_and_grad`` with respect to every primal (not the variables):
    ``(value, grads)``, or ``((value, aux), grads)``; ``fn`` returns a scalar.

    ``vj.value_and_grad(fn, argnums=..., has_aux=...)`` (no module): the object-mode form,
    a function differentiating every float variable of its ``argnums`` arguments.
    ``passes``: passes run on ``fn``'s IR before it is differentiated (``vj.lift``; in
    object mode, as ``vj.jit``'s)."""
    _no_reduce_axes("value_and_grad", reduce_axes)
    if mdl is NO_INIT:
        object_options("value_and_grad", lambda f: f, variables=(variables, True),
                       rngs=(rngs, True))(fn)
        return objects.value_and_grad(fn, argnums=argnums, has_aux=has_aux, passes=passes)
    reject(argnums != 0, "value_and_grad", "argnums= is for the object-mode form; the lifted "
           "form differentiates every primal.", "drop argnums, or call vj.value_and_grad(fn, "
           "argnums=...) without the module")

    def transform(region: Callable, groups: tuple, rngs_: tuple, *primals: Any) -> Any:
        def f(*p):
            out, gs_out = region(groups, rngs_, *p)
            out, aux = out if has_aux else (out, None)
            reject(jnp.shape(out) != (), "value_and_grad", "fn must return a scalar, got shape "
                   f"{jnp.shape(out)}.", "reduce the output (e.g. with .sum()) or use vj.vjp")
            return out, (aux, gs_out)
        (value, (aux, gs_out)), grads = jax.value_and_grad(
            f, argnums=tuple(range(len(primals))), has_aux=True)(*primals)
        return (((value, aux), grads) if has_aux else (value, grads)), gs_out

    lifted = lift(transform, unbound(fn), variables=(variables,), rngs=(rngs,),
                  name="value_and_grad", passes=passes)
    return call_direct(lifted, mdl, *primals)


def grad(fn: Callable, mdl: LiftableModule | None = NO_INIT, *primals: Any,
         has_aux: bool = False, reduce_axes: Sequence[AxisName] = (),
         variables: CollectionFilter = True, rngs: StreamFilter = True,
         argnums: int | Sequence[int] = 0, passes: Passes = ()) -> PyTree | Callable[..., Any]:
    """Lifted ``jax.grad`` with respect to every primal: ``grads``, or ``(grads, aux)``.
    Without a module, the object-mode ``vj.grad(fn, argnums=..., has_aux=...)``.
    ``passes``: as ``value_and_grad``'s."""
    if mdl is NO_INIT:
        _no_reduce_axes("grad", reduce_axes)
        object_options("grad", lambda f: f, variables=(variables, True), rngs=(rngs, True))(fn)
        return objects.grad(fn, argnums=argnums, has_aux=has_aux, passes=passes)
    out = value_and_grad(fn, mdl, *primals, has_aux=has_aux, reduce_axes=reduce_axes,
                         variables=variables, rngs=rngs, argnums=argnums, passes=passes)
    (_, aux), grads = out if has_aux else ((None, None), out[1])
    return (grads, aux) if has_aux else grads


def _arg_leaves(args: tuple, nondiff: set[int]) -> tuple[list, Callable, list[bool]]:
    """The array leaves of ``args`` (passed into ``jax.custom_vjp``/``custom_jvp``
    explicitly: a closed-over tracer would leak into the lazily traced rules), a function
    rebuilding ``args`` from new leaves, and whether each leaf is in a nondiff argument."""
    leaves, rebuild = partition(args)
    in_nondiff = []
    for i, arg in enumerate(args):
        in_nondiff += [i in nondiff] * sum(map(is_array, jax.tree.leaves(arg)))
    return leaves, rebuild, in_nondiff


def _positions(nondiff_argnums: Any, mdl: Any, name: str) -> set[int]:
    """``nondiff_argnums`` count ``fn``'s parameters, the module first (as in Linen and
    JAX); the lifted call sees the arguments after the module."""
    nums = (nondiff_argnums,) if isinstance(nondiff_argnums, int) else tuple(nondiff_argnums)
    shift = 0 if mdl is None else 1
    reject(bool(shift) and 0 in nums, name, "nondiff_argnums includes 0, the module.",
           "list only positions of the other arguments (the module is position 0)")
    return {i - shift for i in nums}


def _per_nondiff(make: Callable[[set[int]], Callable], nondiff_argnums: Any,
                 name: str) -> Callable:
    """``f(mdl, *args)`` calling ``make(nondiff positions)``'s lift, one lift per set of
    positions (they shift by one when there is a module)."""
    lifts: dict[frozenset, Callable] = {}

    def call(mdl: Any, *args: Any) -> Any:
        nondiff = frozenset(_positions(nondiff_argnums, mdl, name))
        if nondiff not in lifts:
            lifts[nondiff] = make(set(nondiff))
        return call_direct(lifts[nondiff], mdl, *args)
    return call


def custom_vjp(fn: Callable, forward_fn: Callable | None = None,
               backward_fn: Callable | None = None, grad_vars: CollectionFilter = "params",
               nondiff_argnums: tuple = ()) -> Callable[..., Any]:
    """Lifted ``jax.custom_vjp``, called as ``f(mdl, *args)``: ``forward_fn(mdl, *args) ->
    (out, residuals)``, ``backward_fn(*nondiff_args, residuals, ct) -> (variable_grads,
    *arg_grads)``, where ``variable_grads`` covers ``grad_vars`` (``{'params': {...}}``,
    relative to ``mdl``) and ``arg_grads`` the arguments not in ``nondiff_argnums``.
    ``nondiff_argnums`` count ``fn``'s parameters, ``mdl`` being 0 (as in Linen).

    ``f = vj.custom_vjp(fn, nondiff_argnums=...); f.defvjp(fwd, bwd)`` (no rules given):
    the object-mode form, as ``jax.custom_vjp`` (``varjax.objects.custom_vjp``)."""
    if forward_fn is None and backward_fn is None:
        object_options("custom_vjp", lambda f: f, grad_vars=(grad_vars, "params"))(fn)
        return object_custom_vjp(fn, nondiff_argnums=nondiff_argnums)

    def make(nondiff: set[int]) -> Callable:
        def transform(r_fn: Callable, r_fwd: Callable, groups: tuple, rngs_: tuple,
                      *args: Any) -> Any:
            leaves, rebuild, in_nondiff = _arg_leaves(args, nondiff)

            @jax.custom_vjp
            def f(d, rest, ks, *arrays):
                return r_fn((d, rest), ks, *rebuild(arrays))

            def f_fwd(d, rest, ks, *arrays):
                (out, res), gs_out = r_fwd((d, rest), ks, *rebuild(arrays))
                return (out, gs_out), (res, arrays, _zeros((rest, ks)), _zeros(d))

            def f_bwd(saved, cotangent):
                res, arrays, rest_ks_zero, d_zero = saved
                full = rebuild(arrays)
                var_grads, *arg_grads = backward_fn(*(full[i] for i in sorted(nondiff)), res,
                                                    cotangent[0])
                given = variables_to_group(_without_none(var_grads), r_fn.path)
                d_grad = {k: given.get(k, z) for k, z in d_zero.items()}
                dyn = [i for i in range(len(args)) if i not in nondiff]
                reject(len(arg_grads) != len(dyn), "custom_vjp", f"backward_fn returned "
                       f"{len(arg_grads)} argument gradients for {len(dyn)} differentiable "
                       "arguments.", "return (variable_grads, *grads), one per argument not "
                       "in nondiff_argnums")
                grads = iter(arg_grads)
                leaf_grads = []
                for i, arg in enumerate(args):
                    flat = jax.tree.leaves(arg)
                    g = (_per_leaf(next(grads), arg, dyn.index(i))
                         if i not in nondiff else [None] * len(flat))
                    leaf_grads += [gx for gx, x in zip(g, flat) if is_array(x)]
                leaf_grads = [_zero_tangent(x) if g is None or skip else g
                              for g, x, skip in zip(leaf_grads, arrays, in_nondiff)]
                return (d_grad, *rest_ks_zero, *leaf_grads)
            f.defvjp(f_fwd, f_bwd)
            return f(*groups, rngs_, *leaves)
        return lift(transform, unbound(fn), unbound(forward_fn), variables=(grad_vars, True),
                    name="custom_vjp")

    return _per_nondiff(make, nondiff_argnums, "custom_vjp")


def _without_none(var_grads: Any) -> Any:
    """``backward_fn``'s variable gradients without the entries it gave as None: as in
    ``jax.custom_vjp``, None anywhere stands for a zero cotangent of everything below it."""
    if var_grads is None:
        return {}
    if not isinstance(var_grads, Mapping):
        return var_grads       # variables_to_group says what is wrong with it
    return {k: _without_none(v) for k, v in var_grads.items() if v is not None}


def _per_leaf(grad: Any, arg: Any, index: int) -> list:
    """``grad``, ``backward_fn``'s gradient for the argument ``arg``, as one entry per leaf
    of ``arg``: None anywhere (JAX's zero cotangent) is None for every leaf below it."""
    out: list = []

    def put(g: Any, sub: Any) -> None:
        out.extend([g] * len(jax.tree.leaves(sub)))
    try:
        jax.tree.map(put, grad, arg, is_leaf=lambda g: g is None)
        fits = True
    except ValueError:
        fits = False
    reject(not fits, "custom_vjp", f"argument gradient {index} of backward_fn has structure "
           f"{jax.tree.structure(grad)}, but its argument has structure "
           f"{jax.tree.structure(arg)}.", "return each gradient with its argument's "
           "structure, or None for a zero gradient")
    return out


def _instantiate(t: Any, x: Any) -> Any:
    return _zero_tangent(x) if isinstance(t, SymbolicZero) else t


def custom_jvp(fn: Callable, jvp_fn: Callable, nondiff_argnums: tuple = ()) -> Callable:
    """Lifted ``jax.custom_jvp`` (Flax has none), called as ``f(mdl, *args)``:
    ``jvp_fn(mdl, *nondiff_args, primals, tangents) -> (out, tangent_out)``, where
    ``primals`` and ``tangents`` are tuples of the other arguments.  ``nondiff_argnums``
    count ``fn``'s parameters, ``mdl`` being 0.  The rule covers the arguments; the
    variables are differentiated through ``fn`` by ordinary autodiff (only when a tangent
    for them is requested).  Writes in ``fn`` are kept, with zero tangent."""

    def make(nondiff: set[int]) -> Callable:
        def transform(r_fn: Callable, r_jvp: Callable, groups: tuple, rngs_: tuple,
                      *args: Any) -> Any:
            leaves, rebuild, _ = _arg_leaves(args, nondiff)
            dyn = [i for i in range(len(args)) if i not in nondiff]

            @jax.custom_jvp
            def f(gs, ks, *arrays):
                return r_fn(gs, ks, *rebuild(arrays))

            def f_jvp(primals, tangents):
                gs, ks, *arrays = primals
                gs_t, _, *arrays_t = tangents
                full = rebuild(arrays)
                full_t = rebuild([_instantiate(t, x) for t, x in zip(arrays_t, arrays)])
                (out, out_t), gs_out = r_jvp(gs, ks, *(full[i] for i in sorted(nondiff)),
                                             tuple(full[i] for i in dyn),
                                             tuple(full_t[i] for i in dyn))
                is_zero = lambda t: isinstance(t, SymbolicZero)  # noqa: E731
                gs_t = jax.tree.leaves(gs_t, is_leaf=is_zero)
                perturbed = any(not is_zero(t) for t in gs_t)
                if perturbed or r_jvp.writes != r_fn.writes:
                    # The variables are differentiated through fn itself; where the rule
                    # writes other variables than fn (or none), fn's writes are the call's.
                    gs_tan = jax.tree.unflatten(jax.tree.structure(gs), [
                        _instantiate(t, x) for t, x in zip(gs_t, jax.tree.leaves(gs))])
                    (_, gs_out), (var_out_t, _) = jax.jvp(
                        lambda g: r_fn(g, ks, *full), (gs,), (gs_tan,))
                    if perturbed:
                        out_t = jax.tree.map(jnp.add, out_t, var_out_t)
                return (out, gs_out), (out_t, _zeros(gs_out))
            f.defjvp(f_jvp, symbolic_zeros=True)
            return f(groups, rngs_, *leaves)
        return lift(transform, fn, jvp_fn, name="custom_jvp")

    return _per_nondiff(make, nondiff_argnums, "custom_jvp")
