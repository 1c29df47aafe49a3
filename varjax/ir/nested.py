"""Nested jaxprs: the one owner of "the bodies of a higher-order equation".

Equations of higher-order primitives hold whole jaxprs in their params:
``scan`` and ``jit`` one ``jaxpr``, ``while`` a ``cond_jaxpr`` and a
``body_jaxpr``, ``cond`` a tuple of ``branches``, remat an *open* ``Jaxpr``
rather than a ``ClosedJaxpr``.  Every check, printer and pass needs these
bodies, so this module is the only code that finds them, and it sits in the
IR core so that the printer (``varjax.ir.printing``) and the passes share it.

**Policy for higher-order primitives.**  There are two ways to ask, and they
differ only for a primitive varjax has no entry for in ``TABLE``:

* *Reading* (``subjaxprs``, ``walk_eqns``, ``enclosing_eqns``,
  ``first_variable``, ``map_eqns``) finds bodies by type: any param holding a
  ``Jaxpr``/``ClosedJaxpr``, or a tuple or list of them.  An unknown
  higher-order primitive is walked, verified and printed like a known one.
* *Rewriting and reasoning about control flow* (``bodies``, ``passthrough``,
  ``with_bodies``, ``same_bodies``, ``kind_of``) needs to know how control passes through the
  bodies and how to put new ones back, which only ``TABLE`` says.  For an
  unknown primitive ``bodies`` is empty, so a pass leaves the equation as it
  is; a pass that must change what is inside it (its bodies carry varjax
  effects) calls ``with_bodies`` or ``unsupported``, which raise
  ``UnsupportedPrimitiveError`` naming the primitive and the first variable
  inside.

It also owns two helpers every IR edit needs: ``Renamer``, the binder
renaming of a pass that edits equations in place of re-tracing them, and
``per_jaxpr``, a memo per jaxpr object (jaxprs are immutable and shared, e.g.
JAX caches ``jit`` bodies, so a summary of one holds wherever it appears).

Sharp edges:
  * Jaxprs JAX builds lazily behind thunks (``custom_jvp``'s jvp rule,
    ``custom_vjp``'s fwd/bwd) do not exist yet and are not visited.
    ``with_bodies`` wraps the thunk, so what it produces later is rewritten too.
  * A sub-jaxpr shared by several equations is visited once per equation
    holding it by the walkers; ``per_jaxpr`` computes it once.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar, Union

from varjax import _jax
from varjax.ir import errors
from varjax.ir.primitives import rng_draw_p, var_get_p, var_set_p

AnyJaxpr = Union[_jax.ClosedJaxpr, _jax.Jaxpr]
ClosedJaxpr = _jax.ClosedJaxpr
T = TypeVar("T")


# --- reading: bodies found by type ----------------------------------------------------

def subjaxprs(eqn: _jax.JaxprEqn) -> list[AnyJaxpr]:
    """The jaxprs in ``eqn``'s params, in param order, closed or open as stored."""
    found: list[AnyJaxpr] = []
    for value in eqn.params.values():   # asked of every equation by every walk: kept lean
        if isinstance(value, _BODY_TYPES):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(item for item in value if isinstance(item, _BODY_TYPES))
    return found


_BODY_TYPES = (_jax.ClosedJaxpr, _jax.Jaxpr)


def open_jaxpr(jaxpr: AnyJaxpr) -> _jax.Jaxpr:
    """The open ``Jaxpr`` of either kind: equations and effects live there."""
    return jaxpr.jaxpr if isinstance(jaxpr, _jax.ClosedJaxpr) else jaxpr


def closed(jaxpr: AnyJaxpr) -> ClosedJaxpr:
    """Either kind as a ``ClosedJaxpr`` (an open one gets no consts)."""
    return jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, [])


def walk_eqns(jaxpr: AnyJaxpr) -> Iterator[tuple[_jax.JaxprEqn, _jax.Jaxpr]]:
    """Every equation, nested ones included, with the open jaxpr holding it.

    Pre-order: an equation comes before the equations of its sub-jaxprs, so a
    check that fails on the outer equation reports the outermost culprit.
    """
    holder = open_jaxpr(jaxpr)
    for eqn in holder.eqns:
        yield eqn, holder
        for sub in subjaxprs(eqn):
            yield from walk_eqns(sub)


