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
from varjax.passes.walk import AnyJaxpr, open_jaxpr, subjaxprs


@dataclasses.dataclass(frozen=True)
class DeadReads(Pass):
    name = "dead-reads"
    summary = "remove reads whose results are unused (and other dead pure code)"
    after = ("forward-stores",)

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        pruned, _ = _jax.dce_jaxpr(jaxpr.jaxpr, [True] * len(jaxpr.jaxpr.outvars), instantiate=True)
        memo: dict[int, tuple] = {}
        removed = _size(jaxpr.jaxpr, memo) - _size(pruned, memo)
        if removed == 0:
            return jaxpr
        ctx.count(self.name, "removed", removed)
        return _jax.ClosedJaxpr(pruned, jaxpr.consts)


def _size(jaxpr: AnyJaxpr, memo: dict[int, tuple]) -> int:
    """Equations, nested ones included, as ``walk_eqns`` counts them; a body shared by
    several equations (JAX caches library ``jit`` bodies) is counted once per holder but
    walked once."""
    j = open_jaxpr(jaxpr)
    hit = memo.get(id(j))
    if hit is None or hit[0] is not j:
        hit = memo[id(j)] = (j, len(j.eqns) + sum(_size(sub, memo) for e in j.eqns
                                                   for sub in subjaxprs(e)))
    return hit[1]
