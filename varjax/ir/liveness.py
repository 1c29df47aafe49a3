"""Dead-code elimination that leaves clean bodies alone.

JAX's ``dce_jaxpr`` asks every equation's DCE rule, and the rules of ``scan``, ``cond``
and ``while`` DCE their bodies and rebuild the equation even when nothing inside is dead.
A rebuilt body is a new jaxpr object, so JAX's DCE cache misses on it one level up: a
lifted ``nn.scan`` nested ``d`` deep prunes its transform at every level (the lift hands
in only what the body uses), and each prune walked every level below it -- O(d^2).

``dce`` is the same elimination with one shortcut, the one ``dead-reads`` counts with:
an equation whose outputs are all used and whose bodies are *clean* (DCE with every
output used keeps every equation and every input, memoised per jaxpr) is kept as it is,
with every input used, and its rule is not asked.  Anything else goes to the rule, as in
JAX.  Nothing dead means the jaxpr comes back as the same object.
"""
from __future__ import annotations

from typing import Sequence

from varjax import _jax
from varjax.ir.nested import per_jaxpr, subjaxprs


def dce(jaxpr: _jax.Jaxpr, used_outputs: Sequence[bool] | None = None, *,
        prune_inputs: bool = True) -> tuple[_jax.Jaxpr, list[bool], int]:
    """``(jaxpr without dead code, which inputs it uses, equations removed)``.

    ``used_outputs`` (default all) says which outputs to keep; the others are dropped.
    With ``prune_inputs`` unused inputs are dropped too (as ``dce_jaxpr``), else kept (as
    its ``instantiate=True``).  Removed equations count nested ones, as ``walk_eqns``
    counts them; the jaxpr is ``jaxpr`` itself when DCE would change nothing."""
    outs = [True] * len(jaxpr.outvars) if used_outputs is None else list(used_outputs)
    Var = _jax.Var
    live = {v for v, u in zip(jaxpr.outvars, outs) if u and type(v) is Var}
    kept: list[_jax.JaxprEqn] = []
    removed, rebuilt = 0, False
    for eqn in reversed(jaxpr.eqns):
        used_ins, new = _dce_eqn(eqn, live)
        if new is None:
            removed += _eqn_size(eqn)
            continue
        if new is not eqn:
            removed += _eqn_size(eqn) - _eqn_size(new)
            rebuilt = True
        kept.append(new)
        for i, v in enumerate(eqn.invars):      # the rule answered about these, not new's
            if type(v) is Var and (used_ins is None or used_ins[i]):
                live.add(v)
    used_inputs = [v in live or not prune_inputs for v in jaxpr.invars]
    if not rebuilt and len(kept) == len(jaxpr.eqns) and all(outs) and all(used_inputs):
        return jaxpr, used_inputs, 0
    kept.reverse()
    return _jax.keep_binders(jaxpr, kept, used_inputs, outs), used_inputs, removed


def _dce_eqn(eqn: _jax.JaxprEqn, live: set) -> tuple[list[bool] | None, _jax.JaxprEqn | None]:
    """``(inputs used, None: every one; the equation, None if removed)`` given the live
    variables after it: its DCE rule's answer, or JAX's default without one."""
    rule = _jax.dce_rules.get(eqn.primitive)
    if rule is None:                    # keep if used or effectful
        if live.isdisjoint(eqn.outvars) and not _jax.has_effects(eqn):
            return None, None
        return None, eqn
    bodies = subjaxprs(eqn)
    if (bodies and (eqn.outvars or _jax.has_effects(eqn))
            and all(v in live for v in eqn.outvars) and all(map(clean, bodies))):
        return None, eqn                # what the rule would answer, without asking it
    return rule([v in live for v in eqn.outvars], eqn)


@per_jaxpr
def clean(jaxpr: _jax.Jaxpr) -> bool:
    """Whether DCE with every output used keeps every equation and every input."""
    return dce(jaxpr)[0] is jaxpr


def prune(closed: _jax.ClosedJaxpr, keep: Sequence[bool] | None = None
          ) -> tuple[_jax.ClosedJaxpr, list, list[bool]]:
    """``closed`` without the inputs and constants its outputs (those marked in ``keep``,
    default all) do not need.

    Returns the pruned jaxpr (constants that may be tracers of an enclosing trace become
    leading inputs), the constants it still needs, and which original inputs it still
    takes; call it as ``f(*consts, *[x for x, used in zip(inputs, mask) if used])``."""
    n_consts = len(closed.consts)
    opened, _ = _jax.open_consts(closed)
    pruned, used, _ = dce(opened.jaxpr, keep)
    consts = [c for c, u in zip(closed.consts, used[:n_consts]) if u]
    return _jax.ClosedJaxpr(pruned, ()), consts, used[n_consts:]


def _eqn_size(eqn: _jax.JaxprEqn) -> int:
    """An equation with the equations of its bodies."""
    return 1 + sum(map(_size, subjaxprs(eqn)))


@per_jaxpr
def _size(jaxpr: _jax.Jaxpr) -> int:
    """Equations, nested ones included, as ``walk_eqns`` counts them; a body shared by
    several equations (JAX caches library ``jit`` bodies) is counted once per holder but
    walked once."""
    return sum(map(_eqn_size, jaxpr.eqns))
