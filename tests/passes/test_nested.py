"""varjax.ir.nested: bodies found by type for reading, by table for rewriting; the renamer and
the per-jaxpr memo."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.custom_batching import custom_vmap

from varjax import errors
from varjax.ir import nested
from varjax.passes import Rewriter, Rule

X = jnp.ones(2, jnp.float32)


class ToCos(Rule):
    primitive = jax.lax.sin_p

    def rewrite(self, eqn, invals, region):
        return [jnp.cos(*invals)]


def _unknown_higher_order():
    @custom_vmap
    def g(x):
        return jnp.sin(x)

    g.def_vmap(lambda axis_size, in_batched, x: (jnp.sin(x), in_batched[0]))
    return jax.make_jaxpr(g)(X)


def test_an_unknown_higher_order_primitive_is_read_by_type_and_left_alone_by_rewrites():
    jaxpr = _unknown_higher_order()
    (eqn,) = jaxpr.jaxpr.eqns
    assert eqn.primitive not in nested.TABLE and nested.kind_of(eqn) is None
    assert [e.primitive.name for e, _ in nested.walk_eqns(jaxpr)] == ["custom_vmap_call", "sin"]
    (inner, _), = [(e, h) for e, h in nested.walk_eqns(jaxpr) if e.primitive.name == "sin"]
    assert nested.enclosing_eqns(jaxpr, inner) == [eqn]
    assert len(nested.subjaxprs(eqn)) == 1 and nested.bodies(eqn) == []
    assert Rewriter([ToCos()]).run(jaxpr) is jaxpr        # no body to rewrite: kept
    with pytest.raises(errors.UnsupportedPrimitiveError, match="'custom_vmap_call'"):
        nested.with_bodies(eqn, lambda body: body)


def test_map_eqns_reaches_every_body_and_keeps_shared_ones_shared():
    def f(x):
        step = jax.jit(jnp.sin)
        return step(step(x))

    jaxpr = jax.make_jaxpr(f)(X)
    seen = []
    out = nested.map_eqns(jaxpr, lambda e: seen.append(e.primitive.name) or e)
    assert seen.count("sin") == 1 and seen.count("jit") == 2   # the shared body once
    first, second = out.jaxpr.eqns
    assert first.params["jaxpr"].jaxpr is second.params["jaxpr"].jaxpr


def test_map_eqns_keeps_a_body_enter_declines_as_the_same_object():
    def f(x):
        return jax.jit(jnp.sin)(jax.jit(jnp.cos)(x))

    jaxpr = jax.make_jaxpr(f)(X)
    cos_body, sin_body = (e.params["jaxpr"] for e in jaxpr.jaxpr.eqns)
    seen = []
    out = nested.map_eqns(jaxpr, lambda e: seen.append(e.primitive.name) or e,
                          enter=lambda j: j is sin_body.jaxpr)
    assert "sin" in seen and "cos" not in seen
    assert out.jaxpr.eqns[0].params["jaxpr"] is cos_body
    assert out.jaxpr.eqns[1].params["jaxpr"] is not sin_body


def test_renamer_renames_inputs_and_keeps_untouched_equations():
    jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) + jnp.cos(x))(X).jaxpr
    sin, cos, add = jaxpr.eqns
    renamer = nested.Renamer()
    assert renamer.eqn(add) is add
    renamer.rename(sin.outvars, cos.outvars)                # drop sin: use cos's value
    assert renamer.eqn(cos) is cos
    assert renamer.eqn(add).invars == [cos.outvars[0], cos.outvars[0]]
    assert renamer.atoms(jaxpr.outvars) == list(jaxpr.outvars)


def test_per_jaxpr_computes_once_per_jaxpr_object():
    calls = []

    @nested.per_jaxpr
    def size(j):
        calls.append(j)
        return len(j.eqns)

    closed = jax.make_jaxpr(jnp.sin)(X)
    assert size(closed) == size(closed.jaxpr) == 1
    assert calls == [closed.jaxpr]
