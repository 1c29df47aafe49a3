"""The discharge pass core: the variable environment, the rule registry, the evaluator.

``Discharger`` re-traces an effectful jaxpr with an explicit environment ``Env``
(``(collection, path) -> (treedef, leaves)``): a ``var_get`` returns the environment's
leaves, a ``var_set`` replaces them, an equation without variable effects is re-bound
unchanged, and every other equation goes to the ``DischargeRule`` registered for its
primitive (``register_discharge_rule``).  The rules live beside this file, one file per
family (``control_flow.py``, ``shard_map.py``, ``custom.py``), and share the helpers
defined here.  The ``Discharge`` pass runs the discharger on the top-level jaxpr, or, when
all variable traffic is top-level, edits binders instead (``discharge_flat``).

The rules receive everything they use explicitly (the discharger, the environment, the
region): the user's trace, which custom-derivative rules re-enter when JAX traces them
lazily, comes from ``PassContext.reenter`` through ``Discharger.reentered``, never from an
ambient context, so the pass runs the same inside or outside a functionalize trace.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, ContextManager, Mapping, Protocol, Sequence, TypeVar

from varjax import _jax
from varjax.ir import errors, nested
from varjax.ir.effects import RngEffect, VariableEffect
from varjax.ir.effects import strip as strip_effects
from varjax.ir.primitives import Key, VarType, rng_draw_p, var_get_p, var_set_p
from varjax.passes.default.discharge.closures import Closures, guarded_params, holds_custom_call
from varjax.passes.framework.analysis import key_of, touches_variables, traffic
from varjax.passes.framework.base import Pass, PassContext
from varjax.passes.framework.rewrite import Region, Rewriter

ClosedJaxpr = _jax.ClosedJaxpr


class Env(dict):
    """The current value of each variable, ``Key -> (treedef, leaves)``: leaves are values of
    the trace being built (``Discharger``) or jaxpr atoms (``discharge_flat``).

    A dict that counts its writes (``version``), so a snapshot taken at one program point
    serves every later one until a variable is written: a model with a custom_jvp
    activation per layer would otherwise copy the whole environment once per layer
    (``Discharger.guard_custom_rules``), quadratic in depth.  A plain dict works wherever
    an ``Env`` does; it is just copied every time."""

    version = 0

    def __setitem__(self, key: Key, value: tuple[Any, list[Any]]) -> None:
        self.version += 1
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.version += 1
        super().update(*args, **kwargs)

# PassContext.reenter: ``with reenter(types):`` runs user code in the trace the program
# came from, as at a program point where the variables have ``types``.
Reenter = Callable[[Mapping[Key, VarType]], ContextManager[Any]]


@dataclasses.dataclass(frozen=True)
class Signature:
    """Where variables sit in a discharged jaxpr: leading inputs, trailing outputs."""

    inputs: tuple[tuple[Key, VarType], ...]
    outputs: tuple[tuple[Key, VarType], ...]


# --- the environment ------------------------------------------------------------------

def var_type(value: tuple[Any, list[Any]]) -> VarType:
    """The type of an environment entry whose leaves are traced values."""
    return VarType.of_leaves(*value)


def leaves_of(env: Env, keys: Sequence[Key]) -> list[Any]:
    """The leaves of the variables ``keys``, concatenated in order."""
    return [x for k in keys for x in env[k][1]]


def split_vars(flat: Sequence[Any], types: Sequence[tuple[Key, VarType]]) -> tuple[Env, list]:
    """Inverse of ``leaves_of``: the environment of ``types`` read off the front of ``flat``,
    and the rest of ``flat``."""
    env, i = Env(), 0
    for k, vt in types:
        n = len(vt.avals)
        env[k] = (vt.tree, list(flat[i:i + n]))
        i += n
    return env, list(flat[i:])


def store(env: Env, keys: Sequence[Key], types: Sequence[VarType], outs: list[Any]) -> list[Any]:
    """Split ``outs`` into (main outputs, trailing variable values); store the latter."""
    n_var = sum(len(vt.avals) for vt in types)
    main, rest = outs[:len(outs) - n_var], outs[len(outs) - n_var:]
    new_env, _ = split_vars(rest, list(zip(keys, types)))
    env.update(new_env)
    return main


def checked_read(eqn: _jax.JaxprEqn, env: Env, type_of: Callable[[tuple], VarType]) -> list:
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


def require(eqn: _jax.JaxprEqn, keys: Sequence[Key], env: Env, where: str) -> None:
    """Every variable in ``keys`` has a value before ``eqn`` (``where`` names its body)."""
    for k in keys:
        if k not in env:
            raise errors.VariableCreationError(
                f"this variable is first written inside {where} at this line, so it has no "
                "value on entry to it.", collection=k[0], path=k[1],
                **errors.where(eqn.source_info),
                fix="create (initialize) the variable before the loop or conditional")


def check_same(eqn: _jax.JaxprEqn, keys: Sequence[Key], before: Sequence[VarType],
               after: Sequence[VarType], where: str) -> None:
    """Carried variables keep their types through a loop body (``where`` names it)."""
    for k, b, a in zip(keys, before, after):
        if a != b:
            raise errors.VariableStructureError(
                f"{where} changes this variable from {b.describe()} to {a.describe()}; a "
                "carried variable must keep its structure, shapes and dtypes.",
                collection=k[0], path=k[1], **errors.where(eqn.source_info),
                fix="keep the variable's type fixed inside the loop (e.g. sow with a reduce_fn "
                    "that accumulates instead of appending)")


# --- the rule registry ----------------------------------------------------------------

class DischargeRule(Protocol):
    """Discharges the equations of one higher-order primitive: its reads and writes
    become explicit values, inputs and outputs of the rebuilt equation.

    Called as ``rule(d, eqn, invals, env, region)`` while ``d`` re-traces the region
    holding ``eqn``, for an equation whose effects include a variable effect or which
    holds a custom call closing over traced values (``Closures.holds``), under
    ``errors.enclosing(eqn.source_info)`` so errors in its bodies name its module.

    * ``d``: the ``Discharger``.  ``d.body(jaxpr, in_types, out_keys)`` turns a body into
      a pure jaxpr with leading variable inputs and trailing variable outputs;
      ``d.run_body(jaxpr, env, args)`` evaluates a body inline under the current trace;
      ``d.reentered(types)`` re-enters the user's trace for user code JAX traces late.
    * ``eqn``: the equation as it is in the effectful jaxpr (params, bodies, source info).
    * ``invals``: its operands, values of the trace being built.
    * ``env``: the value of every variable just before ``eqn``.  The rule reads what the
      bodies need (``analysis.traffic`` says which) and stores in place what they leave
      (``store``); a variable the rule does not store keeps its value.
    * ``region``: the region being re-traced; ``region.bind(eqn, operands, params)``
      binds the rebuilt equation with ``eqn``'s source line.

    Returns ``eqn``'s results, as many as ``eqn.outvars`` and with their avals: variable
    values travel through ``env``, never through the result list.
    """

    def __call__(self, d: Discharger, eqn: _jax.JaxprEqn, invals: list[Any], env: Env,
                 region: Region) -> list[Any]: ...


RULES: dict[_jax.Primitive, DischargeRule] = {}
_Rule = TypeVar("_Rule", bound=DischargeRule)


def register_discharge_rule(primitive: _jax.Primitive) -> Callable[[_Rule], _Rule]:
    """Decorator: use the decorated ``DischargeRule`` for ``primitive``'s equations
    (replacing any rule registered before, as JAX's rule tables do).

    The variable traffic of the primitive's equations must be known to
    ``analysis.traffic`` (today: an entry in ``nested.TABLE``), which sizes every
    signature discharge builds; a rule-less primitive whose equations touch variables
    raises ``UnsupportedPrimitiveError``."""
    def register(rule: _Rule) -> _Rule:
        RULES[primitive] = rule
        return rule
    return register


# --- the evaluator --------------------------------------------------------------------

class Discharger(Rewriter):
    """Evaluates effectful jaxprs with an explicit variable environment.

    ``sources`` are the jaxprs as traced (before any pass renamed their variables): they
    say which operand of a custom call holds a value its rules close over.  ``reenter``
    is ``PassContext.reenter``: custom-derivative rules are user code, which may call
    ``vj.*``, traced when JAX differentiates (None: the program has no user trace)."""

    def __init__(self, sources: Sequence[ClosedJaxpr] = (), reenter: Reenter | None = None):
        super().__init__()
        self.closures = Closures(sources)
        self.reenter = reenter
        self._last_snapshot: tuple | None = None     # (env, version, type_of, types)

    def eqn(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        env: Env = region.state["env"]
        prim = eqn.primitive
        if prim is var_get_p:
            return checked_read(eqn, env, var_type)
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
            return region.bind(eqn, invals, self.guard_custom_rules(eqn, env, var_type))
        rule = RULES.get(prim)
        if rule is None:
            raise nested.unsupported(eqn, "has variable effects but no discharge rule")
        with errors.enclosing(eqn.source_info):   # errors in the bodies name eqn's module
            return rule(self, eqn, invals, env, region)

    def reentered(self, types: Mapping[Key, VarType]) -> ContextManager[Any]:
        """Run user code as at a program point where the variables have ``types``."""
        return self.reenter(types) if self.reenter is not None else contextlib.nullcontext()

    def guard_custom_rules(self, eqn: _jax.JaxprEqn, env: Env,
                           type_of: Callable[[tuple], VarType]) -> dict | None:
        """New params for a variable-free equation holding custom_jvp/vjp calls (at any
        depth), or None.  Their rules are traced when JAX differentiates and may still run
        user code: they run re-entered in the user's trace with the variables as they are
        here, and are rejected if they touch variables (``closures.guarded_params``)."""
        if self.reenter is None or not holds_custom_call(eqn):
            return None
        types = self._types_at(env, type_of)   # computed only if JAX traces the rule
        reenter = self.reenter
        return guarded_params(eqn, lambda: reenter(types()), self.closures)

    def _types_at(self, env: Env, type_of: Callable[[tuple], VarType]
                  ) -> Callable[[], Mapping[Key, VarType]]:
        """The variables' types as ``env`` holds them now, computed on first ask: a copy
        shared with earlier calls while ``env`` is unwritten (``Env.version``)."""
        version = getattr(env, "version", None)
        last = self._last_snapshot
        if version is None or last is None or last[0] is not env or last[1] != version \
                or last[2] is not type_of:
            at_call = dict(env)
            last = self._last_snapshot = (env, version, type_of, functools.cache(
                lambda: {k: type_of(v) for k, v in at_call.items()}))
        return last[3]

    # -- building discharged bodies ---------------------------------------------------
    def run_body(self, body: ClosedJaxpr, env: Env, args: Sequence[Any]) -> list[Any]:
        """Evaluate ``body`` on ``args`` with variable environment ``env`` (mutated)."""
        return self.eval(body, args, Region(self, state={"env": env}))

    def body(self, body: ClosedJaxpr, in_types: Sequence[tuple[Key, VarType]],
             out_keys: Sequence[Key]) -> tuple[ClosedJaxpr, list[VarType]]:
        """``body`` as a pure jaxpr ``(var leaves..., args...) -> (outs..., var leaves...)``."""
        out_types: list[VarType] = []

        def fn(*flat):
            env, args = split_vars(flat, in_types)
            outs = self.run_body(body, env, args)
            out_types[:] = [var_type(env[k]) for k in out_keys]
            return outs + leaves_of(env, out_keys)

        avals = [a for _, vt in in_types for a in vt.avals] + list(body.in_avals)
        return self.trace(fn, avals), out_types


_hidden = nested.per_jaxpr(lambda j: nested.first_variable([j]))


_has_bodies: dict = {}    # primitive -> do its equations hold jaxprs (asked once per primitive)


def _reject_hidden(eqn: _jax.JaxprEqn) -> None:
    """A primitive varjax has no rule for whose equation drops its body's effects (JAX's
    ``composite`` does) would carry variable accesses, unseen, to lowering."""
    prim = eqn.primitive
    if prim in nested.TABLE or _has_bodies.get(prim) is False:
        return
    subs = nested.subjaxprs(eqn)
    _has_bodies[prim] = bool(subs) or _has_bodies.get(prim, False)
    for sub in subs:
        if _hidden(sub) != (None, None):
            raise nested.unsupported(eqn, "has a body with variable accesses but no varjax rule")


# --- the common case, without re-tracing --------------------------------------------------

def _atom_type(value: tuple) -> VarType:
    tree, atoms = value
    return VarType(tree, tuple(a.aval.update(weak_type=False) if a.aval.weak_type else a.aval
                               for a in atoms))


def _is_flat(jaxpr: _jax.Jaxpr, closures: Closures) -> bool:
    """All variable traffic is top-level var_get/var_set: no body carries any, and no
    custom call closes over traced values (``Closures``: those are rebuilt)."""
    return not any(touches_variables(e.effects) or closures.holds(e) for e in jaxpr.eqns
                   if e.primitive is not var_get_p and e.primitive is not var_set_p)


def discharge_flat(closed: ClosedJaxpr, in_types: Sequence[tuple[Key, VarType]],
                   out_keys: Sequence[Key], discharger: Discharger | None = None
                   ) -> tuple[ClosedJaxpr, list[VarType]]:
    """``Discharger.body`` for a flat jaxpr, by editing binders instead of re-tracing:
    a read's outputs are renamed to the value's variables, a write drops out.
    ``discharger`` supplies the closures and the user's trace (default: neither)."""
    d = discharger if discharger is not None else Discharger([closed])
    jaxpr = closed.jaxpr
    env = Env()
    new_invars = []
    for k, vt in in_types:
        atoms = [_jax.new_var(a) for a in vt.avals]
        env[k] = (vt.tree, atoms)
        new_invars += atoms
    rename = nested.Renamer()
    eqns = []
    changed = bool(in_types or out_keys)
    for eqn in jaxpr.eqns:
        if eqn.primitive is var_get_p:
            rename.rename(eqn.outvars, checked_read(eqn, env, _atom_type))
            changed = True
            continue
        if eqn.primitive is var_set_p:
            env[key_of(eqn)] = (eqn.params["tree"], rename.atoms(eqn.invars))
            changed = True
            continue
        new = rename.eqn(eqn)
        _reject_hidden(eqn)
        guarded = d.guard_custom_rules(eqn, env, _atom_type)
        if guarded is not None:
            new = new.replace(params=guarded)
        changed = changed or new is not eqn
        eqns.append(new)
    if not changed:
        return closed, []
    outvars = rename.atoms(jaxpr.outvars) + leaves_of(env, out_keys)
    new = _jax.rebuild_jaxpr(jaxpr, invars=new_invars + list(jaxpr.invars), outvars=outvars,
                             eqns=eqns, effects=strip_effects(jaxpr.effects))
    return ClosedJaxpr(new, closed.consts), [_atom_type(env[k]) for k in out_keys]


