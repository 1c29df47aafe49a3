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
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from varjax.lifting import from_tree, lift, partition, to_tree
from varjax.transforms.target import call_direct, reject


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


def jvp(fn: Callable, mdl: Any, primals: tuple, tangents: tuple,
        variable_tangents: Mapping[str, Any], variables: Any = True, rngs: Any = True) -> Any:
    """Lifted ``jax.jvp``: ``(fn(mdl, *primals), tangent_out)``.  ``variable_tangents``
    gives tangents for variables (``{'params': {...}}``, relative to ``mdl``); variables
    of collections it does not name have zero tangent."""
    diff = list(variable_tangents)

    def transform(region: Callable, groups: tuple, rngs_: tuple, primals: tuple,
                  tangents: tuple, var_tangents: Any) -> Any:
        d, rest = groups
        given = from_tree(var_tangents, region.path)
        d_t = {k: given[k] if k in given else _zero_tangent(v) for k, v in d.items()}

        def f(d, *p):
            return region((d, rest), rngs_, *p)
        (out, gs_out), (out_t, _) = jax.jvp(f, (d, *primals), (d_t, *tangents))
        return (out, out_t), gs_out

    lifted = lift(transform, fn, variables=(diff, variables), rngs=(rngs,), name="jvp")
    return call_direct(lifted, mdl, tuple(primals), tuple(tangents), dict(variable_tangents))


def _vjp_back(vjp_fn: Callable, cotangent: Any, *, path: tuple) -> tuple:
    var_grads, *arg_grads = vjp_fn(cotangent)
    return (to_tree(var_grads, path), *arg_grads)


def vjp(fn: Callable, mdl: Any, *primals: Any, has_aux: bool = False, reduce_axes: Any = (),
        vjp_variables: Any = "params", variables: Any = True, rngs: Any = True,
        multi_scope: bool = False) -> Any:
    """Lifted ``jax.vjp``: ``(out, vjp_fn)`` (``(out, vjp_fn, aux)`` with ``has_aux``),
    where ``vjp_fn(ct) -> (variable_grads, *primal_grads)`` and ``variable_grads`` covers
    the ``vjp_variables`` collections.  ``vjp_fn`` may be called after the transform, and
    any module the function closes over is lifted, so ``multi_scope`` is always on."""
    _no_reduce_axes("vjp", reduce_axes)

    def transform(region: Callable, groups: tuple, rngs_: tuple, *primals: Any) -> Any:
        d, rest = groups

        def f(d, *p):
            out, gs_out = region((d, rest), rngs_, *p)
            out, aux = out if has_aux else (out, None)
            return out, (aux, gs_out)
        out, vjp_fn, (aux, gs_out) = jax.vjp(f, d, *primals, has_aux=True)
        back = jax.tree_util.Partial(functools.partial(_vjp_back, path=region.path), vjp_fn)
        return ((out, back, aux) if has_aux else (out, back)), gs_out

    lifted = lift(transform, fn, variables=(vjp_variables, variables), rngs=(rngs,), name="vjp")
    return call_direct(lifted, mdl, *primals)


def value_and_grad(fn: Callable, mdl: Any, *primals: Any, has_aux: bool = False,
                   reduce_axes: Any = (), variables: Any = True, rngs: Any = True) -> Any:
    """Lifted ``jax.value_and_grad`` with respect to every primal (not the variables):
    ``(value, grads)``, or ``((value, aux), grads)``; ``fn`` returns a scalar."""
    _no_reduce_axes("value_and_grad", reduce_axes)

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

    lifted = lift(transform, fn, variables=(variables,), rngs=(rngs,), name="value_and_grad")
    return call_direct(lifted, mdl, *primals)


def grad(fn: Callable, mdl: Any, *primals: Any, has_aux: bool = False, reduce_axes: Any = (),
         variables: Any = True, rngs: Any = True) -> Any:
    """Lifted ``jax.grad`` with respect to every primal: ``grads``, or ``(grads, aux)``."""
    out = value_and_grad(fn, mdl, *primals, has_aux=has_aux, reduce_axes=reduce_axes,
                         variables=variables, rngs=rngs)
    (_, aux), grads = out if has_aux else ((None, None), out[1])
    return (grads, aux) if has_aux else grads


