"""``varjax.ir.liveness``: JAX's dead-code elimination, except that an equation with clean
bodies is kept without asking its rule, so nothing dead means the same jaxpr back."""
import os
import sys

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from varjax import _jax
from varjax.ir import liveness
from varjax.ir.nested import walk_eqns
from varjax.passes import Pipeline

sys.path.insert(0, os.path.dirname(__file__))
from fuzz import programs as P  # noqa: E402


def _size(jaxpr):
    return sum(1 for _ in walk_eqns(jaxpr))


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(P.programs(max_depth=2, max_top=4), st.data())
def test_dce_removes_what_jax_dce_removes_on_random_programs(program, data):
    """On random nested programs with dead code (an init after forward-stores leaves dead
    reads) and without (an apply), for random kept outputs: the same equations removed,
    the same inputs used, and a jaxpr that type-checks."""
    f, args, calls = P.init_and_apply(program)
    for kwargs in calls:
        traced, _ = f.run_pipeline(*args, pipeline=Pipeline(["lower-rng", "forward-stores"]),
                                   **kwargs)
        jaxpr = traced.jaxpr
        keep = data.draw(st.lists(st.booleans(), min_size=len(jaxpr.outvars),
                                  max_size=len(jaxpr.outvars)))
        theirs, their_used = _jax.dce_jaxpr(jaxpr, keep)
        ours, our_used, removed = liveness.dce(jaxpr, keep)
        _jax.core.check_jaxpr(ours)
        assert list(our_used) == list(their_used)
        assert removed == _size(jaxpr) - _size(theirs) == _size(jaxpr) - _size(ours)
        kept_inputs, _, _ = liveness.dce(jaxpr, keep, prune_inputs=False)
        assert len(kept_inputs.invars) == len(jaxpr.invars)


def test_a_jaxpr_with_nothing_dead_comes_back_as_itself_without_asking_body_rules(monkeypatch):
    """Nested scans: the bodies are clean, so the scan DCE rule (which would rebuild each
    body, one level below the other) is not asked, and the jaxpr is the same object."""
    def inner(c, _):
        return jnp.sin(c) * 2.0, None

    def outer(c, _):
        return jax.lax.scan(inner, c, None, length=2)[0] + 1.0, None

    jaxpr = jax.make_jaxpr(lambda c: jax.lax.scan(outer, c, None, length=2)[0])(1.0).jaxpr
    scan_p = next(e.primitive for e in jaxpr.eqns if e.primitive.name == "scan")
    asked = []
    rule = _jax.dce_rules[scan_p]
    monkeypatch.setitem(_jax.dce_rules, scan_p, lambda used, eqn: asked.append(eqn) or rule(used, eqn))
    pruned, used, removed = liveness.dce(jaxpr)
    assert pruned is jaxpr and used == [True] and removed == 0 and asked == []


def test_an_operand_a_rule_drops_loses_its_producer():
    """A ``cond`` whose branches ignore an operand: its rule rebuilds the equation without
    it, so the equation computing it is dead too (the rule's answer is about the
    original equation's operands)."""
    def f(p, x):
        unused = x * 3.0
        return jax.lax.cond(p, lambda a, b: a + 1.0, lambda a, b: a - 1.0, x, unused)

    jaxpr = jax.make_jaxpr(f)(True, 2.0).jaxpr
    pruned, used, removed = liveness.dce(jaxpr)
    _jax.core.check_jaxpr(pruned)
    theirs, their_used = _jax.dce_jaxpr(jaxpr, [True])
    assert [e.primitive.name for e in pruned.eqns] == [e.primitive.name for e in theirs.eqns]
    assert "mul" not in [e.primitive.name for e in pruned.eqns]
    assert used == their_used and removed == _size(jaxpr) - _size(theirs) > 0


@pytest.mark.parametrize("keep", [None, [True, False], [False, True]])
def test_prune_drops_the_inputs_and_constants_the_kept_outputs_do_not_need(keep):
    w = jnp.arange(3.0)
    closed = jax.make_jaxpr(lambda a, b: (a * w, b + 1.0))(jnp.ones(3), 2.0)
    pruned, consts, used = liveness.prune(closed, keep)
    wanted = [True, True] if keep is None else keep
    assert used == wanted
    assert len(consts) == (1 if wanted[0] else 0)
    args = [x for x, u in zip((jnp.ones(3), 2.0), used) if u]
    outs = _jax.eval_jaxpr(pruned.jaxpr, (), *consts, *args)
    expected = [o for o, k in zip((w, 3.0), wanted) if k]
    assert len(outs) == len(expected)
    for o, e in zip(outs, expected):
        assert jnp.allclose(o, e)
