"""Object-mode ``vj.cond`` / ``vj.switch`` / ``vj.while_loop`` / ``vj.fori_loop``: a variable
written in the branch taken or in any iteration is written back to the operand objects."""
import jax.numpy as jnp
import numpy as np
import pytest
from object_models import Lin, X, bound

import varjax as vj
import varjax.nn as nn


def _branches():
    def triple_v(v, w):
        v.value = v.value * 3.0
        return v.value

    def quintuple_w(v, w):
        w.value = w.value * 5.0
        return w.value
    return triple_v, quintuple_w


@pytest.mark.parametrize("pred", [True, jnp.array(True)], ids=["python", "array"])
def test_cond_true_branch_update_is_written_back(pred):
    v, w = vj.Variable(jnp.ones(())), vj.Variable(jnp.ones(()))
    t, f = _branches()
    assert float(vj.cond(pred, t, f, v, w)) == 3.0
    assert float(v.value) == 3.0 and float(w.value) == 1.0


def test_variable_written_in_no_branch_keeps_its_value_object():
    v, u = vj.Variable(jnp.ones(())), vj.Variable(jnp.ones(()), collection="other")
    before = u.value

    def t(v, u):
        v.value = v.value + u.value
        return v.value

    def f(v, u):
        return u.value
    vj.cond(jnp.array(True), t, f, v, u)
    assert float(v.value) == 2.0 and u.value is before


def test_cond_false_branch_update_is_written_back():
    v, w = vj.Variable(jnp.ones(())), vj.Variable(jnp.ones(()))
    t, f = _branches()
    assert float(vj.cond(jnp.array(False), t, f, v, w)) == 5.0
    assert float(v.value) == 1.0 and float(w.value) == 5.0


def test_switch_runs_the_indexed_branch():
    v, w = vj.Variable(jnp.ones(())), vj.Variable(jnp.ones(()))
    t, f = _branches()
    assert float(vj.switch(1, [t, f], v, w)) == 5.0
    assert float(vj.switch(jnp.array(0), [t, f], v, w)) == 3.0
    assert float(v.value) == 3.0 and float(w.value) == 5.0


def test_cond_with_a_bound_module_operand():
    model, variables = bound(Lin())
    out = vj.cond(True, lambda m: m(X).sum(), lambda m: -m(X).sum(), model)
    np.testing.assert_allclose(out, Lin().apply(variables, X).sum(), atol=1e-5)


def test_while_loop_carries_object_updates():
    v = vj.Variable(jnp.zeros(()), collection="s")

    def cond_fun(state):
        return state[1] < 3

    def body_fun(state):
        v, i = state
        v.value = v.value + 2.0
        return v, i + 1
    _, i = vj.while_loop(cond_fun, body_fun, (v, 0))
    assert int(i) == 3 and float(v.value) == 6.0


def test_fori_loop_carries_object_updates():
    v = vj.Variable(jnp.zeros(()), collection="s")

    def body(i, v):
        v.value = v.value + i.astype(jnp.float32)
        return v
    vj.fori_loop(0, 4, body, v)
    assert float(v.value) == 6.0


def test_fori_loop_over_a_bound_module_with_batch_stats():
    class BN(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False, momentum=0.5)(x)
    x = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
    model, variables = bound(BN(), x=x, mutable=["batch_stats"])

    def body(i, m):
        m(x)
        return m
    vj.fori_loop(0, 2, body, model)
    expected = variables
    for _ in range(2):
        _, updates = BN().apply(expected, x, mutable=["batch_stats"])
        expected = {**expected, **updates}
    mean = model.variables["batch_stats"]["BatchNorm_0"]["mean"]
    np.testing.assert_allclose(mean, expected["batch_stats"]["BatchNorm_0"]["mean"], atol=1e-6)


def test_creating_a_variable_in_a_loop_body_raises():
    class Make(nn.Module):
        @nn.compact
        def __call__(self, x):
            return self.variable("extra", "n", jnp.zeros, ()).value + x
    model = Make().bind({}, mutable=True)

    def body(i, m):
        m(1.0)
        return m
    with pytest.raises(vj.errors.VariableCreationError) as info:
        vj.fori_loop(0, 2, body, model)
    assert info.value.collection == "extra"


def test_cond_writes_back_each_variable_when_one_is_passed_at_two_places():
    # JAX returns a copy per place; the branch outputs were taken apart without putting
    # the two copies of `a` back together, so `b` received `a`'s value (shape (2, 2)).
    a = vj.Variable(jnp.ones((2, 2)), collection="stats")
    b = vj.Variable(jnp.zeros(2), collection="stats")

    def bump(a1, a2, b):
        b.value = b.value + jnp.sum(a1.value)
        return jnp.zeros(())
    vj.cond(True, bump, bump, a, a, b)
    assert b.value.shape == (2,) and float(b.value[0]) == 4.0
    np.testing.assert_array_equal(a.value, jnp.ones((2, 2)))
