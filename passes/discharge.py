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
  tangent.  Values the function closes over are passed in, and replaced in
  the rules (``_Closures``); they are constants for the rule too;
* ``shard_map``: variables enter and leave replicated (``P()``); a written
  value that may differ between shards raises ``TransformError``.

One rule per primitive handles reads and writes together.  Collections a
region does not touch never appear in its signature.

Sharp edges:
  * A variable that does not exist before a loop and is written inside it
    raises ``VariableCreationError``: the carry would have no initial value.
  * A variable created in only some branches of a raw ``lax.cond`` raises
    ``VariableCreationError`` naming the branches.
  * Custom rules are traced when JAX differentiates, after the functionalize
    trace ended.  A rule may close over values its function closes over
    (they are passed in); one it alone closes over raises ``TransformError``.
  * RNG draws inside a raw ``shard_map`` give every shard the same key.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
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
from varjax.primitives import VarType

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
    """Evaluates effectful jaxprs with an explicit variable environment.

    ``sources`` are the jaxprs as traced (before any pass renamed their variables): they
    say which operand of a custom call holds a value its rules close over."""

    def __init__(self, sources: Sequence[ClosedJaxpr] = ()):
        super().__init__()
        self.closures = _Closures(sources)

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
        if not touches_variables(eqn.effects) and not self.closures.holds(eqn):
            _reject_hidden(eqn)
            return region.bind(eqn, invals, _guard_custom_rule(eqn, env, _type, self.closures))
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


_hidden_memo: "weakref.WeakKeyDictionary[_jax.Jaxpr, tuple]" = weakref.WeakKeyDictionary()


_has_bodies: dict = {}    # primitive -> do its equations hold jaxprs (asked once per primitive)


def _reject_hidden(eqn: _jax.JaxprEqn) -> None:
    """A primitive varjax has no rule for whose equation drops its body's effects (JAX's
    ``composite`` does) would carry variable accesses, unseen, to lowering."""
    prim = eqn.primitive
    if prim in hop.TABLE or _has_bodies.get(prim) is False:
        return
    subs = walk.subjaxprs(eqn)
    _has_bodies[prim] = bool(subs) or _has_bodies.get(prim, False)
    for sub in subs:
        j = walk.open_jaxpr(sub)
        found = _hidden_memo.get(j)
        if found is None:
            found = _hidden_memo[j] = walk.first_variable([j])
        if found != (None, None):
            raise hop.unsupported(eqn, "has a body with variable accesses but no varjax rule")


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
    if have != want and _structure(have) != _structure(want):
        raise errors.VariableStructureError(
            f"this read expects {want.describe()} but the variable holds {have.describe()} "
            "here (its structure changed inside control flow).", collection=k[0], path=k[1],
            **errors.where(eqn.source_info),
            fix="keep the variable's structure, shapes and dtypes the same on every path "
                "through the control flow")
    return list(env[k][1])


def _structure(vt: VarType) -> tuple:
    """What a read checks: tree, shapes and dtypes.  Shardings differ legitimately: inside
    a shard_map body every value's type names the manual mesh."""
    return vt.tree, tuple((a.shape, a.dtype) for a in vt.avals)


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


# --- raw shard_map -----------------------------------------------------------------------

