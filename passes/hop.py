"""What varjax knows about JAX's higher-order primitives, in one table.

A pass that rewrites bodies without changing their signature (forward
stores, RNG lowering, dtype casts) needs three facts per primitive: which
params hold bodies, how control passes through them (``call``: once;
``branch``: one of several; ``loop``: zero or more times), and how to put new
bodies back.  The discharge pass, which *does* change signatures, has its own
rule per primitive in ``discharge.py``; it uses this table for the rest.

``custom_jvp_call`` and ``custom_vjp_call`` keep their JVP / forward rules as
thunks that JAX traces lazily; a rewrite wraps the thunk so the jaxpr it
produces is rewritten the same way when it is finally traced.

Sharp edges:
  * A primitive missing from this table whose body carries varjax effects
    cannot be rewritten: passes raise ``UnsupportedPrimitiveError`` naming it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from varjax import _jax, errors
from varjax.passes import walk

ClosedJaxpr = _jax.ClosedJaxpr


@dataclasses.dataclass(frozen=True)
class Hop:
    params: tuple[str, ...]          # params holding bodies (ClosedJaxpr, Jaxpr, or tuple)
    kind: str                        # 'call' | 'branch' | 'loop'
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


def closed(j) -> ClosedJaxpr:
    return j if isinstance(j, ClosedJaxpr) else ClosedJaxpr(j, [])


def const_free(c: ClosedJaxpr) -> _jax.Jaxpr:
    """A const-free open Jaxpr computing ``c`` (consts are kept by a closed_call)."""
    if not c.consts:
        return c.jaxpr
    inner = _jax.trace_to_jaxpr(
        lambda *a: _jax.closed_call_p.bind(*a, call_jaxpr=c), list(c.in_avals))
    assert not inner.consts
    return inner.jaxpr


def bodies(eqn: _jax.JaxprEqn) -> list[ClosedJaxpr]:
    """Every body of a known higher-order equation, as ClosedJaxprs; [] otherwise."""
    hop = TABLE.get(eqn.primitive)
    if hop is None:
        return []
    out = []
    for p in hop.params:
        v = eqn.params[p]
        out.extend(closed(b) for b in v) if isinstance(v, (tuple, list)) else out.append(closed(v))
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
                index = list(range(n))
            elif spec.kind == "branch":
                index = [i + 1 for i in range(n)]
            else:   # loops: scan's num_consts; while's cond_nconsts, then body_nconsts
                consts = p.get("num_consts", p.get(name.replace("_jaxpr", "_nconsts"), 0))
                index = [offset + i if i < consts else None for i in range(n)]
                offset += consts
            out.append((body, index))
    return out


def unsupported(eqn: _jax.JaxprEqn, why: str) -> errors.UnsupportedPrimitiveError:
    collection, path = walk.first_variable(walk.subjaxprs(eqn))
    return errors.UnsupportedPrimitiveError(
        f"primitive '{eqn.primitive.name}' {why}; varjax cannot rewrite variable traffic "
        "inside it.", collection=collection, path=path, **errors.where(eqn.source_info),
        fix="move the variable accesses out of this primitive, passing values in and out "
            "as arguments and results")


def with_bodies(eqn: _jax.JaxprEqn, rewrite: Callable[[ClosedJaxpr], ClosedJaxpr]) -> dict:
    """``eqn.params`` with every body passed through a signature-preserving ``rewrite``."""
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


def _thunk_rewriter(rewrite: Callable[[ClosedJaxpr], ClosedJaxpr]):
    # custom_jvp thunks return (jaxpr, consts, out_zeros); custom_vjp ones (jaxpr, consts).
    def around(call):
        out = call()
        new = rewrite(ClosedJaxpr(out[0], out[1]))
        return (new.jaxpr, new.consts, *out[2:])
    return around
