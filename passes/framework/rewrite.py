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
``region.state``, and reach the pass's ``PassContext`` as ``region.ctx`` when the pass
made its rewriter with it (``Rewriter(rules, ctx)``).  Passes that need more control
(state across regions, new signatures) subclass ``Rewriter`` and override ``eqn`` -- the
split torch.fx makes between ``Interpreter`` and ``Transformer``.

If no rule matches anywhere, ``run`` returns its argument unchanged (same
object), so unchanged passes are free and print-after-change is exact.  A rule
may also *decline* a matched equation by returning None from ``rewrite``: the
equation is kept as it is, and a run in which every match declined returns its
argument too (after one re-trace, which the decision needed).

**Model code in a rule.**  A pass runs after the trace, outside every module, so a rule
that calls ``vj.make_rng`` or ``vj.param`` alone has no module to act as: it is a
``ScopeError`` naming the rule (``context.in_rule``).  ``with region.ctx.in_module(eqn):``
runs it as the module that traced ``eqn``: a key drawn there is that module's next draw,
deterministic per seed and different for every draw (a noise pass: notes/writing-passes.md).

**Errors.**  An exception raised while rewriting an equation (in a rule, or in
a rewriter's own per-equation work) gets a note, ``varjax: while rewriting
`mul(f32[3], bf16[3]) -> (f32[3])` at model.py:12 (f)``, naming the innermost
equation and its user source line, as torch.fx's "While executing" does.
``VarjaxError``s are left alone: they name the user's line already.

**Splicing.** A rewriter whose rewrites are *local* (``local = True``: what a
rewrite emits depends only on the equation, its inputs and Python state, never
on values kept from other equations) does not re-trace a jaxpr in which only
top-level equations need rewriting.  Each such equation is traced alone, over
its input avals (``piece``), and its equations are spliced in place of it, with
fresh binders and the replaced equation's source line; every other equation is kept
as it is.  A pass touching a few equations of a large jaxpr
(RNG draws, casts of reads) then costs a walk, not a re-evaluation.  A pure
piece in place of an equation none of whose outputs is read is left out: an
init draws a key for every parameter, and a zeros initializer never uses its
key, so DCE would otherwise have to run afterwards only to remove those.

Sharp edges:
  * Rules must keep a body's signature (input and output avals); signature
    changes belong in a pass with its own higher-order rules (see discharge).
  * Re-tracing re-runs JAX's abstract evaluation of every equation: a pass
    costs about as much as binding the jaxpr's primitives once.
  * A rewriter whose ``eqn``/``eval`` overrides emit equations themselves is
    never reported unchanged once it re-traces (only equations the base class
    re-bound with their own input values count as kept).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ClassVar, Iterator, Sequence

from varjax import _jax
from varjax.ir import errors, liveness, nested
from varjax.ir.primitives import lift_of, var_get_p, var_set_p
from varjax.passes.framework.base import PassContext
from varjax.trace import context

ClosedJaxpr = _jax.ClosedJaxpr
_ACCESSES = (var_get_p, var_set_p)
NOTE_PREFIX = "varjax: while rewriting "


class Rule:
    """Rewrites equations of ``primitive`` (every primitive when None) that ``match``.

    A ``var_get``/``var_set`` with ``lift`` set (``primitives.lift_of``) is a lifted
    transform's boundary: it hands the variable, with the axes the transform adds, to
    bodies whose own pipelines ran this pass on their reads, with the body's shapes.  A
    rule rewriting it would apply the pass twice, the second time to the stacked value
    (one quantization scale for every layer), so rules are not offered it unless they
    set ``handed = True`` (``shard-variables``: the box names there include the added
    axes, and constraining the stacked value is what it wants)."""

    primitive: ClassVar[_jax.Primitive | None] = None
    handed: ClassVar[bool] = False

    def match(self, eqn: _jax.JaxprEqn) -> bool:
        return True

    def rewrite(self, eqn: _jax.JaxprEqn, invals: list[Any], region: "Region") -> list[Any] | None:
        """Values for ``eqn``'s outputs, or None to decline: the equation is then kept as
        it is (its bodies still rewritten), and not counted as a change."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class MovedCreations(Rule):
    """Takes over the ``var_set`` by which a lift created a pass's variable just before its
    transform (``pass_scopes.CreateOutside``: a LoRA adapter of a kernel handed to an
    ``nn.cond``): the pass creates the variable there again, drawing as it draws its other
    variables, or, when it created the variable at an earlier read with
    ``pass_scopes.declare`` (the kernel's matmul before the cond), drops the lift's
    creation (``PassScopes.recreate``).  The variable is created once, where the program
    first reaches it, with a key no other variable of the pass has.  A pass that calls
    ``declare(beside=...)`` rewrites with this rule beside its own; ``modules`` is its
    ``PassContext.modules``."""

    primitive = var_set_p
    modules: Any

    def pending(self) -> bool:
        """Whether the program has such creations: the pass must rewrite it, to take them
        over, even where it has nothing else to rewrite."""
        return self.modules is not None and self.modules.created_outside()

    def match(self, eqn: _jax.JaxprEqn) -> bool:
        return self.modules is not None and self.modules.created_outside(
            (eqn.params["collection"], eqn.params["path"]))

    def rewrite(self, eqn: _jax.JaxprEqn, invals: list[Any], region: "Region") -> list[Any]:
        self.modules.recreate((eqn.params["collection"], eqn.params["path"]))
        return []


class Region:
    """One (sub-)jaxpr being rewritten: the rewriter, the enclosing region, and state."""

    def __init__(self, rewriter: "Rewriter", parent: "Region | None" = None,
                 state: dict | None = None):
        self.rewriter = rewriter
        self.parent = parent
        self.state: dict = {} if state is None else state

    @property
    def ctx(self) -> PassContext:
        """The ``PassContext`` of the pass running this rewrite (its ``run``'s ``ctx``),
        given as ``Rewriter(rules, ctx)``: what a rule needs to run model code
        (``region.ctx.in_module(eqn)``) or to count (``region.ctx.count``)."""
        ctx = self.rewriter.ctx
        if ctx is None:
            raise errors.PassError(
                "region.ctx: this rewriter was made without the pass context.",
                source=errors.source_text(),
                fix="make it with Rewriter(rules, ctx), ctx being the PassContext the pass's "
                    "run(jaxpr, ctx) was given")
        return ctx

    def child(self, state: dict | None = None) -> "Region":
        return Region(self.rewriter, self, state)

    def bind(self, eqn: _jax.JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
        """Bind ``eqn``'s primitive on ``invals`` (optionally with new params),
        with ``eqn``'s source info."""
        with _jax.source_info_of(eqn):
            return _jax.bind_primitive(eqn.primitive, list(invals),
                                       eqn.params if params is None else params)


@dataclasses.dataclass
class _Run:
    """What one ``run`` (or one spliced piece) kept: the equations the base class re-bound
    unchanged on their own input values, and the values the base ``eval`` returned."""

    kept: set[int] = dataclasses.field(default_factory=set)
    current: tuple[Any, list[Any]] | None = None     # (equation, its input values)
    outs: list[Any] | None = None

    def unchanged(self, eqns: Sequence[_jax.JaxprEqn], outs: Sequence[Any]) -> bool:
        return (all(id(e) in self.kept for e in eqns) and self.outs is not None
                and len(outs) == len(self.outs) and all(a is b for a, b in zip(outs, self.outs)))


class Rewriter:
    """Re-traces jaxprs, dispatching equations to rules; see the module docstring."""

    local: ClassVar[bool] = False

    def __init__(self, rules: Sequence[Rule] = (), ctx: PassContext | None = None):
        self.ctx = ctx
        self.by_primitive: dict[Any, list[Rule]] = {}
        for r in rules:
            self.by_primitive.setdefault(r.primitive, []).append(r)
        # Memoised ``needs_rewrite``: bodies are asked about at every nesting level.
        self.touches: Callable[[ClosedJaxpr | _jax.Jaxpr], bool] = nested.per_jaxpr(
            lambda j: self.needs_rewrite(j))
        self._runs: list[_Run] = []

    # -- matching ------------------------------------------------------------------
    def rule_for(self, eqn: _jax.JaxprEqn) -> Rule | None:
        # Asked of every equation at every level: no list built per call.
        handed = eqn.primitive in _ACCESSES and lift_of(eqn) is not None
        for key in (eqn.primitive, None):
            for r in self.by_primitive.get(key, ()):
                if (r.handed or not handed) and r.match(eqn):
                    return r
        return None

    def wants(self, eqn: _jax.JaxprEqn) -> bool:
        """Does this equation, or anything inside its bodies, need rewriting?"""
        return self.rule_for(eqn) is not None or any(self.touches(b) for b in nested.bodies(eqn))

    def needs_rewrite(self, jaxpr: _jax.Jaxpr) -> bool:
        """Override to decide per jaxpr; by default, any equation a rule wants."""
        rules, hops = self.by_primitive, nested.TABLE
        if None in rules:
            return any(self.wants(e) for e in jaxpr.eqns)
        # Most equations have neither a rule nor a body: skipped on two dict lookups.
        return any(self.wants(e) for e in jaxpr.eqns if e.primitive in rules or e.primitive in hops)

    def rewrites(self, eqn: _jax.JaxprEqn) -> bool:
        """Does ``eqn`` itself (not its bodies) get rewritten?  Override with ``eqn``."""
        return self.rule_for(eqn) is not None

    # -- evaluation ----------------------------------------------------------------
    def run(self, closed: ClosedJaxpr, region: Region | None = None) -> ClosedJaxpr:
        """``closed`` rewritten, same signature; the same object if nothing matched or
        every match declined."""
        if not self.touches(closed):
            return closed
        region = region if region is not None else Region(self)
        if self.local and not any(self.touches(b) for e in closed.jaxpr.eqns
                                  for b in nested.bodies(e)):
            return self.splice(closed, region)
        record = _Run()
        result: list[Any] = []

        def fn(*args: Any) -> list[Any]:
            result[:] = self.eval(closed, args, region)
            return result
        with self._recording(record):
            out = self.trace(fn, list(closed.in_avals))
        return closed if record.unchanged(closed.jaxpr.eqns, result) else out

    def splice(self, closed: ClosedJaxpr, region: Region) -> ClosedJaxpr:
        """``run`` without re-tracing: each equation that ``rewrites`` is traced alone and
        its replacement spliced in; the others are kept (see "Splicing" above)."""
        jaxpr = closed.jaxpr
        constvars, consts = list(jaxpr.constvars), list(closed.consts)
        renamer = nested.Renamer()
        eqns: list[_jax.JaxprEqn] = []
        changed = False
        used: set | None = None       # the variables read, found at the first rewrite
        for eqn in jaxpr.eqns:
            new = renamer.eqn(eqn)
            if not self.rewrites(eqn):
                eqns.append(new)
                continue
            record = _Run()
            try:
                with self._recording(record):
                    piece, extra = self.piece(eqn, [a.aval for a in new.invars], region)
            except Exception as exc:
                _note(exc, eqn)
                raise
            if id(eqn) in record.kept:   # declined: keep the equation
                eqns.append(new)
                continue
            changed = True
            if used is None:
                used = _used_vars(jaxpr)
            if used.isdisjoint(eqn.outvars) and _all_dead(piece.jaxpr):
                continue   # a replacement nothing reads (an unused key) is dead code
            local = nested.Renamer(zip(piece.jaxpr.invars, [*new.invars, *extra]))
            constvars += piece.jaxpr.constvars
            consts += piece.consts
            for e in piece.jaxpr.eqns:   # fresh binders: a piece may be spliced many times
                outvars = [_jax.new_var(v.aval) for v in e.outvars]
                eqns.append(e.replace(invars=local.atoms(e.invars), outvars=outvars,
                                      source_info=eqn.source_info))
                local.rename(e.outvars, outvars)
            renamer.rename(eqn.outvars, local.atoms(piece.jaxpr.outvars))
        if not changed:
            return closed
        effects = set().union(*(e.effects for e in eqns))
        new_jaxpr = jaxpr.replace(constvars=constvars, eqns=eqns,
                                  outvars=renamer.atoms(jaxpr.outvars), effects=effects)
        return ClosedJaxpr(new_jaxpr, consts)

    def piece(self, eqn: _jax.JaxprEqn, in_avals: list[Any], region: Region
              ) -> tuple[ClosedJaxpr, list[Any]]:
        """What ``splice`` puts in place of ``eqn``: a jaxpr over ``eqn``'s inputs followed
        by ``extra`` inputs (literals), and those literals.  By default ``eqn`` is rewritten
        alone, with no extra inputs.  A rewriter whose replacements differ only in
        constants overrides this to trace one piece and reuse it with other literals: one
        trace per kind of replacement instead of one per equation."""
        return self.trace(lambda *xs: self.dispatch(eqn, list(xs), region), in_avals), []

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
            outs = self.dispatch(eqn, [read(v) for v in eqn.invars], region)
            env.update(zip(eqn.outvars, outs))
        outs = [read(v) for v in jaxpr.outvars]
        if self._runs:
            self._runs[-1].outs = outs
        return outs

    def dispatch(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        """``eqn(eqn, invals, region)`` as ``eval`` calls it: noting the equation on an
        error (see "Errors" above) and whether it is kept.  Call this, not ``eqn``, from an
        overridden ``eval``."""
        if self._runs:
            self._runs[-1].current = (eqn, invals)
        try:
            return self.eqn(eqn, invals, region)
        except Exception as exc:   # a try costs nothing until it catches, unlike a `with`
            _note(exc, eqn)
            raise

    def eqn(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        """Rewrite one equation: a matching rule, else recurse into bodies, else rebind."""
        rule = self.rule_for(eqn)
        if rule is not None:
            # What the rule emits points at eqn's source line; model code it runs outside
            # ``region.ctx.in_module`` is refused, naming the rule.
            with _jax.source_info_of(eqn), context.in_rule(rule):
                outs = rule.rewrite(eqn, invals, region)
            if outs is not None:
                return outs
        if any(self.touches(b) for b in nested.bodies(eqn)):
            params = self.rewrite_bodies(eqn, region)
            if not nested.same_bodies(eqn, params):
                return region.bind(eqn, invals, params)
        self._keep(eqn, invals)
        return region.bind(eqn, invals)

    def rewrite_bodies(self, eqn: _jax.JaxprEqn, region: Region) -> dict:
        """``eqn.params`` with every body rewritten, each in a fresh child region."""
        return nested.with_bodies(eqn, lambda body: self.run(body, region.child()))

    # -- bookkeeping of kept equations -----------------------------------------------
    @contextlib.contextmanager
    def _recording(self, record: _Run) -> Iterator[None]:
        self._runs.append(record)
        try:
            yield
        finally:
            self._runs.pop()

    def _keep(self, eqn: _jax.JaxprEqn, invals: list[Any]) -> None:
        """``eqn`` is re-bound as it is: kept, if on the very values ``eval`` read for it
        (an override that changed its inputs, as ``Autocast`` does, changed the IR)."""
        record = self._runs[-1] if self._runs else None
        if record is None or record.current is None or record.current[0] is not eqn:
            return
        read = record.current[1]
        if len(read) == len(invals) and all(a is b for a, b in zip(read, invals)):
            record.kept.add(id(eqn))


def _note(exc: Exception, eqn: _jax.JaxprEqn) -> None:
    """Add a note naming ``eqn`` and its user line to ``exc``, unless an equation nested in
    ``eqn`` was noted already or ``exc`` is a ``VarjaxError``."""
    if not isinstance(exc, errors.VarjaxError) and not any(
            n.startswith(NOTE_PREFIX) for n in getattr(exc, "__notes__", ())):
        exc.add_note(f"{NOTE_PREFIX}`{eqn_summary(eqn)}` at {errors.source_text(eqn.source_info)}")


def eqn_summary(eqn: _jax.JaxprEqn) -> str:
    """One line for an equation: ``var_get[params:w]() -> (f32[3])``, ``mul(f32[3],
    bf16[3]) -> (f32[3])``; bodies and other params left out."""
    p = eqn.params
    tag = ""
    if "collection" in p and "path" in p:
        tag = f"[{p['collection']}:{errors.format_path(p['path'])}]"
    elif "stream" in p:
        tag = f"[{p['stream']}]"
    ins = ", ".join(_aval_text(a.aval) for a in eqn.invars)
    outs = ", ".join(_aval_text(v.aval) for v in eqn.outvars)
    return f"{eqn.primitive.name}{tag}({ins}) -> ({outs})"


def _aval_text(aval: Any) -> str:
    try:
        return aval.str_short(short_dtypes=True)   # f32[3], as the printer shows it
    except (AttributeError, TypeError):            # tokens and other non-array avals
        return str(aval)


@nested.per_jaxpr
def _all_dead(jaxpr: _jax.Jaxpr) -> bool:
    """Whether DCE removes every equation of ``jaxpr`` when none of its outputs is used
    (no effect but reading variables, which are observations: ``dead-reads``).  Memoised:
    pieces are traced once per process (``lower-rng``'s shared cache)."""
    return not liveness.dce(jaxpr, [False] * len(jaxpr.outvars))[0].eqns


def _used_vars(jaxpr: _jax.Jaxpr) -> set:
    """The variables some equation or the output of ``jaxpr`` reads."""
    Var = _jax.Var
    used = {v for v in jaxpr.outvars if type(v) is Var}
    for eqn in jaxpr.eqns:
        used.update(v for v in eqn.invars if type(v) is Var)
    return used
