"""The IR verifier: JAX's type checker plus varjax's own invariants.

JAX checks that a jaxpr is well typed and that each equation's effects appear
on the jaxpr holding it.  varjax adds rules JAX cannot know:

* every variable/RNG effect of a sub-jaxpr also appears on the equation
  holding it.  Passes decide what to skip from effect sets alone, so a lost
  effect makes every later pass silently skip that region;
* every collection is one the caller declared (when it declares any; a
  pipeline declares ``PassContext.known_collections()``), so a misspelt
  collection fails here instead of as a missing input much later.  varjax's
  own ``__*`` collections are always known;
* after a discharging pass no ``var_get``/``var_set``/``rng_draw`` and no
  varjax effect is left anywhere: those cannot be lowered to XLA.

``verify`` checks one jaxpr.  ``Verify`` is the instrumentation a pipeline
runs after every pass, which pins a broken IR on the pass that produced it
instead of on whichever later pass trips over the damage.

Sharp edges:
  * varjax's rules run before JAX's checker, so a jaxpr broken both ways
    reports the varjax problem.
  * Jaxprs behind thunks (``custom_vjp``'s fwd/bwd) are not checked; see
    ``varjax/ir/nested.py``.
  * An unchanged jaxpr is not re-verified unless the rules just tightened
    (a discharging pass ran).
"""
from __future__ import annotations

from typing import AbstractSet, Iterable

import jax.extend.core as jex

from varjax import _jax
from varjax.ir import errors
from varjax.ir.effects import VariableEffect, varjax_effects
from varjax.ir.errors import VerificationError
from varjax.ir.nested import enclosing_eqns, subjaxprs, walk_eqns
from varjax.ir.primitives import VARJAX_PRIMITIVES, is_internal
from varjax.passes.framework.base import Pass, PassContext
from varjax.passes.framework.instrument import DUMP_DIR_ENV, Instrumentation

WINDOW = 10  # equations shown on each side of a bad one


def verify(jaxpr: _jax.ClosedJaxpr, *, discharged: bool = False,
           known_collections: AbstractSet[str] | None = None) -> None:
    """Raise ``VerificationError`` if ``jaxpr`` breaks JAX's or varjax's rules."""
    _check(jaxpr, discharged, known_collections, stage="")


