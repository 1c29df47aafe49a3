"""forward-stores: a read sees the value last written or read in its region.

Within one (sub-)jaxpr, ``var_set k v; ...; var_get k`` becomes ``v`` and a
second ``var_get k`` reuses the first one's values, as long as no equation in
between may write ``k`` (nested bodies are summarised by ``analysis``).
Values never cross region boundaries: a loop body or branch starts knowing
nothing, which keeps the pass correct without reasoning about iterations.
The writes themselves stay; the discharge pass turns the last one into an
output.  Run dead-reads afterwards to drop reads left unused.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from varjax import _jax
from varjax.passes import hop
from varjax.passes.analysis import eqn_traffic, key_of, touches_variables
from varjax.passes.base import Pass, PassContext
from varjax.passes.rewrite import Region, Rewriter
from varjax.primitives import var_get_p, var_set_p
from varjax.scope import VarType


class _Forwarder(Rewriter):
    def __init__(self, ctx: PassContext):
        super().__init__()
        self.ctx = ctx

    def needs_rewrite(self, jaxpr: _jax.Jaxpr) -> bool:
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
                if any(self.touches(b) for b in hop.bodies(eqn)):
                    return True
                seen -= eqn_traffic(eqn).may_write
        return False

    def eqn(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        known: dict = region.state
        if eqn.primitive is var_get_p:
            k = key_of(eqn)
            want = VarType(eqn.params["tree"], eqn.params["avals"])
            if k in known and known[k][0] == want:
                self.ctx.count(ForwardStores.name, "forwarded")
                return list(known[k][1])
            outs = region.bind(eqn, invals)
            known[k] = (want, outs)
            return outs
        if eqn.primitive is var_set_p:
            region.bind(eqn, invals)
            known[key_of(eqn)] = (VarType(eqn.params["tree"],
                                          tuple(_jax.get_aval(x).update(weak_type=False) for x in invals)),
                                  list(invals))
            return []
        outs = super().eqn(eqn, invals, region)
        if touches_variables(eqn.effects):
            for k in eqn_traffic(eqn).may_write:
                known.pop(k, None)
        return outs


@dataclasses.dataclass(frozen=True)
class ForwardStores(Pass):
    name = "forward-stores"
    summary = "forward stored/read values to later reads in the same region"
    after = ("lower-rng", "check-mutability")

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        if not touches_variables(jaxpr.effects):
            return jaxpr
        return _Forwarder(ctx).run(jaxpr)
