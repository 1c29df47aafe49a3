"""Discharge rules for calls, loops and conditionals.

* ``jit`` / ``closed_call`` / ``checkpoint``: the body gets leading inputs for the
  variables it needs and trailing outputs for those it may write, and the equation passes
  them in and out (variables may be created inside);
* ``scan`` / ``while``: variables read but never written in the body enter as loop
  constants; written ones are carried, so their value on entry must exist and their type
  must not change;
* ``cond``: every branch takes the union of what any branch needs and returns the union
  of what any branch writes; a branch that does not write a variable passes it through.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from varjax import _jax
from varjax.ir import errors, nested
from varjax.ir.primitives import Key
from varjax.passes.default.discharge.discharger import (
    Discharger,
    Env,
    check_same,
    leaves_of,
    register_discharge_rule,
    require,
    split_vars,
    store,
    var_type,
)
from varjax.passes.framework.analysis import traffic
from varjax.passes.framework.rewrite import Region

ClosedJaxpr = _jax.ClosedJaxpr

# --- call-like: jit, closed_call, checkpoint ---------------------------------------------

def _call(d: Discharger, eqn: _jax.JaxprEqn, invals: list[Any], env: Env, region: Region,
          body: ClosedJaxpr, params_for: Callable[[ClosedJaxpr, int, int], dict]) -> list[Any]:
    """The rule of every call-like primitive; ``params_for(new_body, n_var_in, n_var_out)``
    gives the rebuilt equation's params."""
    t = traffic(body)
    in_keys, out_keys = sorted(t.needs), sorted(t.may_write)
    require(eqn, in_keys, env, f"'{eqn.primitive.name}'")
    in_types = [(k, var_type(env[k])) for k in in_keys]
    new, out_types = d.body(body, in_types, out_keys)
    var_in = leaves_of(env, in_keys)
    n_out = sum(len(vt.avals) for vt in out_types)
    outs = region.bind(eqn, [*var_in, *invals], params_for(new, len(var_in), n_out))
    return store(env, out_keys, out_types, outs)


@register_discharge_rule(_jax.jit_p)
def _jit(d: Discharger, eqn: _jax.JaxprEqn, invals: list[Any], env: Env,
         region: Region) -> list[Any]:
    return _call(d, eqn, invals, env, region, eqn.params["jaxpr"],
                 lambda new, n_in, n_out: _jax.jit_params_with(eqn.params, new, n_in, n_out))


@register_discharge_rule(_jax.closed_call_p)
def _closed_call(d: Discharger, eqn: _jax.JaxprEqn, invals: list[Any], env: Env,
                 region: Region) -> list[Any]:
    return _call(d, eqn, invals, env, region, eqn.params["call_jaxpr"],
                 lambda new, n_in, n_out: dict(eqn.params, call_jaxpr=new))


@register_discharge_rule(_jax.remat_p)
def _remat(d: Discharger, eqn: _jax.JaxprEqn, invals: list[Any], env: Env,
           region: Region) -> list[Any]:
    return _call(d, eqn, invals, env, region, nested.closed(eqn.params["jaxpr"]),
                 lambda new, n_in, n_out: dict(eqn.params, jaxpr=nested.const_free(new)))


# --- loops -------------------------------------------------------------------------------

def _loop_keys(eqn, env, bodies: Sequence[ClosedJaxpr]) -> tuple[list[Key], list[Key]]:
    ts = [traffic(b) for b in bodies]
    written = frozenset().union(*(t.may_write for t in ts))
    needed = frozenset().union(*(t.needs for t in ts))
    carried, consts = sorted(written), sorted(needed - written)
    require(eqn, carried + consts, env, f"the body of '{eqn.primitive.name}' (a loop)")
    return carried, consts


@register_discharge_rule(_jax.scan_p)
def _scan(d: Discharger, eqn: _jax.JaxprEqn, invals: list[Any], env: Env,
          region: Region) -> list[Any]:
    p = eqn.params
    body = p["jaxpr"]
    carried, consts_k = _loop_keys(eqn, env, [body])
    nc, nk = p["num_consts"], p["num_carry"]
    consts, carry, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
    types = [var_type(env[k]) for k in carried]

    def step(state, x):
        var_leaves, c = state
        benv = Env((k, env[k]) for k in consts_k)
        benv.update(split_vars([v for vs in var_leaves for v in vs], list(zip(carried, types)))[0])
        outs = d.run_body(body, benv, [*consts, *c, *x])
        check_same(eqn, carried, types, [var_type(benv[k]) for k in carried], "this scan body")
        return ([benv[k][1] for k in carried], outs[:nk]), outs[nk:]

    with _jax.source_info_of(eqn):
        (final_vars, final_carry), ys = jax.lax.scan(
            step, ([env[k][1] for k in carried], list(carry)), list(xs), length=p["length"],
            reverse=p["reverse"], unroll=p["unroll"])
    for k, vt, vals in zip(carried, types, final_vars):
        env[k] = (vt.tree, list(vals))
    return [*final_carry, *ys]


