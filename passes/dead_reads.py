"""dead-reads: drop variable reads whose values are never used.

Reads are observations without side effects, so a ``var_get`` none of whose
outputs is used can go (``primitives.py`` registers that DCE rule).  The pass
runs JAX's own dead-code elimination, which therefore also drops dead pure
code; effectful equations (writes, RNG draws) always stay.  Useful after
forward-stores, which leaves the first read of a forwarded chain unused.

Most programs (every ``apply`` without writes) have nothing dead, so the pass
first counts what DCE would remove in one backward walk that builds nothing, and
runs DCE only when the count is not zero.
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
        removed, _ = _walk(jaxpr.jaxpr)
        if removed == 0:
            return jaxpr
        pruned, _ = _jax.dce_jaxpr(jaxpr.jaxpr, [True] * len(jaxpr.jaxpr.outvars), instantiate=True)
        ctx.count(self.name, "removed", removed)
        return _jax.ClosedJaxpr(pruned, jaxpr.consts)


def _walk(jaxpr: _jax.Jaxpr) -> tuple[int, set]:
    """DCE's backward walk with every output used, asking each equation's DCE rule,
    counting instead of building: ``(equations removed, variables used)``, nested
    equations counted as ``walk_eqns`` counts them.  An equation whose outputs are all
    used and whose bodies are ``_clean`` keeps everything, so its rule (which would DCE a
    fresh ``custom_jvp`` body per layer) is not asked; otherwise a rule may return the
    equation with pruned bodies, counted as the difference of the bodies' sizes (JAX
    caches those DCEs, so the real run that follows reuses them)."""
    Var = _jax.Var
    live = {v for v in jaxpr.outvars if type(v) is Var}
    removed = 0
    for eqn in reversed(jaxpr.eqns):
        rule = _jax.dce_rules.get(eqn.primitive)
        used_ins = None                     # None: every input is used
        if rule is None:                    # DCE's default: keep if used or effectful
            if live.isdisjoint(eqn.outvars) and not _jax.has_effects(eqn):
                removed += _eqn_size(eqn)
                continue
        else:
            bodies = subjaxprs(eqn)
            if not (bodies and (eqn.outvars or _jax.has_effects(eqn))
                    and all(v in live for v in eqn.outvars) and all(map(_clean, bodies))):
                used_ins, new = rule([v in live for v in eqn.outvars], eqn)
                if new is None:
                    removed += _eqn_size(eqn)
                elif new is not eqn:
                    removed += sum(map(_size, bodies)) - sum(map(_size, subjaxprs(new)))
        for i, v in enumerate(eqn.invars):
            if type(v) is Var and (used_ins is None or used_ins[i]):
                live.add(v)
    return removed, live


@per_jaxpr
def _clean(jaxpr: _jax.Jaxpr) -> bool:
    """Whether DCE with every output used keeps every equation and every input."""
    removed, live = _walk(jaxpr)
    return removed == 0 and all(v in live for v in jaxpr.invars)


def _eqn_size(eqn: _jax.JaxprEqn) -> int:
    """An equation with the equations of its bodies."""
    return 1 + sum(map(_size, subjaxprs(eqn)))


@per_jaxpr
def _size(jaxpr: _jax.Jaxpr) -> int:
    """Equations, nested ones included, as ``walk_eqns`` counts them; a body shared by
    several equations (JAX caches library ``jit`` bodies) is counted once per holder but
    walked once."""
    return sum(map(_eqn_size, jaxpr.eqns))