def _check_supplied(jaxpr: ClosedJaxpr, ctx: PassContext, needs: Any) -> None:
    """A variable a pass supplies (``Pass.supplies``) is read by the trace when the call
    does not give it, for that pass to replace the read: one still read here was not."""
    for key in sorted(k for k in needs if k not in ctx.variables and k in ctx.asked):
        eqn = next((e for e, _ in nested.walk_eqns(jaxpr)
                    if e.primitive is var_get_p and key_of(e) == key), None)
        raise errors.MissingVariableError(
            f"variable {errors.format_path(key[1])} of collection '{key[0]}' is not given, "
            "and its reads are still in the program: a pass of this call supplies it "
            "(Pass.supplies), but none replaced them.", collection=key[0], path=key[1],
            **errors.where(eqn.source_info if eqn is not None else None),
            fix="give the variable, or fix the pass that supplies it to replace every read")


@dataclasses.dataclass(frozen=True)
class Discharge(Pass):
    """Reads become inputs and writes become outputs; the result is pure."""

    name = "discharge"
    summary = "functionalize variable effects: reads -> inputs, writes -> outputs"
    requires = ("lower-rng",)
    after = ("check-mutability", "forward-stores", "dead-reads")
    discharges = True
    lowers = (VariableEffect, RngEffect)

    def run(self, jaxpr: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
        t = traffic(jaxpr)
        _check_supplied(jaxpr, ctx, t.needs)
        in_keys = sorted(k for k in t.needs if k in ctx.variables)
        out_keys = sorted(t.may_write)
        in_types = [(k, ctx.variables[k]) for k in in_keys]
        # as traced: see Closures
        d = Discharger([ctx.results.get("input"), jaxpr], reenter=ctx.reenter)
        if _is_flat(jaxpr.jaxpr, d.closures):
            new, out_types = discharge_flat(jaxpr, in_types, out_keys, d)
        else:
            new, out_types = d.body(jaxpr, in_types, out_keys)
        d.closures.detach()
        ctx.results["signature"] = Signature(tuple(in_types), tuple(zip(out_keys, out_types)))
        ctx.count(self.name, "inputs", len(in_keys))
        ctx.count(self.name, "outputs", len(out_keys))
        return new