@register_discharge_rule(_jax.while_p)
def _while(d: Discharger, eqn: _jax.JaxprEqn, invals: list[Any], env: Env,
           region: Region) -> list[Any]:
    p = eqn.params
    cond_j, body_j = p["cond_jaxpr"], p["body_jaxpr"]
    if traffic(cond_j).may_write:
        k = sorted(traffic(cond_j).may_write)[0]
        raise errors.UnsupportedPrimitiveError(
            "a while_loop cond_fun writes this variable; cond_fun must be side-effect free.",
            collection=k[0], path=k[1], **errors.where(eqn.source_info),
            fix="move the write into body_fun")
    carried, consts_k = _loop_keys(eqn, env, [cond_j, body_j])
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    types = [var_type(env[k]) for k in carried]

    def loop_env(var_leaves):
        benv = Env((k, env[k]) for k in consts_k)
        benv.update(split_vars([v for vs in var_leaves for v in vs], list(zip(carried, types)))[0])
        return benv

    def cond_fn(state):
        var_leaves, c = state
        return d.run_body(cond_j, loop_env(var_leaves), [*cconsts, *c])[0]

    def body_fn(state):
        var_leaves, c = state
        benv = loop_env(var_leaves)
        outs = d.run_body(body_j, benv, [*bconsts, *c])
        check_same(eqn, carried, types, [var_type(benv[k]) for k in carried], "this while_loop body")
        return [benv[k][1] for k in carried], outs

    with _jax.source_info_of(eqn):
        final_vars, final = jax.lax.while_loop(cond_fn, body_fn, ([env[k][1] for k in carried], list(init)))
    for k, vt, vals in zip(carried, types, final_vars):
        env[k] = (vt.tree, list(vals))
    return list(final)


# --- conditionals ------------------------------------------------------------------------

@register_discharge_rule(_jax.cond_p)
def _cond(d: Discharger, eqn: _jax.JaxprEqn, invals: list[Any], env: Env,
          region: Region) -> list[Any]:
    branches = eqn.params["branches"]
    ts = [traffic(b) for b in branches]
    out_keys = sorted(frozenset().union(*(t.may_write for t in ts)))
    needed = frozenset().union(*(t.needs | (frozenset(out_keys) - t.must_write) for t in ts))
    for k in sorted(needed):
        if k not in env:
            makers = _branches(i for i, t in enumerate(ts) if k in t.may_write)
            others = _branches(i for i, t in enumerate(ts) if k not in t.must_write)
            raise errors.VariableCreationError(
                f"this variable is created in {makers} of a conditional but not in {others}, "
                "so after the conditional it may have no value"
                + (" (lax.cond: branch 0 is false_fun, branch 1 is true_fun)." if len(ts) == 2
                   else "."),
                collection=k[0], path=k[1], **errors.where(eqn.source_info),
                fix="create it before the conditional, or in every branch")
    in_keys = sorted(needed)
    in_types = [(k, var_type(env[k])) for k in in_keys]
    built = [d.body(b, in_types, out_keys) for b in branches]
    for i, (_, out_types) in enumerate(built[1:], start=1):
        for k, a, b in zip(out_keys, built[0][1], out_types):
            if a != b:
                raise errors.VariableStructureError(
                    f"branch 0 leaves this variable as {a.describe()} but branch {i} leaves it "
                    f"as {b.describe()}.", collection=k[0], path=k[1],
                    **errors.where(eqn.source_info),
                    fix="make every branch write the same structure, shapes and dtypes")
    index, ops = invals[0], invals[1:]
    params = dict(eqn.params, branches=tuple(b for b, _ in built))
    outs = region.bind(eqn, [index, *leaves_of(env, in_keys), *ops], params)
    return store(env, out_keys, built[0][1], outs)


def _branches(indices) -> str:
    idx = list(indices)
    return ("branch " if len(idx) == 1 else "branches ") + ", ".join(map(str, idx))
