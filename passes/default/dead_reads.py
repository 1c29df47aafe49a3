"""dead-reads: drop variable reads whose values are never used.

Reads are observations without side effects, so a ``var_get`` none of whose
outputs is used can go (``primitives.py`` registers that DCE rule).  The pass
runs dead-code elimination, which therefore also drops dead pure code;
effectful equations (writes, RNG draws) always stay.  Useful after
forward-stores, which leaves the first read of a forwarded chain unused.

Most programs (every ``apply`` without writes) have nothing dead.  The
elimination is ``varjax.ir.liveness.dce``: JAX's, except that it keeps an equation
whose bodies are memoised as clean without asking its rule, so a program with
nothing dead is walked once and comes back as the same object.
"""
from __future__ import annotations

import dataclasses

from varjax import _jax
from varjax.ir import liveness
from varjax.passes.framework.base import Pass, PassContext


@dataclasses.dataclass(frozen=True)
class DeadReads(Pass):
    """Removes variable reads whose values are unused, and other dead pure code (a default
    pass)."""

    name = "dead-reads"
    summary = "remove reads whose results are unused (and other dead pure code)"
    after = ("forward-stores",)
    rootable = True     # preserves every program it runs on, whatever part it is for

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        pruned, _, removed = liveness.dce(jaxpr.jaxpr, prune_inputs=False)
        if pruned is jaxpr.jaxpr:
            return jaxpr
        ctx.count(self.name, "removed", removed)
        return _jax.ClosedJaxpr(pruned, jaxpr.consts)
