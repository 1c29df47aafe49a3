"""Discharge rules for raw ``custom_jvp`` and ``custom_vjp`` calls.

A call is rebuilt with ``jax.custom_jvp`` / ``jax.custom_vjp`` (``symbolic_zeros=True``)
over ``(variable leaves, closed-over values, arguments)``.  The primal is discharged at
once.  The user's JVP / forward rule is discharged only when JAX differentiates: rules may
call the custom function itself, so forcing them eagerly would recurse forever (JAX traces
them lazily for the same reason).  A rule is user code and may call ``vj.*``, so it runs
re-entered in the user's trace (``Discharger.reentered``) with the variables as they are at
the call site.

Variables are constants of the rule: differentiating with respect to one raises
``TransformError`` (``_reject_perturbed``), and written values carry no tangent.  Values the
function closes over are passed in and replaced in the rules (``closures.Closures``); they
are constants for the rule too.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from varjax import _jax
from varjax.ir import errors
from varjax.ir.primitives import Key, VarType
from varjax.passes.default.discharge.closures import (
    custom_name,
    read_behind,
    reject_rule_variables,
    unpassed_closure,
)
from varjax.passes.default.discharge.discharger import (
    Discharger,
    Env,
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


def _zeros(x):
    """A zero tangent/cotangent for ``x`` (float0 for integer and key values)."""
    return _zeros_of(_jax.get_aval(x))


def _zeros_of(aval):
    if jnp.issubdtype(aval.dtype, jnp.inexact):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _instantiate(t):
    """Rules are called with symbolic zeros (to see what is perturbed); users' rules
    expect arrays."""
    return _zeros_of(t.aval) if isinstance(t, SymbolicZero) else t


def _reject_perturbed(eqn, c: "_Custom", perturbed: Sequence[bool]) -> None:
    """Variables inside a raw custom_jvp/vjp are constants: differentiating with respect
    to them would silently give zero, so it is an error."""
    leaf = 0
    for k, vt in c.in_types:
        n = len(vt.avals)
        # Integer leaves (RNG counters) get float0 tangents: nothing to differentiate.
        if any(p and jnp.issubdtype(a.dtype, jnp.inexact)
               for p, a in zip(perturbed[leaf:leaf + n], vt.avals)):
            raise errors.TransformError(
                f"a gradient is requested with respect to this variable, which is read inside "
                f"a raw {custom_name(eqn)}; variables are "
                "constants for its custom rule, so the gradient would silently be zero.",
                collection=k[0], path=k[1], **errors.where(eqn.source_info),
                fix="pass the variable's value into the custom function as an argument")
        leaf += n


@dataclasses.dataclass
class _Custom:
    """The discharged primal of a custom_jvp/vjp call and what its rules need later.

    The call's operands are ``closed + rest``: ``closed`` are the leading operands holding
    values the custom function closes over (its ``num_consts``, or as many as it had as
    traced: JAX re-binding a call turns them into arguments), one per entry of
    ``closure``."""

    d: Discharger
    eqn: Any
    in_types: list
    out_keys: list
    out_types: list
    primal: ClosedJaxpr
    n_out: int
    types: Mapping[Key, VarType]   # of the variables at the call, for the rules
    closure: list      # per closed-over operand, the names (jaxpr variables) it had as traced

    def call(self, var_leaves, operands) -> list:
        return _jax.jaxpr_as_fun(self.primal)(*var_leaves, *operands)

    def run_rule(self, thunk, flags, var_leaves, closed, args,
                 perturbed: Sequence[bool] = ()) -> tuple[list, tuple]:
        """Force the rule thunk and evaluate it; its own writes are discarded (the
        primal's writes are the call's writes).  ``perturbed`` flags the ``closed``
        operands that carry a tangent."""
        with self.d.reentered(self.types):
            jaxpr, rule_consts, *extra = _jax.call_thunk(thunk, *flags)
            self.d.closures.add(ClosedJaxpr(jaxpr, rule_consts))   # for custom calls inside
            reject_rule_variables(self.eqn, jaxpr, [k for k, _ in self.in_types])
            rule_consts = self.resolve(rule_consts, closed, perturbed)
            env, _ = split_vars(var_leaves, self.in_types)
            return self.d.run_body(ClosedJaxpr(jaxpr, rule_consts), env, args), tuple(extra)

    def run_bwd(self, bwd, res, cts, closed) -> list:
        """custom_vjp's ``bwd`` on ``res, cts``; traced first when the function closes over
        traced values, so that those ``bwd`` closes over can be replaced."""
        if not self.closure:
            return list(_jax.call_thunk(bwd, *res, *cts))
        present: list[bool] = []

        def fn(*xs):
            outs = _jax.call_thunk(bwd, *xs)
            present[:] = [not (o is None or isinstance(o, _jax.Zero)) for o in outs]
            return [o for o, p in zip(outs, present) if p]
        traced = _jax.trace_to_jaxpr(fn, [_jax.get_aval(x) for x in (*res, *cts)])
        bwd_fn = _jax.jaxpr_as_fun(ClosedJaxpr(traced.jaxpr, self.resolve(traced.consts, closed)))
        got = iter(bwd_fn(*res, *cts))
        return [next(got) if p else None for p in present]

    def resolve(self, rule_consts, closed, perturbed: Sequence[bool] = ()) -> list:
        """``rule_consts`` with every tracer of the function's (ended) trace replaced by the
        ``closed`` operand holding the same value; rejects a tangent on a closed operand."""
        out, seen = [], {}
        for x in rule_consts:
            v = _jax.staged_var(x)
            at = [] if v is None else [i for i, ids in enumerate(self.closure) if v in ids]
            if len(at) > 1:
                collection, path = read_behind(x)
                raise errors.TransformError(
                    f"the custom rule of this raw {custom_name(self.eqn)} closes over a value "
                    "traced in the function, and calls of this custom function close over it "
                    "in different positions, so varjax cannot tell which value the rule "
                    "means.", collection=collection, path=path,
                    **errors.where(self.eqn.source_info),
                    fix="pass the value into the custom function as an argument")
            i = at[0] if at else None
            if i is not None:
                seen.setdefault(i, x)
                out.append(closed[i])
            elif v is not None and self.d.closures.traced(v):
                raise unpassed_closure(self.eqn, x)
            else:
                out.append(x)
        _reject_perturbed_closure(self.eqn, perturbed, seen)
        return out


def _reject_perturbed_closure(eqn, perturbed: Sequence[bool], tracers: dict) -> None:
    """A custom rule has no term for the values its function closes over: a tangent on one
    would silently be dropped (JAX's own custom_jvp drops it under jit)."""
    for i, p in enumerate(perturbed):
        if p:
            collection, path = read_behind(tracers[i]) if i in tracers else (None, None)
            raise errors.TransformError(
                f"a value that this raw {custom_name(eqn)} closes over is being "
                "differentiated" + (" (the value is, or is computed from, this variable)"
                                    if path else "")
                + "; its custom rule has no term for values the function closes over, so "
                "that part of the derivative would silently be zero.",
                collection=collection, path=path, **errors.where(eqn.source_info),
                fix="pass the value into the custom function as an argument, and give its "
                    "tangent in the rule")


def _custom(d: Discharger, eqn, env, thunk, flags, closure) -> tuple[_Custom, list]:
    call = eqn.params["call_jaxpr"]
    c_traffic = traffic(call)
    # The variables' types at the call, for user code in the rules (computed only when
    # there is a user trace to re-enter).
    types = {k: var_type(v) for k, v in env.items()} if d.reenter is not None else {}
    rule_needs: set = set()
    if c_traffic.needs or c_traffic.may_write:
        # Tracing the rule (unlike discharging it) never recurses: read its variable
        # traffic now so the values it reads are passed in.  JAX memoises the thunk.  User
        # code in the rule must see variables as they are here, not at the end of the
        # trace.  (A function without variables is rebuilt only for its closure; its rule
        # is traced when JAX differentiates, and may not touch variables: ``run_rule``.)
        with d.reentered(types):
            rule_jaxpr, *_ = _jax.call_thunk(thunk, *flags)
        rule_needs = {k for k in traffic(rule_jaxpr).needs if k in env}
    in_keys, out_keys = sorted(c_traffic.needs | rule_needs), sorted(c_traffic.may_write)
    require(eqn, in_keys, env, f"'{eqn.primitive.name}'")
    in_types = [(k, var_type(env[k])) for k in in_keys]
    primal, out_types = d.body(call, in_types, out_keys)
    c = _Custom(d, eqn, in_types, out_keys, out_types, primal, len(call.out_avals), types,
                closure)
    return c, leaves_of(env, in_keys)


def _nonzero(t) -> bool:
    return not isinstance(t, SymbolicZero)


def _inexact(x) -> bool:
    return jnp.issubdtype(_jax.get_aval(x).dtype, jnp.inexact)


@register_discharge_rule(_jax.custom_jvp_call_p)
def _custom_jvp(d: Discharger, eqn: _jax.JaxprEqn, invals: list[Any], env: Env,
                region: Region) -> list[Any]:
    nconst, thunk = eqn.params["num_consts"], eqn.params["jvp_jaxpr_fun"]
    closure = d.closures.closure(eqn)
    n = len(closure)
    c, var_in = _custom(d, eqn, env, thunk, [False] * (len(invals) - nconst), closure)

    @jax.custom_jvp
    def f(var_leaves, closed, rest):
        return c.call(var_leaves, [*closed, *rest])

    def f_jvp(primals, tangents):
        var_leaves, closed, rest = primals
        _reject_perturbed(eqn, c, list(map(_nonzero, tangents[0])))
        perturbed = [_nonzero(t) and _inexact(x) for t, x in zip(tangents[1], closed)]
        operands, op_tangents = [*closed, *rest], [*tangents[1], *tangents[2]]
        args = operands[nconst:]
        outs, (out_zeros,) = c.run_rule(thunk, [False] * len(args), var_leaves, closed,
                                        [*args, *map(_instantiate, op_tangents[nconst:])],
                                        perturbed)
        p_out, nonzero = outs[:c.n_out], iter(outs[c.n_out:])
        t_out = [_zeros(o) if z else next(nonzero) for o, z in zip(p_out, out_zeros)]
        var_out = c.call(var_leaves, operands)[c.n_out:]
        return [*p_out, *var_out], [*t_out, *map(_zeros, var_out)]

    f.defjvp(f_jvp, symbolic_zeros=True)
    with _jax.source_info_of(eqn):
        outs = f(var_in, list(invals[:n]), list(invals[n:]))
    return store(env, c.out_keys, c.out_types, list(outs))


@register_discharge_rule(_jax.custom_vjp_call_p)
def _custom_vjp(d: Discharger, eqn: _jax.JaxprEqn, invals: list[Any], env: Env,
                region: Region) -> list[Any]:
    p = eqn.params
    nconst, thunk, bwd, out_trees = p["num_consts"], p["fwd_jaxpr_thunk"], p["bwd"], p["out_trees"]
    closure = d.closures.closure(eqn)
    n = len(closure)
    # The forward rule's flags say which arguments are perturbed; closed-over values in
    # argument position (a re-bound call) never are: a tangent on one is rejected.
    flags = [i >= n for i in range(nconst, len(invals))]
    c, var_in = _custom(d, eqn, env, thunk, flags, closure)

    @jax.custom_vjp
    def f(var_leaves, closed, rest):
        return c.call(var_leaves, [*closed, *rest])

    def f_fwd(var_leaves, closed, rest):
        _reject_perturbed(eqn, c, [p.perturbed for p in var_leaves])
        perturbed = [p.perturbed and _inexact(p.value) for p in closed]
        var_leaves, closed, rest = ([p.value for p in group] for group in (var_leaves, closed, rest))
        operands = [*closed, *rest]
        outs, _ = c.run_rule(thunk, flags, var_leaves, closed, operands[nconst:], perturbed)
        n_res = len(outs) - c.n_out
        pruned = iter(outs[:n_res])
        # JAX numbers forwarded inputs over all operands, the leading num_consts included.
        res = [operands[i] if i is not None else next(pruned) for i in out_trees()[2]]
        var_out = c.call(var_leaves, operands)[c.n_out:]
        return [*outs[n_res:], *var_out], (res, var_leaves, closed, rest)

    def f_bwd(saved, cts):
        res, var_leaves, closed, rest = saved
        cts_in = c.run_bwd(bwd, res, list(map(_instantiate, cts[:c.n_out])), closed)
        cts_in = [_zeros(a) if ct is None or isinstance(ct, _jax.Zero) else ct
                  for a, ct in zip([*closed, *rest][nconst:], cts_in)]
        return list(map(_zeros, var_leaves)), list(map(_zeros, closed)), cts_in[n - nconst:]

    f.defvjp(f_fwd, f_bwd, symbolic_zeros=True)
    with _jax.source_info_of(eqn):
        outs = f(var_in, list(invals[:n]), list(invals[n:]))
    return store(env, c.out_keys, c.out_types, list(outs))

