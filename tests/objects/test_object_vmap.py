"""Object-mode ``vj.vmap``: objects are mapped along their ``in_axes`` entry, updates are
stacked along that axis, and an ``in_axes=None`` object is one shared copy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from object_models import Lin, bound

import varjax as vj


def test_update_is_stacked_along_the_objects_axis():
    c = vj.Variable(jnp.zeros((3, 2)), collection="counts")

    @vj.vmap(in_axes=(0, 0))
    def bump(c, x):
        c.value = c.value + x
        return c.value.sum()
    xs = jnp.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(bump(c, xs), xs.sum(axis=1))
    np.testing.assert_array_equal(c.value, xs)


def test_update_is_stacked_along_a_non_leading_axis():
    c = vj.Variable(jnp.zeros((2, 3)), collection="counts")

    def bump(c, x):
        c.value = c.value + x
        return x * 2
    out = vj.vmap(bump, in_axes=(1, 0))(c, jnp.arange(3.0))
    np.testing.assert_array_equal(out, [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(c.value, [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])


def test_plain_function_call_defaults_to_axis_zero():
    counter = vj.Variable(jnp.zeros(3), collection="counts")

    def bump(c, x):
        c.value = c.value + x
        return x * 2
    np.testing.assert_array_equal(vj.vmap(bump)(counter, jnp.arange(3.0)), [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(counter.value, [0.0, 1.0, 2.0])


def test_in_axes_none_object_is_broadcast_to_every_member():
    p = vj.Variable(jnp.arange(2.0))
    before = p.value
    out = vj.vmap(lambda p, x: p.value * x, in_axes=(None, 0))(p, jnp.ones((3, 1)))
    np.testing.assert_array_equal(out, jnp.tile(jnp.arange(2.0)[None], (3, 1)))
    assert p.value is before


def test_in_axes_none_object_may_be_written_with_an_unbatched_value():
    q = vj.Variable(jnp.arange(2.0))

    def write(q, x):
        q.value = q.value + 1.0
        return x
    vj.vmap(write, in_axes=(None, 0))(q, jnp.ones(3))
    np.testing.assert_array_equal(q.value, [1.0, 2.0])


def test_same_object_twice_with_the_same_axis_is_one_object_inside():
    c = vj.Variable(jnp.zeros(3), collection="counts")

    def two(a, b, x):
        assert a is b
        a.value = a.value + x
        return b.value
    out = vj.vmap(two, in_axes=(0, 0, 0))(c, c, jnp.arange(3.0))
    np.testing.assert_array_equal(out, [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(c.value, [0.0, 1.0, 2.0])


def test_axis_name_axis_size_and_out_axes():
    v = vj.Variable(jnp.arange(3.0))
    np.testing.assert_array_equal(
        vj.vmap(lambda v: jax.lax.psum(v.value, "i"), axis_name="i")(v), [3.0, 3.0, 3.0])
    assert vj.vmap(lambda v: v.value * 2, in_axes=None, axis_size=4)(v).shape == (4, 3)
    w = vj.Variable(jnp.ones((3, 2)))
    assert vj.vmap(lambda w: w.value, out_axes=1)(w).shape == (2, 3)


def test_stacked_bound_module_matches_nnx_vmap_of_linear():
    _, one = bound(Lin(), x=jnp.ones(3))
    stacked = jax.tree.map(lambda a: jnp.stack([a, -2 * a + 0.5]), one)
    model = Lin().bind(stacked)
    x = jnp.arange(3.0, dtype=jnp.float32)
    out = vj.vmap(lambda m, x: m(x), in_axes=(0, None))(model, x)

    p = stacked["params"]["Dense_0"]
    with nnx.set_graph_mode(False), nnx.set_graph_updates(False):
        @nnx.vmap(in_axes=0)
        def make(key):
            return nnx.Linear(3, 2, rngs=nnx.Rngs(key))
        ens = make(jax.random.split(jax.random.key(0), 2))
        ens.kernel[...] = p["kernel"]
        ens.bias[...] = p["bias"]
        expected = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(ens, x)
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_forked_rngs_draw_a_different_key_per_member():
    rngs = vj.Rngs(0)
    forked = rngs.fork(split=3)
    draws = vj.vmap(lambda r: r.normal(()))(forked)
    assert len(set(np.asarray(draws).tolist())) == 3
    np.testing.assert_array_equal(forked.default.count, [1, 1, 1])


def test_batched_write_into_in_axes_none_object_raises():
    p = vj.Variable(jnp.arange(2.0))

    def write(p, x):
        p.value = p.value * x[0]
        return x
    with pytest.raises(vj.errors.TransformError):
        vj.vmap(write, in_axes=(None, 0))(p, jnp.ones((3, 1)))
    np.testing.assert_array_equal(p.value, [0.0, 1.0])


def test_same_object_with_two_axes_raises_inconsistent_alias_error():
    c = vj.Variable(jnp.zeros(3), collection="counts")
    with pytest.raises(vj.errors.InconsistentAliasError) as info:
        vj.vmap(lambda a, b: a.value, in_axes=(0, None))(c, c)
    assert isinstance(info.value, vj.errors.TransformError)
    assert isinstance(info.value, ValueError)


def test_stacked_batch_norm_stats_are_updated_per_member():
    from varjax import nn
    bn = nn.BatchNorm(use_running_average=False, momentum=0.5)
    xs = jnp.arange(24.0, dtype=jnp.float32).reshape(2, 4, 3) ** 1.5 / 10
    one = bn.init(jax.random.key(0), xs[0])
    stacked = jax.tree.map(lambda a: jnp.stack([a, a + 1]), one)
    model = bn.bind(stacked, mutable=["batch_stats"])
    out = vj.vmap(lambda m, x: m(x))(model, xs)
    for i in range(2):
        member = jax.tree.map(lambda a: a[i], stacked)
        expected, updates = bn.apply(member, xs[i], mutable=["batch_stats"])
        np.testing.assert_allclose(out[i], expected, atol=1e-5)
        for name in ("mean", "var"):
            np.testing.assert_allclose(model.variables["batch_stats"][name][i],
                                       updates["batch_stats"][name], atol=1e-5)
