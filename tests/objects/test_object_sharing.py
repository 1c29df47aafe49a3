"""One object reached twice in the arguments of an object-mode transform is one object inside,
so updates through either place act on the same variables, as they do eagerly."""
import jax
import jax.numpy as jnp
import numpy as np

import varjax as vj
import varjax.nn as nn


class Outer(nn.Module):
    def setup(self):
        self.bn = nn.BatchNorm(use_running_average=False, momentum=0.5)

    def __call__(self, x):
        return self.bn(x)


X = jnp.arange(4.0, dtype=jnp.float32).reshape(2, 2)


def _twice(a, b):
    a(X)
    b(X * 3)
    return a.variables["batch_stats"]["bn"]["mean"]


def _model():
    return Outer().bind(Outer().init(jax.random.key(0), X), mutable=["batch_stats"])


def test_same_variable_twice_in_jit_is_one_object_inside():
    v = vj.Variable(jnp.ones(2))
    seen = []

    @vj.jit
    def two(a, b):
        seen.append(a is b)
        a.value = a.value + 1
        b.value = b.value * 2
        return b.value
    np.testing.assert_array_equal(two(v, v), [4.0, 4.0])
    np.testing.assert_array_equal(v.value, [4.0, 4.0])
    assert seen == [True]


def test_same_bound_module_twice_in_jit_updates_like_eager():
    eager, traced = _model(), _model()
    expected = _twice(eager, eager)
    out = vj.jit(_twice)(traced, traced)
    np.testing.assert_allclose(out, expected, atol=1e-6)
    np.testing.assert_allclose(traced.variables["batch_stats"]["bn"]["mean"],
                               eager.variables["batch_stats"]["bn"]["mean"], atol=1e-6)


def test_grad_of_a_variable_reached_twice_totals_both_uses():
    v = vj.Variable(jnp.array([1.0, 2.0]))
    g = vj.grad(lambda t: jnp.sum(t["a"].value * t["b"].value))({"a": v, "b": v})
    # d/dv sum(v * v) = 2v; how it is spread over the two places is not specified
    np.testing.assert_allclose(g["a"].value + g["b"].value, [2.0, 4.0])


def test_module_and_its_submodule_together_raise_or_update_like_eager():
    eager, traced = _model(), _model()
    expected = _twice(eager, eager.bn)
    try:
        out = vj.jit(_twice)(traced, traced.bn)
    except vj.errors.TransformError:
        return
    np.testing.assert_allclose(out, expected, atol=1e-6)
    np.testing.assert_allclose(traced.variables["batch_stats"]["bn"]["mean"],
                               eager.variables["batch_stats"]["bn"]["mean"], atol=1e-6)