def _shard_map(d: Discharger, eqn, invals, env, region):
    """Variables enter a raw shard_map replicated (``P()``: every shard sees the whole
    value) and leave it the same way, which is right only for a value that is the same on
    every shard: a write JAX's type says varies over a mesh axis raises."""
    p = eqn.params
    body = hop.closed(p["jaxpr"])
    t = traffic(body)
    in_keys, out_keys = sorted(t.needs), sorted(t.may_write)
    _require(eqn, in_keys, env, "'shard_map'")
    if out_keys and not p["check_vma"]:
        k = out_keys[0]
        raise errors.TransformError(
            "this variable is written inside a raw jax.shard_map with check_vma=False (or "
            "inside a raw jax.pmap, which runs as one), so varjax cannot check that the "
            "written value is the same on every shard.",
            collection=k[0], path=k[1], **errors.where(_last_write(body, k).source_info),
            fix="keep check_vma=True (the default) in jax.shard_map, or use the lifted "
                f"vj.shard_map (nn.shard_map) with variable_specs={{'{k[0]}': P(...)}} or "
                f"vj.pmap (nn.pmap) with variable_axes={{'{k[0]}': 0}}")
    in_types = [(k, _type(env[k])) for k in in_keys]
    trees: list = []

    def per_shard(var_leaves, *args):
        benv, _ = _split_vars(var_leaves, in_types)
        outs = d.run_body(body, benv, list(args))
        for k in out_keys:
            axes = frozenset().union(*map(_jax.varying_axes, benv[k][1]))
            if axes:
                raise errors.TransformError(
                    "this variable is written inside a raw jax.shard_map with a value that "
                    f"differs between shards (it varies over mesh axis "
                    f"{', '.join(map(repr, sorted(axes)))}); a variable has one value, so "
                    "varjax cannot tell which shard's value should win.",
                    collection=k[0], path=k[1], **errors.where(_last_write(body, k).source_info),
                    fix="use the lifted vj.shard_map (nn.shard_map) with variable_specs="
                        f"{{'{k[0]}': P(...)}}, which keeps one copy per shard (or make the "
                        "value the same on every shard, e.g. with jax.lax.pmean)")
        trees[:] = [benv[k][0] for k in out_keys]
        return tuple(outs), [list(benv[k][1]) for k in out_keys]

    P = jax.sharding.PartitionSpec
    with _jax.source_info_of(eqn):
        outs, var_out = jax.shard_map(
            per_shard, mesh=p["mesh"], in_specs=(P(), *p["in_specs"]),
            out_specs=(tuple(p["out_specs"]), P()), axis_names=p["newly_manual_axes"],
            check_vma=p["check_vma"])(_leaves(env, in_keys), *invals)
    for k, tree, leaves in zip(out_keys, trees, var_out):
        env[k] = (tree, list(leaves))
    return list(outs)


def _last_write(body: ClosedJaxpr, k: Key) -> _jax.JaxprEqn:
    writes = [e for e, _ in walk.walk_eqns(body) if e.primitive is var_set_p and key_of(e) == k]
    return writes[-1]


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