class Verify(Instrumentation):
    """Verify the pipeline input and the IR after every pass.

    Once a pass with ``discharges = True`` has run, every later IR must be
    free of varjax primitives and effects.
    """

    def __init__(self, known_collections: AbstractSet[str] | None = None):
        self.known_collections = known_collections
        self._discharged = False

    def before_pipeline(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> None:
        self._discharged = False
        _check(jaxpr, False, self.known_collections, stage=" in the pipeline input")

    def after_pass(self, p: Pass, before: _jax.ClosedJaxpr, after: _jax.ClosedJaxpr,
                   ctx: PassContext) -> None:
        discharged = self._discharged or p.discharges
        if after is before and discharged == self._discharged:
            return  # same IR under the same rules: verified already
        self._discharged = discharged
        _check(after, discharged, self.known_collections, stage=f" after pass '{p.spec()}'",
               fix=f"pass '{p.spec()}' produced this IR; set {DUMP_DIR_ENV}=<dir> to "
                   "dump the IR before and after it")


def _check(jaxpr: _jax.ClosedJaxpr, discharged: bool, known: AbstractSet[str] | None, *,
           stage: str, fix: str | None = None) -> None:
    fix = fix or (f"fix the code that built this IR (varjax's tracing, or your own); set "
                  f"{DUMP_DIR_ENV}=<dir> to dump the IR at each pipeline stage")

    def fail(problem: str, holder: _jax.Jaxpr, eqn: _jax.JaxprEqn | None = None,
             collection: str | None = None) -> None:
        what = f"invalid IR{stage}: {problem}\n\n" + _show(holder, eqn)
        if eqn is not None and collection is None:
            collection = eqn.params.get("collection")
        path = eqn.params.get("path") if eqn is not None else None
        # Without a culprit equation, the user's line that ran the pipeline.
        with errors.enclosing(*(e.source_info for e in (enclosing_eqns(jaxpr, eqn) if eqn else []))):
            where = errors.where(eqn.source_info if eqn is not None else None)
        raise VerificationError(what, collection=collection, path=path, fix=fix, **where)

    for eqn, holder in walk_eqns(jaxpr):
        effs = varjax_effects(eqn.effects)
        if discharged and eqn.primitive in VARJAX_PRIMITIVES:
            fail(f"{eqn.primitive.name} remains after a discharging pass", holder, eqn,
                 eqn.params.get("collection"))
        if discharged and effs:
            fail(f"effects {_fmt(effs)} remain after a discharging pass", holder, eqn)
        missing = effs - set(holder.effects)
        if missing:
            fail(f"equation effects {_fmt(missing)} are missing from the effects of the "
                 f"jaxpr holding it {_fmt(holder.effects)}", holder, eqn)
        for name in _unknown(effs, known):
            fail(f"unknown collection '{name}' (known: {', '.join(sorted(known))})",
                 holder, eqn, name)
        for k, sub in enumerate(subjaxprs(eqn)):
            lost = varjax_effects(sub.effects) - set(eqn.effects)
            if lost:
                fail(f"sub-jaxpr #{k} of `{eqn.primitive.name}` has effects {_fmt(lost)} "
                     f"that the equation lacks {_fmt(eqn.effects)}", holder, eqn)
    # Effects no equation explains; checked last so that a culprit equation wins.
    top = jaxpr.jaxpr
    if discharged and varjax_effects(top.effects):
        fail(f"effects {_fmt(varjax_effects(top.effects))} remain on the jaxpr after "
             "a discharging pass", top)
    for name in _unknown(top.effects, known):
        fail(f"jaxpr effects name unknown collection '{name}'", top, collection=name)
    try:
        jex.check_jaxpr(top)
    except jex.JaxprTypeError as exc:
        raise VerificationError(f"invalid IR{stage}: JAX's type check failed:\n{exc}",
                                fix=fix, source=errors.source_text()) from exc


def _unknown(effs: Iterable[object], known: AbstractSet[str] | None) -> list[str]:
    if known is None:
        return []
    return sorted({e.collection for e in effs if type(e) is VariableEffect
                   and e.collection not in known and not is_internal(e.collection)})


def _fmt(effs: Iterable[object]) -> str:
    return "{" + ", ".join(sorted(map(repr, effs))) + "}"


def _show(jaxpr: _jax.Jaxpr, eqn: _jax.JaxprEqn | None) -> str:
    """The bad equation and a window of ``jaxpr`` around it, marked with ``-->``.

    Printed from one rendering of the whole jaxpr, so variable names agree
    between the equation, the window and a dump of the same IR.
    """
    lines = jaxpr.pretty_print(source_info=True, print_effects=True).splitlines()
    # Lines before the last column-0 "{" are `let f = {...} in` bodies of jit calls.
    head = max(i for i, line in enumerate(lines) if line.startswith("{"))
    # An equation starts at indent 4; "    ] x" closes a multi-line params block.
    starts = [i for i in range(head + 1, len(lines))
              if lines[i].startswith("    ") and lines[i][4] not in " ]"]
    if len(starts) != len(jaxpr.eqns):  # printer layout not understood: show it all
        return "while checking jaxpr:\n" + "\n".join(lines)
    first = starts[-1] + 1 if starts else head + 1
    tail = next((i for i in range(first, len(lines)) if not lines[i].startswith("    ")),
                len(lines))
    bounds = starts + [tail]
    index = 0 if eqn is None else next(i for i, e in enumerate(jaxpr.eqns) if e is eqn)
    lo, hi = max(0, index - WINDOW), min(len(starts), index + WINDOW + 1)
    window = [lines[head]] + (["    ..."] if lo > 0 else [])
    for i in range(lo, hi):
        block = lines[bounds[i]:bounds[i + 1]]
        if eqn is not None and i == index:
            block = ["--> " + block[0][4:]] + block[1:]
        window += block
    window += (["    ..."] if hi < len(starts) else []) + lines[tail:]
    if eqn is None:
        return "while checking jaxpr:\n" + "\n".join(window)
    bad = "\n".join(lines[bounds[index]:bounds[index + 1]])
    return f"in equation:\n{bad}\n\nwhile checking jaxpr:\n" + "\n".join(window)
