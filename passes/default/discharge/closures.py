"""Custom-derivative calls in discharge: the values their rules close over, and guards.

Two problems come from JAX tracing a custom_jvp/custom_vjp rule lazily, when it first
differentiates, which may be after the functionalize trace has ended:

* A rule that closes over a value traced in the function (a ``vj.param`` read) holds a
  tracer of the ended trace.  ``Closures`` finds which leading operand of the call holds
  the same value, so the rebuilt call (``custom.py``) can pass it in and substitute it.
* A rule of a variable-free call is re-bound as it is, yet may still run user code
  (``vj.*``).  ``guarded_params`` wraps its thunk so it runs re-entered in the user's trace
  (``enter``, from ``PassContext.reenter``) and rejects variables the function does not
  touch, since nothing passes them in.  The check for traced values needs the function's
  variables after the pass: ``Closures.detach`` keeps them for a user's rule, and for a
  library rule (``jax.nn.relu``'s, by the file its thunk names) keeps nothing, so that a
  compiled function does not hold its effectful trace.

Nothing here knows the discharger: the pass core (``discharger.py``) and the custom-derivative
rules (``custom.py``) build on it.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, ContextManager, Sequence

from varjax import _jax
from varjax.ir import errors, nested
from varjax.ir.primitives import Key, var_get_p
from varjax.passes.framework.analysis import touches_variables, traffic

ClosedJaxpr = _jax.ClosedJaxpr


def custom_name(eqn: _jax.JaxprEqn) -> str:
    """The user-facing name of a custom call's primitive, for messages."""
    return "jax." + eqn.primitive.name.removesuffix("_call")


def unpassed_closure(eqn: _jax.JaxprEqn, x: Any) -> errors.TransformError:
    """The error for a rule closing over a traced value its function does not use: no
    operand of the call holds it, so it cannot be passed in."""
    collection, path = read_behind(x)
    return errors.TransformError(
        f"the custom rule of this raw {custom_name(eqn)} closes over a value traced in the "
        "function that the custom function itself does not use, so varjax cannot pass the "
        "value in" + (" (the value is, or is computed from, this variable)." if path else "."),
        collection=collection, path=path, **errors.where(eqn.source_info),
        fix="use the value in the custom function as well, or pass it in as an argument")


def read_behind(x: Any, limit: int = 256) -> tuple[str | None, tuple | None]:
    """``(collection, path)`` of the first variable read that the traced value ``x`` is
    computed from (searching the ended trace's equations back from ``x``), or (None, None)."""
    todo, seen = [x], set()
    while todo and len(seen) < limit:
        t = todo.pop(0)
        if id(t) in seen:
            continue
        seen.add(id(t))
        producer = _jax.staged_producer(t)
        if producer is None:
            continue
        prim, params, ins = producer
        if prim is var_get_p:
            return params["collection"], params["path"]
        todo.extend(ins)
    return None, None


