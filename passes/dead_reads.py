"""dead-reads: drop variable reads whose values are never used.

Reads are observations without side effects, so a ``var_get`` none of whose
outputs is used can go (``primitives.py`` registers that DCE rule).  The pass
runs JAX's own dead-code elimination, which therefore also drops dead pure
code; effectful equations (writes, RNG draws) always stay.  Useful after
forward-stores, which leaves the first read of a forwarded chain unused.
"""
from __future__ import annotations

import dataclasses

from varjax import _jax
from varjax.passes.base import Pass, PassContext
from varjax.passes.walk import walk_eqns


@dataclasses.dataclass(frozen=True)
class DeadReads(Pass):
    name = "dead-reads"
    summary = "remove reads whose results are unused (and other dead pure code)"
    after = ("forward-stores",)

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        pruned, _ = _jax.dce_jaxpr(jaxpr.jaxpr, [True] * len(jaxpr.jaxpr.outvars), instantiate=True)
        removed = _size(jaxpr.jaxpr) - _size(pruned)
        if removed == 0:
            return jaxpr
        ctx.count(self.name, "removed", removed)
        return _jax.ClosedJaxpr(pruned, jaxpr.consts)


def _size(jaxpr: _jax.Jaxpr) -> int:
    return sum(1 for _ in walk_eqns(jaxpr))
