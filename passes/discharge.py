"""discharge: functionalize variable effects, per collection.

After this pass the jaxpr is pure.  Reads become inputs, writes become
outputs, through every higher-order primitive:

* top level: the jaxpr gains leading inputs for every variable whose value on
  entry it needs, and trailing outputs for every variable it may write; the
  layout is recorded as ``ctx.results['signature']`` (a ``Signature``);
* ``jit`` / ``closed_call`` / ``checkpoint``: the body gets the same treatment
  and the equation passes the extra values in and out;
* ``scan`` / ``while``: variables read but never written in the body enter as
  loop constants; written ones are carried (their value on entry must exist);
* ``cond``: every branch takes the union of what any branch needs and returns
  the union of what any branch writes; a branch that does not write a
  variable passes it through unchanged;
* ``custom_jvp`` / ``custom_vjp``: rebuilt with ``jax.custom_jvp`` /
  ``jax.custom_vjp`` over the discharged primal, JVP and forward rules;
  variables inside them are constants for the rule (differentiating with
  respect to one raises ``TransformError``), and written values carry no
  tangent.

One rule per primitive handles reads and writes together.  Collections a
region does not touch never appear in its signature.

Sharp edges:
  * A variable that does not exist before a loop and is written inside it
    raises ``VariableCreationError``: the carry would have no initial value.
  * A variable created in only some branches of a raw ``lax.cond`` raises
    ``VariableCreationError`` naming the branches.
  * Custom rules are traced when JAX differentiates, after the functionalize
    trace ended: they (and functions they call) must read variables through
    ``vj.*`` or take values as arguments, never close over values traced in
    the function (JAX then fails with "No constant handler ... Tracer").
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from varjax import _jax, errors, scope
from varjax.effects import strip as strip_effects
from varjax.passes import hop, walk
from varjax.passes.analysis import key_of, touches_variables, traffic
from varjax.passes.base import Pass, PassContext
from varjax.passes.rewrite import Region, Rewriter
from varjax.primitives import Key, rng_draw_p, var_get_p, var_set_p
from varjax.scope import VarType

ClosedJaxpr = _jax.ClosedJaxpr
Env = dict  # Key -> (treedef, [leaves]) : the current value of each variable


@dataclasses.dataclass(frozen=True)
class Signature:
    """Where variables sit in a discharged jaxpr: leading inputs, trailing outputs."""

    inputs: tuple[tuple[Key, VarType], ...]
    outputs: tuple[tuple[Key, VarType], ...]


def _type(value: tuple) -> VarType:
    return VarType.of_leaves(*value)


def _leaves(env: Env, keys: Sequence[Key]) -> list[Any]:
    return [x for k in keys for x in env[k][1]]


def _split_vars(flat: Sequence[Any], types: Sequence[tuple[Key, VarType]]) -> tuple[Env, list]:
    env, i = {}, 0
    for k, vt in types:
        n = len(vt.avals)
        env[k] = (vt.tree, list(flat[i:i + n]))
        i += n
    return env, list(flat[i:])


class Discharger(Rewriter):
    """Evaluates effectful jaxprs with an explicit variable environment."""

    def eqn(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        env: Env = region.state["env"]
        prim = eqn.primitive
        if prim is var_get_p:
            return _checked_read(eqn, env, _type)
        if prim is var_set_p:
            env[key_of(eqn)] = (eqn.params["tree"], list(invals))
            return []
        if prim is rng_draw_p:
            raise errors.PassError(
                f"rng_draw[{eqn.params['stream']}] reached discharge: run lower-rng first.",
                collection=eqn.params["stream"], **errors.where(eqn.source_info),
                fix="put lower-rng before discharge in the pipeline (the default pipeline does)")
        if not touches_variables(eqn.effects):
            return region.bind(eqn, invals, _guard_custom_rule(eqn, env, _type))
        rule = RULES.get(prim)
        if rule is None:
            raise hop.unsupported(eqn, "has variable effects but no discharge rule")
        with errors.enclosing(eqn.source_info):   # errors in the bodies name eqn's module
            return rule(self, eqn, invals, env, region)

    # -- building discharged bodies ---------------------------------------------------
    def run_body(self, body: ClosedJaxpr, env: Env, args: Sequence[Any]) -> list[Any]:
        """Evaluate ``body`` on ``args`` with variable environment ``env`` (mutated)."""
        return self.eval(body, args, Region(self, state={"env": env}))

    def body(self, body: ClosedJaxpr, in_types: Sequence[tuple[Key, VarType]],
             out_keys: Sequence[Key]) -> tuple[ClosedJaxpr, list[VarType]]:
        """``body`` as a pure jaxpr ``(var leaves..., args...) -> (outs..., var leaves...)``."""
        out_types: list[VarType] = []

        def fn(*flat):
            env, args = _split_vars(flat, in_types)
            outs = self.run_body(body, env, args)
            out_types[:] = [_type(env[k]) for k in out_keys]
            return outs + _leaves(env, out_keys)

        avals = [a for _, vt in in_types for a in vt.avals] + list(body.in_avals)
        return self.trace(fn, avals), out_types


def _checked_read(eqn: _jax.JaxprEqn, env: Env, type_of: Callable[[tuple], VarType]) -> list:
    """The current value of the variable ``eqn`` reads, after checking it exists and has
    the type the read expects."""
    k = key_of(eqn)
    if k not in env:
        raise errors.VariableCreationError(
            "this variable is read where it has no value: it is created later in trace "
            "order, or only on another path (another branch of a conditional).",
            collection=k[0], path=k[1], **errors.where(eqn.source_info),
            fix="create the variable before the control flow that reads it")
    have, want = type_of(env[k]), VarType(eqn.params["tree"], eqn.params["avals"])
    if have != want:
        raise errors.VariableStructureError(
            f"this read expects {want.describe()} but the variable holds {have.describe()} "
            "here (its structure changed inside control flow).", collection=k[0], path=k[1],
            **errors.where(eqn.source_info),
            fix="keep the variable's structure, shapes and dtypes the same on every path "
                "through the control flow")
    return list(env[k][1])


def _require(eqn: _jax.JaxprEqn, keys: Sequence[Key], env: Env, where: str) -> None:
    for k in keys:
        if k not in env:
            raise errors.VariableCreationError(
                f"this variable is first written inside {where} at this line, so it has no "
                "value on entry to it.", collection=k[0], path=k[1],
                **errors.where(eqn.source_info),
                fix="create (initialize) the variable before the loop or conditional")


def _check_same(eqn, keys, before: Sequence[VarType], after: Sequence[VarType], where: str):
    for k, b, a in zip(keys, before, after):
        if a != b:
            raise errors.VariableStructureError(
                f"{where} changes this variable from {b.describe()} to {a.describe()}; a "
                "carried variable must keep its structure, shapes and dtypes.",
                collection=k[0], path=k[1], **errors.where(eqn.source_info),
                fix="keep the variable's type fixed inside the loop (e.g. sow with a reduce_fn "
                    "that accumulates instead of appending)")


# --- call-like: jit, closed_call, checkpoint ---------------------------------------------

def _call(d: Discharger, eqn, invals, env, region, body: ClosedJaxpr,
          params_for: Callable[[ClosedJaxpr, int, int], dict]) -> list[Any]:
    t = traffic(body)
    in_keys, out_keys = sorted(t.needs), sorted(t.may_write)
    _require(eqn, in_keys, env, f"'{eqn.primitive.name}'")
    in_types = [(k, _type(env[k])) for k in in_keys]
    new, out_types = d.body(body, in_types, out_keys)
    var_in = _leaves(env, in_keys)
    n_out = sum(len(vt.avals) for vt in out_types)
    outs = region.bind(eqn, [*var_in, *invals], params_for(new, len(var_in), n_out))
    return _store(env, out_keys, out_types, outs)


def _jit(d, eqn, invals, env, region):
    return _call(d, eqn, invals, env, region, eqn.params["jaxpr"],
                 lambda new, n_in, n_out: _jax.jit_params_with(eqn.params, new, n_in, n_out))


def _closed_call(d, eqn, invals, env, region):
    return _call(d, eqn, invals, env, region, eqn.params["call_jaxpr"],
                 lambda new, n_in, n_out: dict(eqn.params, call_jaxpr=new))


def _remat(d, eqn, invals, env, region):
    return _call(d, eqn, invals, env, region, hop.closed(eqn.params["jaxpr"]),
                 lambda new, n_in, n_out: dict(eqn.params, jaxpr=hop.const_free(new)))


# --- loops -------------------------------------------------------------------------------

def _loop_keys(eqn, env, bodies: Sequence[ClosedJaxpr]) -> tuple[list[Key], list[Key]]:
    ts = [traffic(b) for b in bodies]
    written = frozenset().union(*(t.may_write for t in ts))
    needed = frozenset().union(*(t.needs for t in ts))
    carried, consts = sorted(written), sorted(needed - written)
    _require(eqn, carried + consts, env, f"the body of '{eqn.primitive.name}' (a loop)")
    return carried, consts


def _scan(d: Discharger, eqn, invals, env, region):
    p = eqn.params
    body = p["jaxpr"]
    carried, consts_k = _loop_keys(eqn, env, [body])
    nc, nk = p["num_consts"], p["num_carry"]
    consts, carry, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
    types = [_type(env[k]) for k in carried]

    def step(state, x):
        var_leaves, c = state
        benv = {k: env[k] for k in consts_k}
        benv.update(_split_vars([v for vs in var_leaves for v in vs], list(zip(carried, types)))[0])
        outs = d.run_body(body, benv, [*consts, *c, *x])
        _check_same(eqn, carried, types, [_type(benv[k]) for k in carried], "this scan body")
        return ([benv[k][1] for k in carried], outs[:nk]), outs[nk:]

    with _jax.source_info_of(eqn):
        (final_vars, final_carry), ys = jax.lax.scan(
            step, ([env[k][1] for k in carried], list(carry)), list(xs), length=p["length"],
            reverse=p["reverse"], unroll=p["unroll"])
    for k, vt, leaves in zip(carried, types, final_vars):
        env[k] = (vt.tree, list(leaves))
    return [*final_carry, *ys]


def _while(d: Discharger, eqn, invals, env, region):
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
    types = [_type(env[k]) for k in carried]

    def loop_env(var_leaves):
        benv = {k: env[k] for k in consts_k}
        benv.update(_split_vars([v for vs in var_leaves for v in vs], list(zip(carried, types)))[0])
        return benv

    def cond_fn(state):
        var_leaves, c = state
        return d.run_body(cond_j, loop_env(var_leaves), [*cconsts, *c])[0]

    def body_fn(state):
        var_leaves, c = state
        benv = loop_env(var_leaves)
        outs = d.run_body(body_j, benv, [*bconsts, *c])
        _check_same(eqn, carried, types, [_type(benv[k]) for k in carried], "this while_loop body")
        return [benv[k][1] for k in carried], outs

    with _jax.source_info_of(eqn):
        final_vars, final = jax.lax.while_loop(cond_fn, body_fn, ([env[k][1] for k in carried], list(init)))
    for k, vt, leaves in zip(carried, types, final_vars):
        env[k] = (vt.tree, list(leaves))
    return list(final)


# --- conditionals ------------------------------------------------------------------------

def _cond(d: Discharger, eqn, invals, env, region):
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
    in_types = [(k, _type(env[k])) for k in in_keys]
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
    outs = region.bind(eqn, [index, *_leaves(env, in_keys), *ops], params)
    return _store(env, out_keys, built[0][1], outs)


def _branches(indices) -> str:
    idx = list(indices)
    return ("branch " if len(idx) == 1 else "branches ") + ", ".join(map(str, idx))


def _store(env: Env, keys: Sequence[Key], types: Sequence[VarType], outs: list[Any]) -> list[Any]:
    """Split ``outs`` into (main outputs, trailing variable values); store the latter."""
    n_var = sum(len(vt.avals) for vt in types)
    main, rest = outs[:len(outs) - n_var], outs[len(outs) - n_var:]
    new_env, _ = _split_vars(rest, list(zip(keys, types)))
    env.update(new_env)
    return main


# --- custom derivatives ------------------------------------------------------------------
#
# The primal body is discharged now; the user's JVP / forward rule only when JAX
# differentiates (rules may call the custom function itself, so forcing them eagerly
# would recurse forever -- JAX traces them lazily for the same reason).  The trace
# context is re-activated then, because the rule may call vj.* functions.

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
                f"a raw jax.{eqn.primitive.name.removesuffix('_call')}; variables are "
                "constants for its custom rule, so the gradient would silently be zero.",
                collection=k[0], path=k[1], **errors.where(eqn.source_info),
                fix="pass the variable's value into the custom function as an argument")
        leaf += n


@dataclasses.dataclass
class _Custom:
    """The discharged primal of a custom_jvp/vjp call and what its rules need later."""

    d: Discharger
    in_types: list
    out_keys: list
    out_types: list
    primal: ClosedJaxpr
    n_out: int
    context: Any

    def call(self, var_leaves, consts, args) -> list:
        return _jax.jaxpr_as_fun(self.primal)(*var_leaves, *consts, *args)

    def run_rule(self, thunk, flags, var_leaves, args) -> tuple[list, tuple]:
        """Force the rule thunk and evaluate it; its own writes are discarded (the
        primal's writes are the call's writes)."""
        with _reactivated(self.context):
            jaxpr, consts, *extra = _jax.call_thunk(thunk, *flags)
            env, _ = _split_vars(var_leaves, self.in_types)
            return self.d.run_body(ClosedJaxpr(jaxpr, consts), env, args), tuple(extra)


def _reactivated(context):
    return scope.activate(context) if context is not None else contextlib.nullcontext()


def _custom(d: Discharger, eqn, env, thunk, flags) -> tuple[_Custom, list]:
    call = eqn.params["call_jaxpr"]
    c_traffic = traffic(call)
    # Tracing the rule (unlike discharging it) never recurses: read its variable traffic
    # now so the values it reads are passed in.  JAX memoises the thunk.  User code in
    # the rule must see variables as they are here, not at the end of the trace.
    context = scope.active()
    if context is not None:
        context = context.snapshot({k: _type(v) for k, v in env.items()})
    with _reactivated(context):
        rule_jaxpr, *_ = _jax.call_thunk(thunk, *flags)
    rule_needs = {k for k in traffic(rule_jaxpr).needs if k in env}
    in_keys, out_keys = sorted(c_traffic.needs | rule_needs), sorted(c_traffic.may_write)
    _require(eqn, in_keys, env, f"'{eqn.primitive.name}'")
    in_types = [(k, _type(env[k])) for k in in_keys]
    primal, out_types = d.body(call, in_types, out_keys)
    c = _Custom(d, in_types, out_keys, out_types, primal, len(call.out_avals), context)
    return c, _leaves(env, in_keys)


def _guard_custom_rule(eqn, env: Env, type_of: Callable[[tuple], VarType]) -> dict | None:
    """New params for a variable-free equation holding custom_jvp/vjp calls (at any
    depth), or None.  Their rules are traced when JAX differentiates and may still run
    user code: they run under a context snapshot, so ``vj.*`` calls there work, and are
    rejected if they touch variables their function does not."""
    context = scope.active()
    if context is None or not _holds_custom_call(eqn):
        return None
    at_call = dict(env)   # the snapshot itself is built only if JAX ever traces the rule

    @functools.cache
    def snapshot() -> scope.TraceContext:
        return context.snapshot({k: type_of(v) for k, v in at_call.items()})
    return _guarded_params(eqn, snapshot)


_custom_memo: "weakref.WeakKeyDictionary[_jax.Jaxpr, bool]" = weakref.WeakKeyDictionary()


def _holds_custom_call(eqn) -> bool:
    spec = hop.TABLE.get(eqn.primitive)
    if spec is None:
        return False
    if spec.thunk is not None:
        return True
    for body in hop.bodies(eqn):
        found = _custom_memo.get(body.jaxpr)
        if found is None:
            found = _custom_memo[body.jaxpr] = any(map(_holds_custom_call, body.jaxpr.eqns))
        if found:
            return True
    return False


def _guarded_params(eqn, snapshot: Callable[[], scope.TraceContext]) -> dict:
    spec = hop.TABLE[eqn.primitive]
    if spec.thunk is None:
        return hop.with_bodies(eqn, lambda body: _guarded_body(body, snapshot))

    def around(call):
        with scope.activate(snapshot()):
            out = call()
        if touches_variables(out[0].effects):
            collection, path = walk.first_variable([out[0]])
            raise errors.TransformError(
                f"the custom rule of a raw jax.{eqn.primitive.name.removesuffix('_call')} "
                "touches variables that its function does not, so varjax has not passed "
                "them in.", collection=collection, path=path, **errors.where(eqn.source_info),
                fix="read the variable in the function as well, or pass its value as an argument")
        return out
    return dict(eqn.params, **{spec.thunk: _jax.wrap_thunk(eqn.params[spec.thunk], around)})


def _guarded_body(body: ClosedJaxpr, snapshot: Callable[[], scope.TraceContext]) -> ClosedJaxpr:
    eqns = [e.replace(params=_guarded_params(e, snapshot)) if _holds_custom_call(e) else e
            for e in body.jaxpr.eqns]
    return ClosedJaxpr(body.jaxpr.replace(eqns=eqns), body.consts)


def _custom_jvp(d: Discharger, eqn, invals, env, region):
    nconst, thunk = eqn.params["num_consts"], eqn.params["jvp_jaxpr_fun"]
    n_args = len(eqn.params["call_jaxpr"].in_avals) - nconst
    c, var_in = _custom(d, eqn, env, thunk, [False] * n_args)

    @jax.custom_jvp
    def f(var_leaves, consts, args):
        return c.call(var_leaves, consts, args)

    def f_jvp(primals, tangents):
        var_leaves, consts, args = primals
        _reject_perturbed(eqn, c, [not isinstance(t, SymbolicZero) for t in tangents[0]])
        outs, (out_zeros,) = c.run_rule(thunk, [False] * len(args), var_leaves,
                                        [*args, *map(_instantiate, tangents[2])])
        p_out, nonzero = outs[:c.n_out], iter(outs[c.n_out:])
        t_out = [_zeros(o) if z else next(nonzero) for o, z in zip(p_out, out_zeros)]
        var_out = c.call(var_leaves, consts, args)[c.n_out:]
        return [*p_out, *var_out], [*t_out, *map(_zeros, var_out)]

    f.defjvp(f_jvp, symbolic_zeros=True)
    with _jax.source_info_of(eqn):
        outs = f(var_in, list(invals[:nconst]), list(invals[nconst:]))
    return _store(env, c.out_keys, c.out_types, list(outs))


def _custom_vjp(d: Discharger, eqn, invals, env, region):
    p = eqn.params
    nconst, thunk, bwd, out_trees = p["num_consts"], p["fwd_jaxpr_thunk"], p["bwd"], p["out_trees"]
    c, var_in = _custom(d, eqn, env, thunk, [True] * (len(p["call_jaxpr"].in_avals) - nconst))

    @jax.custom_vjp
    def f(var_leaves, consts, args):
        return c.call(var_leaves, consts, args)

    def f_fwd(var_leaves, consts, args):
        _reject_perturbed(eqn, c, [p.perturbed for p in var_leaves])
        var_leaves, consts, args = ([p.value for p in group] for group in (var_leaves, consts, args))
        outs, _ = c.run_rule(thunk, [True] * len(args), var_leaves, args)
        n_res = len(outs) - c.n_out
        pruned = iter(outs[:n_res])
        res = [args[i] if i is not None else next(pruned) for i in out_trees()[2]]
        var_out = c.call(var_leaves, consts, args)[c.n_out:]
        return [*outs[n_res:], *var_out], (res, var_leaves, consts, args)

    def f_bwd(saved, cts):
        res, var_leaves, consts, args = saved
        cts_in = _jax.call_thunk(bwd, *res, *map(_instantiate, cts[:c.n_out]))
        cts_in = [_zeros(a) if ct is None or isinstance(ct, _jax.Zero) else ct
                  for a, ct in zip(args, cts_in)]
        return list(map(_zeros, var_leaves)), list(map(_zeros, consts)), cts_in

    f.defvjp(f_fwd, f_bwd, symbolic_zeros=True)
    with _jax.source_info_of(eqn):
        outs = f(var_in, list(invals[:nconst]), list(invals[nconst:]))
    return _store(env, c.out_keys, c.out_types, list(outs))


# --- the common case, without re-tracing --------------------------------------------------

def _atom_type(value: tuple) -> VarType:
    tree, atoms = value
    return VarType(tree, tuple(a.aval.update(weak_type=False) for a in atoms))


def _is_flat(jaxpr: _jax.Jaxpr) -> bool:
    """All variable traffic is top-level var_get/var_set: no body carries any."""
    return not any(touches_variables(e.effects) for e in jaxpr.eqns
                   if e.primitive is not var_get_p and e.primitive is not var_set_p)


def discharge_flat(closed: ClosedJaxpr, in_types: Sequence[tuple[Key, VarType]],
                   out_keys: Sequence[Key]) -> tuple[ClosedJaxpr, list[VarType]]:
    """``Discharger.body`` for a flat jaxpr, by editing binders instead of re-tracing:
    a read's outputs are renamed to the value's variables, a write drops out."""
    jaxpr = closed.jaxpr
    env: Env = {}
    new_invars = []
    for k, vt in in_types:
        atoms = [_jax.new_var(a) for a in vt.avals]
        env[k] = (vt.tree, atoms)
        new_invars += atoms
    rename: dict = {}

    def sub(a):
        return rename.get(a, a) if isinstance(a, _jax.Var) else a

    eqns = []
    changed = bool(in_types or out_keys)
    for eqn in jaxpr.eqns:
        if eqn.primitive is var_get_p:
            rename.update(zip(eqn.outvars, _checked_read(eqn, env, _atom_type)))
            changed = True
            continue
        if eqn.primitive is var_set_p:
            env[key_of(eqn)] = (eqn.params["tree"], [sub(a) for a in eqn.invars])
            changed = True
            continue
        new = eqn
        if rename and any(isinstance(a, _jax.Var) and a in rename for a in eqn.invars):
            new = new.replace(invars=[sub(a) for a in eqn.invars])
        guarded = _guard_custom_rule(eqn, env, _atom_type)
        if guarded is not None:
            new = new.replace(params=guarded)
        changed = changed or new is not eqn
        eqns.append(new)
    if not changed:
        return closed, []
    outvars = [sub(a) for a in jaxpr.outvars] + _leaves(env, out_keys)
    new = _jax.rebuild_jaxpr(jaxpr, invars=new_invars + list(jaxpr.invars), outvars=outvars,
                             eqns=eqns, effects=strip_effects(jaxpr.effects))
    return ClosedJaxpr(new, closed.consts), [_atom_type(env[k]) for k in out_keys]


RULES: dict[_jax.Primitive, Callable[..., list[Any]]] = {
    _jax.jit_p: _jit,
    _jax.closed_call_p: _closed_call,
    _jax.remat_p: _remat,
    _jax.scan_p: _scan,
    _jax.while_p: _while,
    _jax.cond_p: _cond,
    _jax.custom_jvp_call_p: _custom_jvp,
    _jax.custom_vjp_call_p: _custom_vjp,
}


@dataclasses.dataclass(frozen=True)
class Discharge(Pass):
    """Reads become inputs and writes become outputs; the result is pure."""

    name = "discharge"
    summary = "functionalize variable effects: reads -> inputs, writes -> outputs"
    requires = ("lower-rng",)
    after = ("check-mutability", "forward-stores", "dead-reads")
    discharges = True

    def run(self, jaxpr: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
        t = traffic(jaxpr)
        in_keys = sorted(k for k in t.needs if k in ctx.variables)
        out_keys = sorted(t.may_write)
        in_types = [(k, ctx.variables[k]) for k in in_keys]
        if _is_flat(jaxpr.jaxpr):
            new, out_types = discharge_flat(jaxpr, in_types, out_keys)
        else:
            new, out_types = Discharger().body(jaxpr, in_types, out_keys)
        ctx.results["signature"] = Signature(tuple(in_types), tuple(zip(out_keys, out_types)))
        ctx.count(self.name, "inputs", len(in_keys))
        ctx.count(self.name, "outputs", len(out_keys))
        return new