class Closures:
    """Which leading operands of a custom call hold the values its rules close over.

    A custom function that closes over a value traced in the function (a ``vj.param``
    read) gets the value as one of its equation's ``num_consts`` leading operands.  Its
    rules close over the same Python tracer, which belongs to a trace that has ended when
    JAX traces them: staged as a constant, it fails with "No constant handler ... Tracer".
    Such a tracer still knows its jaxpr variable, so the table is read off the jaxprs as
    traced (passes rename variables, and a re-bound call has ``num_consts=0``), following
    each body input back to the operand it receives.  Calls are matched by
    ``_jax.thunk_identity`` of their rule thunk (the rule's source and argument names),
    which every rewrap keeps; calls of one function share their positions' names, so a
    name found at two positions is ambiguous and raises."""

    def __init__(self, sources: Sequence[ClosedJaxpr]):
        self.sources = [s for s in sources if s is not None]
        # ``traced`` asks about values of the function's trace: the first source is the
        # jaxpr as traced; the later ones given here are it after passes, which add no
        # value user code could have held (only their constants count).
        self._rewritten = {id(s.jaxpr) for s in self.sources[1:]} - {
            id(s.jaxpr) for s in self.sources[:1]}
        self._walked = 0
        self._table: dict[Any, tuple[frozenset, list[frozenset]]] = {}   # (counts, names)
        self._vars: set | None = None
        self._any: bool | None = None
        self._holds = self._new_memo()
        self.asked_later = False   # a rule was wrapped or rebuilt: asked after the pass

    def _new_memo(self) -> nested.per_jaxpr:
        return nested.per_jaxpr(lambda j: any(self.holds(e) for e in j.eqns))

    def add(self, source: ClosedJaxpr) -> None:
        if not any(s.jaxpr is source.jaxpr for s in self.sources):
            self.sources.append(source)
            if self._vars is not None:
                self._vars |= _traced_vars(source)   # a rule's jaxpr: a whole source
            self._any = None
            self._holds = self._new_memo()

    def _update(self) -> None:
        while self._walked < len(self.sources):
            self._walk(self.sources[self._walked], {})
            self._walked += 1

    def _walk(self, closed: ClosedJaxpr, roots: dict) -> None:
        roots = dict(roots)
        for var, c in zip(closed.jaxpr.constvars, closed.consts):
            if _jax.staged_var(c) is not None:
                roots[var] = frozenset((var, _jax.staged_var(c)))
        for eqn in closed.jaxpr.eqns:
            spec = nested.TABLE.get(eqn.primitive)
            if spec is None:
                continue
            ids = [roots.get(v, frozenset((v,))) if isinstance(v, _jax.Var) else frozenset()
                   for v in eqn.invars]
            if spec.thunk is not None and eqn.params["num_consts"]:
                # Calls of one custom function (and their copies in other sources) share
                # a key: each position collects every name its operand had.
                key = _thunk_key(eqn.params[spec.thunk])
                found = ids[:eqn.params["num_consts"]]
                counts, old = self._table.get(key, (frozenset(), ()))
                self._table[key] = (counts | {len(found)}, [a | b for a, b in itertools.zip_longest(
                    old, found, fillvalue=frozenset())])
            for body, index in nested.passthrough(eqn):
                self._walk(body, {v: ids[i] | {v} for v, i in zip(body.jaxpr.invars, index)
                                  if i is not None})

    def closure(self, eqn) -> list[frozenset]:
        """Per closed-over leading operand of the custom call ``eqn``, its names as traced."""
        self.asked_later = True    # asked when rebuilding the call, whose rules run later
        self._update()
        n = eqn.params["num_consts"]
        counts, found = self._table.get(_thunk_key(eqn.params[nested.TABLE[eqn.primitive].thunk]),
                                        ({n}, []))
        if not n and len(counts) > 1:   # re-bound, and its calls closed over unlike numbers
            return []
        found = list(found)[:n or max(counts)]
        return found + [frozenset()] * (n - len(found))

    def holds(self, eqn) -> bool:
        """Does ``eqn``, or an equation in its bodies, call a custom function that closes
        over traced values?  Discharge rebuilds those (and re-traces the bodies around)."""
        if self._any is None:
            self._any = any(_holds_closure_call(e) for s in self.sources for e in s.jaxpr.eqns
                            if e.primitive in nested.TABLE)
        if not self._any or nested.TABLE.get(eqn.primitive) is None:
            return False
        if _is_custom_call(eqn) and self.closure(eqn):
            return True
        return any(self._holds(body) for body in nested.bodies(eqn))

    def detach(self) -> None:
        """Let the jaxprs go when the pass is done (a compiled function would otherwise
        hold its effectful trace).  What outlives the pass is the custom rules it wrapped
        or rebuilt, which JAX traces later: they ask ``traced``, whose variables are kept,
        and ``add`` the rules' own jaxprs, walked from the start."""
        if self.asked_later:
            self.traced(None)
        # ``_rewritten`` names the dropped jaxprs by id, which a later source may reuse.
        self.sources, self._walked, self._rewritten = [], 0, set()

    def traced(self, var) -> bool:
        """Is ``var`` a variable of a jaxpr as traced (a value of the function's trace)?"""
        if self._vars is None:
            self._vars = set().union(*(
                _traced_vars(s, whole=id(s.jaxpr) not in self._rewritten) for s in self.sources))
        return var in self._vars


def _traced_vars(closed: ClosedJaxpr, whole: bool = True) -> set:
    """The variables its constants stand for and, if ``whole``, every variable of
    ``closed`` and its bodies."""
    found = {v for v in map(_jax.staged_var, closed.consts) if v is not None}
    todo = [closed.jaxpr] if whole else []
    while todo:               # a loop, not walk_eqns: every equation of the model is visited
        jaxpr = todo.pop()
        found.update(jaxpr.invars)
        found.update(jaxpr.constvars)
        for e in jaxpr.eqns:
            found.update(e.outvars)
            todo.extend(map(nested.open_jaxpr, nested.subjaxprs(e)))
    return found