def _custom_name(eqn) -> str:
    return "jax." + eqn.primitive.name.removesuffix("_call")


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
                f"a raw {_custom_name(eqn)}; variables are "
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
    context: Any
    closure: list      # per closed-over operand, the names (jaxpr variables) it had as traced

    def call(self, var_leaves, operands) -> list:
        return _jax.jaxpr_as_fun(self.primal)(*var_leaves, *operands)

    def run_rule(self, thunk, flags, var_leaves, closed, args,
                 perturbed: Sequence[bool] = ()) -> tuple[list, tuple]:
        """Force the rule thunk and evaluate it; its own writes are discarded (the
        primal's writes are the call's writes).  ``perturbed`` flags the ``closed``
        operands that carry a tangent."""
        with _reactivated(self.context):
            jaxpr, rule_consts, *extra = _jax.call_thunk(thunk, *flags)
            self.d.closures.add(ClosedJaxpr(jaxpr, rule_consts))   # for custom calls inside
            _reject_rule_variables(self.eqn, jaxpr, [k for k, _ in self.in_types])
            rule_consts = self.resolve(rule_consts, closed, perturbed)
            env, _ = _split_vars(var_leaves, self.in_types)
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
                collection, path = _read_behind(x)
                raise errors.TransformError(
                    f"the custom rule of this raw {_custom_name(self.eqn)} closes over a value "
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
                raise _unpassed_closure(self.eqn, x)
            else:
                out.append(x)
        _reject_perturbed_closure(self.eqn, perturbed, seen)
        return out


def _unpassed_closure(eqn, x) -> errors.TransformError:
    collection, path = _read_behind(x)
    return errors.TransformError(
        f"the custom rule of this raw {_custom_name(eqn)} closes over a value traced in the "
        "function that the custom function itself does not use, so varjax cannot pass the "
        "value in" + (" (the value is, or is computed from, this variable)." if path else "."),
        collection=collection, path=path, **errors.where(eqn.source_info),
        fix="use the value in the custom function as well, or pass it in as an argument")


def _reject_perturbed_closure(eqn, perturbed: Sequence[bool], tracers: dict) -> None:
    """A custom rule has no term for the values its function closes over: a tangent on one
    would silently be dropped (JAX's own custom_jvp drops it under jit)."""
    for i, p in enumerate(perturbed):
        if p:
            collection, path = _read_behind(tracers[i]) if i in tracers else (None, None)
            raise errors.TransformError(
                f"a value that this raw {_custom_name(eqn)} closes over is being "
                "differentiated" + (" (the value is, or is computed from, this variable)"
                                    if path else "")
                + "; its custom rule has no term for values the function closes over, so "
                "that part of the derivative would silently be zero.",
                collection=collection, path=path, **errors.where(eqn.source_info),
                fix="pass the value into the custom function as an argument, and give its "
                    "tangent in the rule")


def _read_behind(x, limit: int = 256) -> tuple[str | None, tuple | None]:
    """``(collection, path)`` of the first variable read that the traced value ``x`` is
    computed from (searching the ended trace's equations back from ``x``), or (None, None)."""
    todo, seen = [x], set()
    while todo and len(seen) < limit:
        t = todo.pop(0)
        if id(t) in seen:
            continue
        seen.add(id(t))
        producer = _jax.staged_producer(t)
        if producer is None:
            continue
        prim, params, ins = producer
        if prim is var_get_p:
            return params["collection"], params["path"]
        todo.extend(ins)
    return None, None


class _Closures:
    """Which leading operands of a custom call hold the values its rules close over.

    A custom function that closes over a value traced in the function (a ``vj.param``
    read) gets the value as one of its equation's ``num_consts`` leading operands.  Its
    rules close over the same Python tracer, which belongs to a trace that has ended when
    JAX traces them: staged as a constant, it fails with "No constant handler ... Tracer".
    Such a tracer still knows its jaxpr variable, so the table is read off the jaxprs as
    traced (passes rename variables, and a re-bound call has ``num_consts=0``), following
    each body input back to the operand it receives.  Calls are matched by
    ``_jax.thunk_identity`` of their rule thunk (the rule's source and argument names),
    which every rewrap keeps; calls of one function share their positions' names, so a
    name found at two positions is ambiguous and raises."""

    def __init__(self, sources: Sequence[ClosedJaxpr]):
        self.sources = [s for s in sources if s is not None]
        self._walked = 0
        self._table: dict[Any, tuple[frozenset, list[frozenset]]] = {}   # (counts, names)
        self._vars: set | None = None
        self._any: bool | None = None
        self._holds: dict[int, tuple[Any, bool]] = {}

    def add(self, source: ClosedJaxpr) -> None:
        if not any(s.jaxpr is source.jaxpr for s in self.sources):
            self.sources.append(source)
            self._vars = self._any = None
            self._holds.clear()

    def _update(self) -> None:
        while self._walked < len(self.sources):
            self._walk(self.sources[self._walked], {})
            self._walked += 1

    def _walk(self, closed: ClosedJaxpr, roots: dict) -> None:
        roots = dict(roots)
        for var, c in zip(closed.jaxpr.constvars, closed.consts):
            if _jax.staged_var(c) is not None:
                roots[var] = frozenset((var, _jax.staged_var(c)))
        for eqn in closed.jaxpr.eqns:
            spec = hop.TABLE.get(eqn.primitive)
            if spec is None:
                continue
            ids = [roots.get(v, frozenset((v,))) if isinstance(v, _jax.Var) else frozenset()
                   for v in eqn.invars]
            if spec.thunk is not None and eqn.params["num_consts"]:
                # Calls of one custom function (and their copies in other sources) share
                # a key: each position collects every name its operand had.
                key = _thunk_key(eqn.params[spec.thunk])
                found = ids[:eqn.params["num_consts"]]
                counts, old = self._table.get(key, (frozenset(), ()))
                self._table[key] = (counts | {len(found)}, [a | b for a, b in itertools.zip_longest(
                    old, found, fillvalue=frozenset())])
            for body, index in hop.passthrough(eqn):
                self._walk(body, {v: ids[i] | {v} for v, i in zip(body.jaxpr.invars, index)
                                  if i is not None})

    def closure(self, eqn) -> list[frozenset]:
        """Per closed-over leading operand of the custom call ``eqn``, its names as traced."""
        self._update()
        n = eqn.params["num_consts"]
        counts, found = self._table.get(_thunk_key(eqn.params[hop.TABLE[eqn.primitive].thunk]),
                                        ({n}, []))
        if not n and len(counts) > 1:   # re-bound, and its calls closed over unlike numbers
            return []
        found = list(found)[:n or max(counts)]
        return found + [frozenset()] * (n - len(found))

    def holds(self, eqn) -> bool:
        """Does ``eqn``, or an equation in its bodies, call a custom function that closes
        over traced values?  Discharge rebuilds those (and re-traces the bodies around)."""
        if self._any is None:
            self._any = any(_holds_closure_call(e) for s in self.sources for e in s.jaxpr.eqns
                            if e.primitive in hop.TABLE)
        if not self._any or hop.TABLE.get(eqn.primitive) is None:
            return False
        if _is_custom_call(eqn) and self.closure(eqn):
            return True
        for body in hop.bodies(eqn):
            hit = self._holds.get(id(body.jaxpr))
            if hit is None or hit[0] is not body.jaxpr:
                hit = self._holds[id(body.jaxpr)] = (
                    body.jaxpr, any(self.holds(e) for e in body.jaxpr.eqns))
            if hit[1]:
                return True
        return False

    def traced(self, var) -> bool:
        """Is ``var`` a variable of a jaxpr as traced (a value of the function's trace)?"""
        if self._vars is None:
            found: set = set()
            for closed in self.sources:
                found.update(v for v in map(_jax.staged_var, closed.consts) if v is not None)
                found.update(closed.jaxpr.invars)
                found.update(closed.jaxpr.constvars)
                for e, holder in walk.walk_eqns(closed):
                    found.update(v for v in e.outvars if isinstance(v, _jax.Var))
                    found.update(holder.invars)
            self._vars = found
        return var in self._vars


def _thunk_key(thunk) -> Any:
    key = _jax.thunk_identity(thunk)
    try:
        hash(key)
    except TypeError:
        return id(thunk)
    return key


def _reactivated(context):
    return scope.activate(context) if context is not None else contextlib.nullcontext()


def _custom(d: Discharger, eqn, env, thunk, flags, closure) -> tuple[_Custom, list]:
    call = eqn.params["call_jaxpr"]
    c_traffic = traffic(call)
    context = scope.active()
    if context is not None:
        context = context.snapshot({k: _type(v) for k, v in env.items()})
    rule_needs: set = set()
    if c_traffic.needs or c_traffic.may_write:
        # Tracing the rule (unlike discharging it) never recurses: read its variable
        # traffic now so the values it reads are passed in.  JAX memoises the thunk.  User
        # code in the rule must see variables as they are here, not at the end of the
        # trace.  (A function without variables is rebuilt only for its closure; its rule
        # is traced when JAX differentiates, and may not touch variables: ``run_rule``.)
        with _reactivated(context):
            rule_jaxpr, *_ = _jax.call_thunk(thunk, *flags)
        rule_needs = {k for k in traffic(rule_jaxpr).needs if k in env}
    in_keys, out_keys = sorted(c_traffic.needs | rule_needs), sorted(c_traffic.may_write)
    _require(eqn, in_keys, env, f"'{eqn.primitive.name}'")
    in_types = [(k, _type(env[k])) for k in in_keys]
    primal, out_types = d.body(call, in_types, out_keys)
    c = _Custom(d, eqn, in_types, out_keys, out_types, primal, len(call.out_avals), context,
                closure)
    return c, _leaves(env, in_keys)


def _guard_custom_rule(eqn, env: Env, type_of: Callable[[tuple], VarType],
                       closures: _Closures) -> dict | None:
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
    return _guarded_params(eqn, snapshot, closures)


_custom_memo: "weakref.WeakKeyDictionary[_jax.Jaxpr, bool]" = weakref.WeakKeyDictionary()
_closure_memo: "weakref.WeakKeyDictionary[_jax.Jaxpr, bool]" = weakref.WeakKeyDictionary()


def _holds(eqn, found_in: Callable[[Any], bool], memo) -> bool:
    """Does ``found_in`` hold for ``eqn`` or for an equation in one of its bodies?"""
    if found_in(eqn):
        return True
    for body in hop.bodies(eqn):
        found = memo.get(body.jaxpr)
        if found is None:
            found = memo[body.jaxpr] = any(_holds(e, found_in, memo) for e in body.jaxpr.eqns)
        if found:
            return True
    return False


def _is_custom_call(eqn) -> bool:
    spec = hop.TABLE.get(eqn.primitive)
    return spec is not None and spec.thunk is not None


def _holds_custom_call(eqn) -> bool:
    return hop.TABLE.get(eqn.primitive) is not None and _holds(eqn, _is_custom_call, _custom_memo)


def _holds_closure_call(eqn) -> bool:
    """A custom call whose function closes over traced values (``num_consts > 0``), here
    or in a body."""
    return hop.TABLE.get(eqn.primitive) is not None and _holds(
        eqn, lambda e: _is_custom_call(e) and e.params["num_consts"] > 0, _closure_memo)


def _guarded_params(eqn, snapshot: Callable[[], scope.TraceContext], closures: _Closures) -> dict:
    spec = hop.TABLE[eqn.primitive]
    if spec.thunk is None:
        return hop.with_bodies(eqn, lambda body: _guarded_body(body, snapshot, closures))

    def around(call):
        with scope.activate(snapshot()):
            out = call()
        _reject_rule_variables(eqn, out[0])
        for x in out[1]:   # the function closes over nothing traced (else it is rebuilt)
            v = _jax.staged_var(x)
            if v is not None and closures.traced(v):
                raise _unpassed_closure(eqn, x)
        return out
    return dict(eqn.params, **{spec.thunk: _jax.wrap_thunk(eqn.params[spec.thunk], around)})


def _reject_rule_variables(eqn, rule: _jax.Jaxpr, passed: Sequence[Key] | None = None) -> None:
    """A rule may read only the variables passed into the rebuilt call (``passed``; with
    None, a rule re-bound as it is may touch none)."""
    if passed is None:
        if not touches_variables(rule.effects):
            return
        collection, path = walk.first_variable([rule])
    else:
        missing = sorted(traffic(rule).needs - set(passed))
        if not missing:
            return
        collection, path = missing[0]
    raise errors.TransformError(
        f"the custom rule of a raw {_custom_name(eqn)} "
        "touches variables that its function does not, so varjax has not passed "
        "them in.", collection=collection, path=path, **errors.where(eqn.source_info),
        fix="read the variable in the function as well, or pass its value as an argument")


def _guarded_body(body: ClosedJaxpr, snapshot: Callable[[], scope.TraceContext],
                  closures: _Closures) -> ClosedJaxpr:
    eqns = [e.replace(params=_guarded_params(e, snapshot, closures)) if _holds_custom_call(e) else e
            for e in body.jaxpr.eqns]
    return ClosedJaxpr(body.jaxpr.replace(eqns=eqns), body.consts)


def _nonzero(t) -> bool:
    return not isinstance(t, SymbolicZero)


def _inexact(x) -> bool:
    return jnp.issubdtype(_jax.get_aval(x).dtype, jnp.inexact)


def _custom_jvp(d: Discharger, eqn, invals, env, region):
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
    return _store(env, c.out_keys, c.out_types, list(outs))


def _custom_vjp(d: Discharger, eqn, invals, env, region):
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
    return _store(env, c.out_keys, c.out_types, list(outs))


# --- the common case, without re-tracing --------------------------------------------------

def _atom_type(value: tuple) -> VarType:
    tree, atoms = value
    return VarType(tree, tuple(a.aval.update(weak_type=False) for a in atoms))


def _is_flat(jaxpr: _jax.Jaxpr, closures: _Closures) -> bool:
    """All variable traffic is top-level var_get/var_set: no body carries any, and no
    custom call closes over traced values (``_Closures``: those are rebuilt)."""
    return not any(touches_variables(e.effects) or closures.holds(e) for e in jaxpr.eqns
                   if e.primitive is not var_get_p and e.primitive is not var_set_p)


def discharge_flat(closed: ClosedJaxpr, in_types: Sequence[tuple[Key, VarType]],
                   out_keys: Sequence[Key], closures: _Closures | None = None
                   ) -> tuple[ClosedJaxpr, list[VarType]]:
    """``Discharger.body`` for a flat jaxpr, by editing binders instead of re-tracing:
    a read's outputs are renamed to the value's variables, a write drops out."""
    closures = closures if closures is not None else _Closures([closed])
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
        _reject_hidden(eqn)
        guarded = _guard_custom_rule(eqn, env, _atom_type, closures)
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
    _jax.shard_map_p: _shard_map,
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
        d = Discharger([ctx.results.get("input"), jaxpr])   # as traced: see _Closures
        if _is_flat(jaxpr.jaxpr, d.closures):
            new, out_types = discharge_flat(jaxpr, in_types, out_keys, d.closures)
        else:
            new, out_types = d.body(jaxpr, in_types, out_keys)
        ctx.results["signature"] = Signature(tuple(in_types), tuple(zip(out_keys, out_types)))
        ctx.count(self.name, "inputs", len(in_keys))
        ctx.count(self.name, "outputs", len(out_keys))
        return new