def enclosing_eqns(jaxpr: AnyJaxpr, target: _jax.JaxprEqn) -> list[_jax.JaxprEqn]:
    """The equations whose bodies hold ``target``, outermost first ([] at top level).

    For error messages: JAX restarts the name stack in every body, so the module scope
    of a nested equation is its enclosing equations' scopes followed by its own; hand
    their source infos to ``errors.enclosing``."""
    return _chain_to(jaxpr, target) or []


def _chain_to(jaxpr: AnyJaxpr, target: _jax.JaxprEqn) -> list[_jax.JaxprEqn] | None:
    for eqn in open_jaxpr(jaxpr).eqns:
        if eqn is target:
            return []
        for sub in subjaxprs(eqn):
            found = _chain_to(sub, target)
            if found is not None:
                return [eqn, *found]
    return None


def first_variable(jaxprs: Iterable[AnyJaxpr]) -> tuple[str | None, tuple | None]:
    """``(collection, path)`` of the first variable read or written, or ``(stream, None)``
    of the first RNG draw, in ``jaxprs`` (nested bodies included); ``(None, None)`` if
    none.  For error messages about a higher-order equation as a whole."""
    for jaxpr in jaxprs:
        for eqn, _ in walk_eqns(jaxpr):
            if eqn.primitive in (var_get_p, var_set_p):
                return eqn.params["collection"], eqn.params["path"]
            if eqn.primitive is rng_draw_p:
                return eqn.params["stream"], None
    return None, None


def map_eqns(jaxpr: ClosedJaxpr, fn: Callable[[_jax.JaxprEqn], _jax.JaxprEqn],
             enter: Callable[[_jax.Jaxpr], bool] = lambda j: True) -> ClosedJaxpr:
    """``jaxpr`` with ``fn`` applied to every equation, nested bodies included (found by
    type).  For edits that keep meaning, such as the printer's annotations: ``fn`` must
    keep each equation's inputs, outputs and semantics.  Shared bodies stay shared, and a
    body ``enter`` says no to is kept as it is (the same object, so memos of it hold)."""
    @per_jaxpr
    def open_(j: _jax.Jaxpr) -> _jax.Jaxpr:
        return j.replace(eqns=[fn(e.replace(params={k: param(v) for k, v in e.params.items()}))
                               for e in j.eqns])

    def param(v: Any) -> Any:
        if isinstance(v, (ClosedJaxpr, _jax.Jaxpr)) and not enter(open_jaxpr(v)):
            return v
        if isinstance(v, ClosedJaxpr):
            return ClosedJaxpr(open_(v.jaxpr), v.consts)
        if isinstance(v, _jax.Jaxpr):
            return open_(v)
        if isinstance(v, (tuple, list)) and any(isinstance(x, (ClosedJaxpr, _jax.Jaxpr)) for x in v):
            return type(v)(param(x) for x in v)
        return v
    return ClosedJaxpr(open_(jaxpr.jaxpr), jaxpr.consts)


# --- rewriting: the table of higher-order primitives ----------------------------------

@dataclasses.dataclass(frozen=True)
class Hop:
    """What a rewrite needs to know about one higher-order primitive."""

    params: tuple[str, ...]          # params holding bodies (ClosedJaxpr, Jaxpr, or tuple)
    kind: str                        # 'call': once; 'branch': one of several; 'loop': 0+ times
    thunk: str | None = None         # param holding a lazily traced rule, if any


TABLE: dict[_jax.Primitive, Hop] = {
    _jax.jit_p: Hop(("jaxpr",), "call"),
    _jax.closed_call_p: Hop(("call_jaxpr",), "call"),
    _jax.remat_p: Hop(("jaxpr",), "call"),
    _jax.custom_jvp_call_p: Hop(("call_jaxpr",), "call", "jvp_jaxpr_fun"),
    _jax.custom_vjp_call_p: Hop(("call_jaxpr",), "call", "fwd_jaxpr_thunk"),
    _jax.cond_p: Hop(("branches",), "branch"),
    _jax.scan_p: Hop(("jaxpr",), "loop"),
    _jax.while_p: Hop(("cond_jaxpr", "body_jaxpr"), "loop"),
    # Every shard runs the body once: for variable traffic, a call.
    _jax.shard_map_p: Hop(("jaxpr",), "call"),
}


