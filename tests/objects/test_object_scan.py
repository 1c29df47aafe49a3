"""Object-mode ``vj.scan(fn)(carry, xs) -> (carry, ys)``: objects in the carry are carried
(updated every step), objects in ``xs`` are sliced per step and their updates stacked."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from object_models import Lin, X, bound

import varjax as vj


def _accumulate(acc, x):
    acc.value = acc.value + x
    return acc, acc.value


def test_carry_object_update_is_carried_and_written_back():
    acc = vj.Variable(jnp.zeros(()), collection="acc")
    carry, ys = vj.scan(_accumulate)(acc, jnp.arange(4.0))
    np.testing.assert_array_equal(ys, [0.0, 1.0, 3.0, 6.0])
    assert float(acc.value) == 6.0
    assert type(carry) is vj.Variable and float(carry.value) == 6.0


def test_carry_counter_matches_nnx_scan():
    acc = vj.Variable(jnp.zeros(()), collection="batch_stats")
    _, ys = vj.scan(_accumulate)(acc, jnp.arange(4.0))

    class Count(nnx.Module):
        def __init__(self):
            self.n = nnx.BatchStat(jnp.zeros(()))

    def body(c, x):
        c.n[...] = c.n[...] + x
        return c, c.n[...]
    with nnx.set_graph_mode(False), nnx.set_graph_updates(False):
        count = Count()
        _, expected = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
            count, jnp.arange(4.0))
    np.testing.assert_array_equal(ys, expected)
    np.testing.assert_array_equal(acc.value, count.n[...])


def test_xs_object_is_sliced_and_its_updates_stacked():
    vs = vj.Variable(jnp.zeros((4, 2)), collection="s")

    def body(carry, v):
        v.value = v.value + carry
        return carry + 1.0, v.value.sum()
    carry, ys = vj.scan(body)(jnp.zeros(()), vs)
    assert float(carry) == 4.0
    np.testing.assert_array_equal(ys, [0.0, 2.0, 4.0, 6.0])
    np.testing.assert_array_equal(vs.value, jnp.tile(jnp.arange(4.0)[:, None], (1, 2)))


def test_reverse_scan_stacks_updates_in_place_order():
    vs = vj.Variable(jnp.zeros((4,)), collection="s")

    def body(carry, v):
        v.value = carry
        return carry + 1.0, carry
    _, ys = vj.scan(body, reverse=True)(jnp.zeros(()), vs)
    np.testing.assert_array_equal(ys, [3.0, 2.0, 1.0, 0.0])
    np.testing.assert_array_equal(vs.value, [3.0, 2.0, 1.0, 0.0])


def test_length_without_xs_and_unroll():
    count = vj.Variable(jnp.zeros((), jnp.int32), collection="count")

    def body(c, _):
        c.value = c.value + 1
        return c, None
    vj.scan(body, length=5)(count, None)
    assert int(count.value) == 5
    acc = vj.Variable(jnp.zeros(()), collection="acc")
    vj.scan(_accumulate, unroll=2)(acc, jnp.arange(4.0))
    assert float(acc.value) == 6.0


def test_bound_module_in_the_carry_is_read_every_step():
    model, variables = bound(Lin())

    def body(m, x):
        return m, jnp.sum(m(x) ** 2)
    _, ys = vj.scan(body)(model, X)
    expected = jnp.sum(Lin().apply(variables, X) ** 2, axis=1)
    np.testing.assert_allclose(ys, expected, atol=1e-5)


def test_stacked_bound_module_in_xs_is_scanned_layer_by_layer():
    _, one = bound(Lin(features=3), x=jnp.ones(3))
    layers = [jax.tree.map(lambda a, k=k: a * (1.0 + k), one) for k in range(3)]
    stacked = Lin(features=3).bind(jax.tree.map(lambda *a: jnp.stack(a), *layers))

    def body(h, layer):
        return jnp.tanh(layer(h)), None
    h, _ = vj.scan(body)(jnp.ones(3), stacked)
    expected = jnp.ones(3)
    for layer in layers:
        expected = jnp.tanh(Lin(features=3).apply(layer, expected))
    np.testing.assert_allclose(h, expected, atol=1e-5)


def test_creating_a_variable_in_the_scan_body_raises():
    from varjax import nn

    class Make(nn.Module):
        @nn.compact
        def __call__(self, x):
            return self.variable("extra", "n", jnp.zeros, ()).value + x
    model = Make().bind({}, mutable=True)

    def body(m, x):
        return m, m(x)
    with pytest.raises(vj.errors.VariableCreationError):
        vj.scan(body)(model, jnp.arange(2.0))
