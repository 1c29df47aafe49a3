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
from varjax.nested import per_jaxpr, subjaxprs
from varjax.passes.base import Pass, PassContext


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


@per_jaxpr
def _size(jaxpr: _jax.Jaxpr) -> int:
    """Equations, nested ones included, as ``walk_eqns`` counts them; a body shared by
    several equations (JAX caches library ``jit`` bodies) is counted once per holder but
    walked once, and a body DCE left alone is not walked again."""
    return len(jaxpr.eqns) + sum(_size(sub) for e in jaxpr.eqns for sub in subjaxprs(e))