def _thunk_key(thunk) -> Any:
    key = _jax.thunk_identity(thunk)
    try:
        hash(key)
    except TypeError:
        return id(thunk)
    return key


def _holds(eqn, found_in: Callable[[Any], bool], memo: nested.per_jaxpr) -> bool:
    """Does ``found_in`` hold for ``eqn`` or for an equation in one of its bodies?
    ``memo(body)`` answers for a whole body."""
    return found_in(eqn) or any(memo(body) for body in nested.bodies(eqn))


def _holds_in(found_in: Callable[[Any], bool]) -> nested.per_jaxpr:
    """Whether ``found_in`` holds for an equation of a body, at any depth: once per body."""
    memo: nested.per_jaxpr = nested.per_jaxpr(lambda j: any(_holds(e, found_in, memo) for e in j.eqns))
    return memo


def _is_custom_call(eqn) -> bool:
    spec = nested.TABLE.get(eqn.primitive)
    return spec is not None and spec.thunk is not None


def holds_custom_call(eqn: _jax.JaxprEqn) -> bool:
    """A custom call here or in a body (at any depth): its rules are user code JAX may
    trace later."""
    return nested.TABLE.get(eqn.primitive) is not None and _holds(eqn, _is_custom_call, _custom_in)


def _holds_closure_call(eqn) -> bool:
    """A custom call whose function closes over traced values (``num_consts > 0``), here
    or in a body."""
    return nested.TABLE.get(eqn.primitive) is not None and _holds(eqn, _is_closure_call, _closure_in)


def _is_closure_call(eqn) -> bool:
    return _is_custom_call(eqn) and eqn.params["num_consts"] > 0


_custom_in = _holds_in(_is_custom_call)
_closure_in = _holds_in(_is_closure_call)


def guarded_params(eqn: _jax.JaxprEqn, enter: Callable[[], ContextManager[Any]],
                   closures: Closures) -> dict:
    """``eqn.params`` (of an equation without variable effects that ``holds_custom_call``)
    with every custom rule inside wrapped: JAX traces the rule under ``enter()`` (the
    user's trace re-entered at the call site), so ``vj.*`` calls there work, and the
    rule is rejected if it touches variables or closes over a traced value, since the
    call is re-bound as it is and nothing passes those in."""
    spec = nested.TABLE[eqn.primitive]
    if spec.thunk is None:
        return nested.with_bodies(eqn, lambda body: _guarded_body(body, enter, closures))
    # A library rule (jax.nn.relu's) closes over no value of the user's trace: only a
    # user's rule keeps the traced variables alive for the check below.
    closures.asked_later |= not _jax.is_library_thunk(eqn.params[spec.thunk])

    def around(call):
        with enter():
            out = call()
        reject_rule_variables(eqn, out[0])
        for x in out[1]:   # the function closes over nothing traced (else it is rebuilt)
            v = _jax.staged_var(x)
            if v is not None and closures.traced(v):
                raise unpassed_closure(eqn, x)
        return out
    return dict(eqn.params, **{spec.thunk: _jax.wrap_thunk(eqn.params[spec.thunk], around)})


def reject_rule_variables(eqn: _jax.JaxprEqn, rule: _jax.Jaxpr, passed: Sequence[Key] | None = None) -> None:
    """A rule may read only the variables passed into the rebuilt call (``passed``; with
    None, a rule re-bound as it is may touch none)."""
    if passed is None:
        if not touches_variables(rule.effects):
            return
        collection, path = nested.first_variable([rule])
    else:
        missing = sorted(traffic(rule).needs - set(passed))
        if not missing:
            return
        collection, path = missing[0]
    raise errors.TransformError(
        f"the custom rule of a raw {custom_name(eqn)} "
        "touches variables that its function does not, so varjax has not passed "
        "them in.", collection=collection, path=path, **errors.where(eqn.source_info),
        fix="read the variable in the function as well, or pass its value as an argument")


def _guarded_body(body: ClosedJaxpr, enter: Callable[[], ContextManager[Any]],
                  closures: Closures) -> ClosedJaxpr:
    eqns = [e.replace(params=guarded_params(e, enter, closures)) if holds_custom_call(e) else e
            for e in body.jaxpr.eqns]
    return ClosedJaxpr(body.jaxpr.replace(eqns=eqns), body.consts)
