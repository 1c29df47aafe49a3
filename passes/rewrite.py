"""The rewriter: re-trace a jaxpr, letting rules replace the equations they match.

A pass author writes *rules*, not tree walks.  A rule names the primitive it
cares about, may refine the match, and rewrites a matched equation by running
ordinary JAX code on the equation's input values::

    class CastRead(Rule):
        primitive = var_get_p
        def match(self, eqn): return eqn.params["collection"] == "params"
        def rewrite(self, eqn, invals, region):
            outs = region.bind(eqn, invals)          # the original read
            return [x.astype(jnp.bfloat16) for x in outs]

``Rewriter(rules).run(closed_jaxpr)`` evaluates the jaxpr under a fresh JAX
trace (JAX's "custom interpreter" recipe): unmatched equations are bound
unchanged, with their source info, and bodies of higher-order primitives
(jit, scan, while, cond, checkpoint, custom_jvp/vjp) are rewritten
recursively, each in a child ``Region``.  Rules keep per-region state in
``region.state``.  Passes that need more control (state across regions, new
signatures) subclass ``Rewriter`` and override ``eqn`` -- the split torch.fx
makes between ``Interpreter`` and ``Transformer``.

If no rule matches anywhere, ``run`` returns its argument unchanged (same
object), so unchanged passes are free and print-after-change is exact.

**Splicing.** A rewriter whose rewrites are *local* (``local = True``: what a
rewrite emits depends only on the equation, its inputs and Python state, never
on values kept from other equations) does not re-trace a jaxpr in which only
top-level equations need rewriting.  Each such equation is traced alone, over
its input avals (``piece``), and its equations are spliced in place of it, with
fresh binders and the replaced equation's source line; every other equation is kept
as it is.  A pass touching a few equations of a large jaxpr
(RNG draws, casts of reads) then costs a walk, not a re-evaluation.

Sharp edges:
  * Rules must keep a body's signature (input and output avals); signature
    changes belong in a pass with its own higher-order rules (see discharge).
  * Re-tracing re-runs JAX's abstract evaluation of every equation: a pass
    costs about as much as binding the jaxpr's primitives once.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Sequence

from varjax import _jax
from varjax.passes import hop

ClosedJaxpr = _jax.ClosedJaxpr


class Rule:
    """Rewrites equations of ``primitive`` (every primitive when None) that ``match``."""

    primitive: ClassVar[_jax.Primitive | None] = None

    def match(self, eqn: _jax.JaxprEqn) -> bool:
        return True

    def rewrite(self, eqn: _jax.JaxprEqn, invals: list[Any], region: "Region") -> list[Any]:
        raise NotImplementedError


class Region:
    """One (sub-)jaxpr being rewritten: the rewriter, the enclosing region, and state."""

    def __init__(self, rewriter: "Rewriter", parent: "Region | None" = None,
                 state: dict | None = None):
        self.rewriter = rewriter
        self.parent = parent
        self.state: dict = {} if state is None else state

    def child(self, state: dict | None = None) -> "Region":
        return Region(self.rewriter, self, state)

    def bind(self, eqn: _jax.JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
        """Bind ``eqn``'s primitive on ``invals`` (optionally with new params),
        with ``eqn``'s source info."""
        with _jax.source_info_of(eqn):
            return _jax.bind_primitive(eqn.primitive, list(invals),
                                       eqn.params if params is None else params)


