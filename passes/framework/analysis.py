"""Variable traffic of a jaxpr: what it needs, what it may and must write.

``traffic(jaxpr)`` summarises a (sub-)jaxpr for the passes that move values
across region boundaries:

* ``needs``: variables whose value *on entry* may be observed -- read before
  any certain write, or passed through when only some paths write them, or
  carried into a loop that writes them;
* ``may_write``: variables written on some path;
* ``must_write``: variables written on every path (loops may run zero times,
  so they contribute nothing; a scan of static length >= 1 does).

varjax's own scratch variables (collections ``__*``) that a region sets
before reading are local to that region and appear in none of the three.

Summaries are memoised per jaxpr object: jaxprs are immutable and shared.
"""
from __future__ import annotations

import dataclasses

from varjax import _jax
from varjax.ir import nested
from varjax.ir.effects import VariableEffect
from varjax.ir.primitives import Key, is_internal, var_get_p, var_set_p


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Which variables a jaxpr reads before writing them and which it writes: what a
    pass needs to know of a nested body without walking it again."""

    needs: frozenset[Key]
    may_write: frozenset[Key]
    must_write: frozenset[Key]


_EMPTY = Traffic(frozenset(), frozenset(), frozenset())


def key_of(eqn: _jax.JaxprEqn) -> Key:
    return (eqn.params["collection"], eqn.params["path"])


def touches_variables(effects) -> bool:
    return any(type(e) is VariableEffect for e in effects)


def traffic(jaxpr: _jax.Jaxpr | _jax.ClosedJaxpr) -> Traffic:
    """The ``Traffic`` of ``jaxpr``, nested bodies included (memoised per jaxpr)."""
    jaxpr = nested.open_jaxpr(jaxpr)
    if not touches_variables(jaxpr.effects):
        return _EMPTY
    return _summarise(jaxpr)


@nested.per_jaxpr
def _summarise(jaxpr: _jax.Jaxpr) -> Traffic:
    needs: set[Key] = set()
    may: set[Key] = set()
    must: set[Key] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive is var_get_p:
            k = key_of(eqn)
            if k not in must:
                needs.add(k)
        elif eqn.primitive is var_set_p:
            k = key_of(eqn)
            may.add(k)
            must.add(k)
        elif touches_variables(eqn.effects):
            t = eqn_traffic(eqn)
            needs |= t.needs - must
            may |= t.may_write
            must |= t.must_write
    # varjax scratch variables (RNG loop keys/counters) set before use in this region are
    # dead outside it: they are neither carried, passed through nor returned.
    local = {k for k in may if is_internal(k[0]) and k not in needs}
    return Traffic(frozenset(needs), frozenset(may - local), frozenset(must - local))


def eqn_traffic(eqn: _jax.JaxprEqn) -> Traffic:
    """Traffic of one higher-order equation, as seen from the enclosing jaxpr."""
    kind = nested.kind_of(eqn)
    if kind is None:
        raise nested.unsupported(eqn, "has a body with variable effects but no varjax rule")
    parts = [traffic(b) for b in nested.bodies(eqn)]
    may = frozenset().union(*(t.may_write for t in parts))
    needs = frozenset().union(*(t.needs for t in parts))
    if kind == "call":
        return Traffic(needs, may, frozenset().union(*(t.must_write for t in parts)))
    if kind == "branch":
        passthrough = frozenset().union(*(may - t.must_write for t in parts))
        must = frozenset.intersection(*(t.must_write for t in parts))
        return Traffic(needs | passthrough, may, must)
    # Loops carry every written variable, so its value on entry is needed.
    must = parts[0].must_write if eqn.primitive is _jax.scan_p and eqn.params["length"] > 0 \
        else frozenset()
    return Traffic(needs | may, may, must)