def kind_of(eqn: _jax.JaxprEqn) -> str | None:
    """``'call'``, ``'branch'`` or ``'loop'`` for a known higher-order equation, else None."""
    hop = TABLE.get(eqn.primitive)
    return None if hop is None else hop.kind


def bodies(eqn: _jax.JaxprEqn) -> list[ClosedJaxpr]:
    """Every body of a known higher-order equation, as ClosedJaxprs; [] otherwise (see
    the policy in the module docstring)."""
    hop = TABLE.get(eqn.primitive)
    if hop is None:
        return []
    out: list[ClosedJaxpr] = []
    for p in hop.params:
        v = eqn.params[p]
        out.extend(map(closed, v) if isinstance(v, (tuple, list)) else (closed(v),))
    return out


def passthrough(eqn: _jax.JaxprEqn) -> list[tuple[ClosedJaxpr, list[int | None]]]:
    """Every body of a known higher-order equation (as in ``bodies``) with, for each of its
    inputs, the index of the equation operand it receives unchanged: every operand of a
    call, the operands after the index of a branch, the constants of a loop (None for
    loop carries and scanned slices)."""
    spec = TABLE.get(eqn.primitive)
    if spec is None:
        return []
    p, offset, out = eqn.params, 0, []
    for name in spec.params:
        group = p[name] if isinstance(p[name], (tuple, list)) else (p[name],)
        for body in map(closed, group):
            n = len(body.in_avals)
            if spec.kind == "call":
                index: list[int | None] = list(range(n))
            elif spec.kind == "branch":
                index = [i + 1 for i in range(n)]
            else:   # loops: scan's num_consts; while's cond_nconsts, then body_nconsts
                consts = p.get("num_consts", p.get(name.replace("_jaxpr", "_nconsts"), 0))
                index = [offset + i if i < consts else None for i in range(n)]
                offset += consts
            out.append((body, index))
    return out


def unsupported(eqn: _jax.JaxprEqn, why: str) -> errors.UnsupportedPrimitiveError:
    """The error for a higher-order equation whose bodies a pass would have to rewrite but
    cannot; names the primitive, ``why``, and the first variable inside."""
    collection, path = first_variable(subjaxprs(eqn))
    return errors.UnsupportedPrimitiveError(
        f"primitive '{eqn.primitive.name}' {why}; varjax cannot rewrite variable traffic "
        "inside it.", collection=collection, path=path, **errors.where(eqn.source_info),
        fix="move the variable accesses out of this primitive, passing values in and out "
            "as arguments and results")


def const_free(c: ClosedJaxpr) -> _jax.Jaxpr:
    """A const-free open Jaxpr computing ``c`` (consts are kept by a closed_call); for
    params that hold an open ``Jaxpr`` (remat)."""
    if not c.consts:
        return c.jaxpr
    inner = _jax.trace_to_jaxpr(
        lambda *a: _jax.closed_call_p.bind(*a, call_jaxpr=c), list(c.in_avals))
    assert not inner.consts
    return inner.jaxpr


def with_bodies(eqn: _jax.JaxprEqn, rewrite: Callable[[ClosedJaxpr], ClosedJaxpr]) -> dict:
    """``eqn.params`` with every body passed through a signature-preserving ``rewrite``.

    A lazily traced rule (``custom_jvp``'s JVP, ``custom_vjp``'s fwd) is wrapped so that
    the jaxpr it produces is rewritten the same way when JAX traces it.  Raises
    ``UnsupportedPrimitiveError`` for a primitive missing from ``TABLE``."""
    hop = TABLE.get(eqn.primitive)
    if hop is None:
        raise unsupported(eqn, "has a body with variable effects but no varjax rule")
    params = dict(eqn.params)
    with errors.enclosing(eqn.source_info):   # errors in the bodies name eqn's module
        for p in hop.params:
            v = params[p]
            if isinstance(v, (tuple, list)):
                params[p] = type(v)(rewrite(closed(b)) for b in v)
            elif isinstance(v, ClosedJaxpr):
                params[p] = rewrite(v)
            else:
                params[p] = const_free(rewrite(closed(v)))
    if hop.thunk is not None:
        params[hop.thunk] = _jax.wrap_thunk(params[hop.thunk], _thunk_rewriter(rewrite))
    return params


