"""Object-mode ``vj.jit``: the objects' variables are traced inputs, updates made inside are
written back into the argument objects, and a second call with the same structure does not
retrace."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from object_models import MLP, Lin, X, assert_tree_close, bound

import varjax as vj
import varjax.nn as nn


def test_variable_update_is_written_back():
    v = vj.Variable(jnp.ones(3))

    @vj.jit
    def inc(v):
        v.value = v.value + 1
        return v.value.sum()
    assert float(inc(v)) == 6.0
    np.testing.assert_array_equal(v.value, [2.0, 2.0, 2.0])
    inc(v)
    np.testing.assert_array_equal(v.value, [3.0, 3.0, 3.0])


def test_batch_stats_update_matches_linen_apply_and_params_are_not_replaced():
    model, variables = bound(MLP(), mutable=["batch_stats"])
    kernel = model.variables["params"]["Dense_0"]["kernel"]
    stats = model.variables["batch_stats"]["BatchNorm_0"]["mean"]
    out = vj.jit(lambda model, x: model(x))(model, X)
    expected, updates = MLP().apply(variables, X, mutable=["batch_stats"])
    np.testing.assert_allclose(out, expected, atol=1e-5)
    assert_tree_close(model.variables["batch_stats"], updates["batch_stats"])
    assert model.variables["batch_stats"]["BatchNorm_0"]["mean"] is not stats
    # unchanged variables are not replaced: the same Python object before and after
    assert model.variables["params"]["Dense_0"]["kernel"] is kernel


def test_batch_norm_update_matches_nnx_jit():
    bn = nn.BatchNorm(use_running_average=False, momentum=0.5)
    x = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3)
    variables = bn.init(jax.random.key(0), x)
    model = bn.bind(variables, mutable=["batch_stats"])
    out = vj.jit(lambda m, x: m(x))(model, x)

    oracle = nnx.BatchNorm(3, momentum=0.5, rngs=nnx.Rngs(0))
    expected = nnx.jit(lambda m, x: m(x))(oracle, x)
    np.testing.assert_allclose(out, expected, atol=1e-5)
    np.testing.assert_allclose(model.variables["batch_stats"]["mean"], oracle.mean[...], atol=1e-6)
    np.testing.assert_allclose(model.variables["batch_stats"]["var"], oracle.var[...], atol=1e-5)


def test_unchanged_variable_keeps_its_value_object():
    v = vj.Variable(jnp.ones(2))
    before = v.value
    vj.jit(lambda v: v.value.sum())(v)
    assert v.value is before


def test_second_call_does_not_retrace():
    traces = []

    @vj.jit
    def step(model, v, x):
        traces.append(1)
        v.value = v.value + 1.0
        return model(x)
    model, variables = bound(Lin())
    v = vj.Variable(jnp.zeros(()), collection="count")
    step(model, v, X)
    step(model, v, X)
    # a new bound module of the same structure shares the trace too
    step(Lin().bind(jax.tree.map(lambda a: a * 2, variables)), v, X)
    assert len(traces) == 1
    assert float(v.value) == 3.0


def test_static_argnums_and_keyword_arguments():
    traces = []

    def scale(v, n, *, offset):
        traces.append(n)
        return v.value * n + offset
    f = vj.jit(scale, static_argnums=1)
    v = vj.Variable(jnp.ones(2))
    np.testing.assert_array_equal(f(v, 3, offset=1.0), [4.0, 4.0])
    np.testing.assert_array_equal(f(v, 3, offset=2.0), [5.0, 5.0])
    np.testing.assert_array_equal(f(v, 4, offset=0.0), [4.0, 4.0])
    assert traces == [3, 4]


def test_keyword_argument_object_is_updated():
    @vj.jit
    def add(x, *, acc):
        acc.value = acc.value + x
        return acc.value
    acc = vj.Variable(jnp.zeros(2), collection="acc")
    add(jnp.ones(2), acc=acc)
    np.testing.assert_array_equal(acc.value, [1.0, 1.0])


def test_donate_argnums_is_accepted():
    f = vj.jit(lambda v, x: v.value + x, donate_argnums=1)
    np.testing.assert_array_equal(f(vj.Variable(jnp.ones(2)), jnp.ones(2)), [2.0, 2.0])


def test_rngs_draws_advance_like_eager_draws():
    eager, traced = vj.Rngs(0), vj.Rngs(0)
    draw = vj.jit(lambda r: r.normal((2,)))
    for _ in range(2):
        np.testing.assert_array_equal(draw(traced), eager.normal((2,)))
    assert int(traced.default.count) == 2


def test_dropout_of_module_bound_with_rngs_matches_eager_calls():
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(x)
    eager = Drop().bind({}, rngs=vj.Rngs(dropout=3))
    traced_rngs = vj.Rngs(dropout=3)
    traced = Drop().bind({}, rngs=traced_rngs)
    f = vj.jit(lambda m, x: m(x))
    x = jnp.ones(8)
    a, b = f(traced, x), f(traced, x)
    np.testing.assert_array_equal(a, eager(x))
    np.testing.assert_array_equal(b, eager(x))
    assert not np.array_equal(a, b)
    assert int(traced_rngs.dropout.count) == 2


def test_returned_objects_are_new_objects_holding_the_values():
    v = vj.Variable(jnp.ones(2), collection="stats")

    @vj.jit
    def bump(v):
        v.value = v.value * 2
        return v
    out = bump(v)
    assert type(out) is vj.Variable and out is not v and out.collection == "stats"
    np.testing.assert_array_equal(out.value, v.value)
