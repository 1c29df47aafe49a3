"""forward-stores: a read sees the value last written or read in its region.

Within one (sub-)jaxpr, ``var_set k v; ...; var_get k`` becomes ``v`` and a
second ``var_get k`` reuses the first one's values, as long as no equation in
between may write ``k`` (nested bodies are summarised by ``analysis``).
Values never cross region boundaries: a loop body or branch starts knowing
nothing, which keeps the pass correct without reasoning about iterations.
The writes themselves stay; the discharge pass turns the last one into an
output.  Run dead-reads afterwards to drop reads left unused.

The pass only renames values and drops reads, so it edits equations in place
of re-tracing them: its cost is one walk over the equations, not one abstract
evaluation of each.
"""
from __future__ import annotations

import dataclasses

from varjax import _jax
from varjax.ir import nested
from varjax.ir.primitives import VarType, var_get_p, var_set_p
from varjax.passes.framework.analysis import eqn_traffic, key_of, touches_variables
from varjax.passes.framework.base import Pass, PassContext


def _forward(closed: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
    """``closed`` with forwarded reads removed, by editing equations, never re-tracing:
    a forwarded read's outputs are renamed to the known values and the read drops out.
    Bodies that need it are forwarded the same way, each starting with nothing known."""
    jaxpr = closed.jaxpr
    known: dict = {}                 # key -> (VarType, atoms holding its current value)
    renamer = nested.Renamer()
    eqns = []
    changed = False
    for eqn in jaxpr.eqns:
        new = renamer.eqn(eqn)
        invars = new.invars
        if eqn.primitive is var_get_p:
            k = key_of(eqn)
            want = VarType(eqn.params["tree"], eqn.params["avals"])
            if k in known and known[k][0] == want:
                renamer.rename(eqn.outvars, known[k][1])
                ctx.count(ForwardStores.name, "forwarded")
                changed = True
                continue
            known[k] = (want, list(eqn.outvars))
        elif eqn.primitive is var_set_p:
            known[key_of(eqn)] = (VarType(eqn.params["tree"], tuple(
                a.aval.update(weak_type=False) for a in invars)), invars)
        elif touches_variables(eqn.effects):
            if any(_needs_forwarding(b.jaxpr) for b in nested.bodies(eqn)):
                new = new.replace(params=nested.with_bodies(eqn, lambda body: _forward(body, ctx)))
            for k in eqn_traffic(eqn).may_write:
                known.pop(k, None)
        changed = changed or new is not eqn
        eqns.append(new)
    if not changed:
        return closed
    outvars = renamer.atoms(jaxpr.outvars)
    return _jax.ClosedJaxpr(jaxpr.replace(eqns=eqns, outvars=outvars), closed.consts)


def _needs_forwarding(jaxpr: _jax.Jaxpr) -> bool:
    """A read of a key already read or written earlier in its region, here or nested."""
    seen: set = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive is var_get_p:
            if key_of(eqn) in seen:
                return True
            seen.add(key_of(eqn))
        elif eqn.primitive is var_set_p:
            seen.add(key_of(eqn))
        elif touches_variables(eqn.effects):
            if any(_needs_forwarding(b.jaxpr) for b in nested.bodies(eqn)):
                return True
            seen -= eqn_traffic(eqn).may_write
    return False


@dataclasses.dataclass(frozen=True)
class ForwardStores(Pass):
    """Gives a read the value last written or read in its region (a default pass)."""

    name = "forward-stores"
    summary = "forward stored/read values to later reads in the same region"
    after = ("lower-rng", "check-mutability")
    rootable = True     # preserves every program it runs on, whatever part it is for

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        if not touches_variables(jaxpr.effects):
            return jaxpr
        return _forward(jaxpr, ctx)