def same_bodies(eqn: _jax.JaxprEqn, params: dict) -> bool:
    """Did ``with_bodies`` give ``eqn`` back every body as it was (the same jaxprs)?  Then
    the equation needs no new params.  A wrapped thunk always counts as a change: what it
    will trace later is not known now."""
    hop = TABLE.get(eqn.primitive)
    if hop is None:
        return True
    for name in hop.params + ((hop.thunk,) if hop.thunk else ()):
        old, new = eqn.params[name], params[name]
        pairs = zip(old, new) if isinstance(old, (tuple, list)) else ((old, new),)
        if any(a is not b and not (isinstance(a, (ClosedJaxpr, _jax.Jaxpr))
                                   and open_jaxpr(a) is open_jaxpr(b)) for a, b in pairs):
            return False
    return True


def _thunk_rewriter(rewrite: Callable[[ClosedJaxpr], ClosedJaxpr]) -> Callable:
    # custom_jvp thunks return (jaxpr, consts, out_zeros); custom_vjp ones (jaxpr, consts).
    def around(call: Callable[[], Any]) -> Any:
        out = call()
        new = rewrite(ClosedJaxpr(out[0], out[1]))
        return (new.jaxpr, new.consts, *out[2:])
    return around


# --- editing in place: binder renaming ------------------------------------------------

class Renamer:
    """Binders renamed while a pass edits a jaxpr's equations instead of re-tracing it.

    When an equation is dropped (a forwarded read) or replaced by spliced equations, its
    outputs live on under other names; every later use must follow.  Record each
    replacement with ``rename(old_vars, new_atoms)``, then pass every later equation
    through ``eqn`` and the jaxpr's outputs through ``atoms``.  Literals and unrenamed
    variables pass through, and an equation none of whose inputs is renamed comes back
    as the same object, so "did anything change?" stays an identity check."""

    def __init__(self, pairs: Iterable[tuple[_jax.Var, Any]] = ()):
        self.map: dict[_jax.Var, Any] = dict(pairs)

    def rename(self, old: Iterable[_jax.Var], new: Iterable[Any]) -> None:
        """Uses of each ``old`` variable become the matching ``new`` atom."""
        self.map.update(zip(old, new))

    def atom(self, a: Any) -> Any:
        """``a`` renamed: a variable's new name or itself; a literal unchanged."""
        return self.map.get(a, a) if isinstance(a, _jax.Var) else a

    def atoms(self, atoms: Iterable[Any]) -> list[Any]:
        return [self.atom(a) for a in atoms]

    def eqn(self, eqn: _jax.JaxprEqn) -> _jax.JaxprEqn:
        """``eqn`` reading renamed inputs; ``eqn`` itself when none of them is renamed."""
        renamed = self.map
        if renamed:
            for a in eqn.invars:     # a loop, not any(): asked of every equation by the passes
                if not isinstance(a, _jax.Literal) and a in renamed:
                    return eqn.replace(invars=self.atoms(eqn.invars))
        return eqn


# --- memo per jaxpr ---------------------------------------------------------------------

class per_jaxpr(Generic[T]):
    """``fn`` of an open jaxpr, computed once per jaxpr object and held weakly.

    Jaxprs are immutable and shared (JAX caches ``jit`` bodies; a functionalize cache
    keeps traced jaxprs), so a summary of one is valid wherever it appears, and dies
    with it.  Accepts a ``ClosedJaxpr`` too (memoised on its open jaxpr).  Use as a
    decorator on a module-level function, or build one per object whose answers depend
    on more than the jaxpr (``Rewriter.touches`` depends on the rewriter's rules)."""

    def __init__(self, fn: Callable[[_jax.Jaxpr], T]):
        self.fn = fn
        self._values: weakref.WeakKeyDictionary[_jax.Jaxpr, T] = weakref.WeakKeyDictionary()

    def __call__(self, jaxpr: AnyJaxpr) -> T:
        j = open_jaxpr(jaxpr)
        try:
            return self._values[j]
        except KeyError:
            value = self._values[j] = self.fn(j)
            return value