def custom_vjp(fn: Callable, forward_fn: Callable, backward_fn: Callable,
               grad_vars: Any = "params", nondiff_argnums: tuple = ()) -> Callable:
    """Lifted ``jax.custom_vjp``, called as ``f(mdl, *args)``: ``forward_fn(mdl, *args) ->
    (out, residuals)``, ``backward_fn(residuals, ct) -> (variable_grads, *arg_grads)``,
    where ``variable_grads`` covers ``grad_vars`` (``{'params': {...}}``) and
    ``arg_grads`` the arguments not in ``nondiff_argnums``."""
    nondiff = set(nondiff_argnums)

    def transform(r_fn: Callable, r_fwd: Callable, groups: tuple, rngs_: tuple, *args: Any) -> Any:
        dyn_at = [i for i in range(len(args)) if i not in nondiff]
        leaves, rebuild = partition(tuple(args[i] for i in dyn_at))

        def full(arrays: tuple) -> list:
            dyn = rebuild(arrays)
            return [args[i] if i in nondiff else dyn[dyn_at.index(i)] for i in range(len(args))]

        @jax.custom_vjp
        def f(d, rest, ks, *arrays):
            return r_fn((d, rest), ks, *full(arrays))

        def f_fwd(d, rest, ks, *arrays):
            (out, res), gs_out = r_fwd((d, rest), ks, *full(arrays))
            return (out, gs_out), (res, _zeros((rest, ks)), _zeros(d))

        def f_bwd(saved, cotangent):
            res, rest_ks_zero, d_zero = saved
            var_grads, *arg_grads = backward_fn(res, cotangent[0])
            given = from_tree(var_grads, r_fn.path)
            d_grad = {k: given.get(k, z) for k, z in d_zero.items()}
            dyn_grads = [g for g in arg_grads]
            leaves_grads, _ = partition(tuple(dyn_grads))
            return (d_grad, *rest_ks_zero, *leaves_grads)
        f.defvjp(f_fwd, f_bwd)
        return f(*groups, rngs_, *leaves)

    lifted = lift(transform, fn, forward_fn, variables=(grad_vars, True), name="custom_vjp")
    return lambda mdl, *args: call_direct(lifted, mdl, *args)


def custom_jvp(fn: Callable, jvp_fn: Callable, nondiff_argnums: tuple = ()) -> Callable:
    """Lifted ``jax.custom_jvp`` (Flax has none), called as ``f(mdl, *args)``:
    ``jvp_fn(mdl, *nondiff_args, primals, tangents) -> (out, tangent_out)``.  Variables
    are constants of the rule; writes in ``fn`` are kept, with zero tangent."""
    nondiff = set(nondiff_argnums)

    def transform(r_fn: Callable, r_jvp: Callable, groups: tuple, rngs_: tuple, *args: Any) -> Any:
        dyn_at = [i for i in range(len(args)) if i not in nondiff]
        fixed = [args[i] for i in sorted(nondiff)]
        leaves, rebuild = partition(tuple(args[i] for i in dyn_at))

        def full(arrays: tuple) -> list:
            dyn = rebuild(arrays)
            return [args[i] if i in nondiff else dyn[dyn_at.index(i)] for i in range(len(args))]

        @jax.custom_jvp
        def f(*arrays):
            return r_fn(groups, rngs_, *full(arrays))

        @f.defjvp
        def f_jvp(primals, tangents):
            (out, out_t), gs_out = r_jvp(groups, rngs_, *fixed, rebuild(primals), rebuild(tangents))
            return (out, gs_out), (out_t, _zeros(gs_out))
        return f(*leaves)

    lifted = lift(transform, fn, jvp_fn, name="custom_jvp")
    return lambda mdl, *args: call_direct(lifted, mdl, *args)