class Rewriter:
    """Re-traces jaxprs, dispatching equations to rules; see the module docstring."""

    local: ClassVar[bool] = False

    def __init__(self, rules: Sequence[Rule] = ()):
        self.by_primitive: dict[Any, list[Rule]] = {}
        for r in rules:
            self.by_primitive.setdefault(r.primitive, []).append(r)
        self._touched: dict[int, tuple[Any, bool]] = {}

    # -- matching ------------------------------------------------------------------
    def rule_for(self, eqn: _jax.JaxprEqn) -> Rule | None:
        for r in self.by_primitive.get(eqn.primitive, []) + self.by_primitive.get(None, []):
            if r.match(eqn):
                return r
        return None

    def wants(self, eqn: _jax.JaxprEqn) -> bool:
        """Does this equation, or anything inside its bodies, need rewriting?"""
        return self.rule_for(eqn) is not None or any(self.touches(b) for b in hop.bodies(eqn))

    def touches(self, jaxpr: ClosedJaxpr | _jax.Jaxpr) -> bool:
        """Memoised ``needs_rewrite`` (bodies are asked about at every nesting level)."""
        j = getattr(jaxpr, "jaxpr", jaxpr)
        hit = self._touched.get(id(j))
        if hit is None or hit[0] is not j:
            hit = self._touched[id(j)] = (j, self.needs_rewrite(j))
        return hit[1]

    def needs_rewrite(self, jaxpr: _jax.Jaxpr) -> bool:
        """Override to decide per jaxpr; by default, any equation a rule wants."""
        return any(self.wants(e) for e in jaxpr.eqns)

    def rewrites(self, eqn: _jax.JaxprEqn) -> bool:
        """Does ``eqn`` itself (not its bodies) get rewritten?  Override with ``eqn``."""
        return self.rule_for(eqn) is not None

    # -- evaluation ----------------------------------------------------------------
    def run(self, closed: ClosedJaxpr, region: Region | None = None) -> ClosedJaxpr:
        """``closed`` rewritten, same signature; the same object if nothing matched."""
        if not self.touches(closed):
            return closed
        region = region if region is not None else Region(self)
        if self.local and not any(self.touches(b) for e in closed.jaxpr.eqns for b in hop.bodies(e)):
            return self.splice(closed, region)
        return self.trace(lambda *args: self.eval(closed, args, region), list(closed.in_avals))

    def splice(self, closed: ClosedJaxpr, region: Region) -> ClosedJaxpr:
        """``run`` without re-tracing: each equation that ``rewrites`` is traced alone and
        its replacement spliced in; the others are kept (see "Splicing" above)."""
        jaxpr = closed.jaxpr
        constvars, consts = list(jaxpr.constvars), list(closed.consts)
        rename: dict = {}

        def sub(a):
            return rename.get(a, a) if isinstance(a, _jax.Var) else a

        eqns = []
        for eqn in jaxpr.eqns:
            invars = [sub(a) for a in eqn.invars]
            if not self.rewrites(eqn):
                eqns.append(eqn if invars == list(eqn.invars) else eqn.replace(invars=invars))
                continue
            piece, extra = self.piece(eqn, [a.aval for a in invars], region)
            local = dict(zip(piece.jaxpr.invars, invars + extra))
            constvars += piece.jaxpr.constvars
            consts += piece.consts
            for e in piece.jaxpr.eqns:   # fresh binders: a piece may be spliced many times
                outvars = [_jax.new_var(v.aval) for v in e.outvars]
                eqns.append(e.replace(invars=[local.get(a, a) if isinstance(a, _jax.Var) else a
                                              for a in e.invars],
                                      outvars=outvars, source_info=eqn.source_info))
                local.update(zip(e.outvars, outvars))
            rename.update((o, local.get(n, n) if isinstance(n, _jax.Var) else n)
                          for o, n in zip(eqn.outvars, piece.jaxpr.outvars))
        effects = set().union(*(e.effects for e in eqns))
        new = jaxpr.replace(constvars=constvars, eqns=eqns, outvars=[sub(a) for a in jaxpr.outvars],
                            effects=effects)
        return ClosedJaxpr(new, consts)

    def piece(self, eqn: _jax.JaxprEqn, in_avals: list[Any], region: Region
              ) -> tuple[ClosedJaxpr, list[Any]]:
        """What ``splice`` puts in place of ``eqn``: a jaxpr over ``eqn``'s inputs followed
        by ``extra`` inputs (literals), and those literals.  By default ``eqn`` is rewritten
        alone, with no extra inputs.  A rewriter whose replacements differ only in
        constants overrides this to trace one piece and reuse it with other literals: one
        trace per kind of replacement instead of one per equation."""
        return self.trace(lambda *xs: self.eqn(eqn, list(xs), region), in_avals), []

    def trace(self, fn: Callable[..., Sequence[Any]], in_avals: list[Any]) -> ClosedJaxpr:
        return _jax.trace_to_jaxpr(lambda *a: list(fn(*a)), in_avals)

    def eval(self, closed: ClosedJaxpr, args: Sequence[Any], region: Region) -> list[Any]:
        """Evaluate ``closed`` on ``args`` under the current trace, rewriting as it goes."""
        env: dict[Any, Any] = {}
        jaxpr = closed.jaxpr
        env.update(zip(jaxpr.constvars, closed.consts))
        env.update(zip(jaxpr.invars, args))

        def read(v):
            return v.val if isinstance(v, _jax.Literal) else env[v]

        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(v) for v in eqn.invars], region)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        """Rewrite one equation: a matching rule, else recurse into bodies, else rebind."""
        rule = self.rule_for(eqn)
        if rule is not None:
            with _jax.source_info_of(eqn):   # what the rule emits points at eqn's source line
                return rule.rewrite(eqn, invals, region)
        if any(self.touches(b) for b in hop.bodies(eqn)):
            return region.bind(eqn, invals, self.rewrite_bodies(eqn, region))
        return region.bind(eqn, invals)

    def rewrite_bodies(self, eqn: _jax.JaxprEqn, region: Region) -> dict:
        """``eqn.params`` with every body rewritten, each in a fresh child region."""
        return hop.with_bodies(eqn, lambda body: self.run(body, region.child()))
