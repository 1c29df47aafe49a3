"""A raw ``jax.shard_map`` over stateful code (tests/conftest.py gives two host devices).

Variables enter the body replicated (``P()``: every shard sees the whole value) and leave
it the same way.  A write is kept only when JAX's varying-axes type says its value is the
same on every shard (after ``psum``/``pmean``); a write that differs per shard, or one that
cannot be checked (``check_vma=False``, ``jax.pmap``), is a ``TransformError`` naming the
lifted ``shard_map``.  RNG draws in the body give every shard the same key, as the lifted
``shard_map`` does for streams it does not split.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import varjax as vj
from varjax import errors, nn
from varjax.ir import streams

HERE = "test_raw_shard_map.py:"
X = jnp.arange(4.0)


def _mesh():
    return jax.sharding.Mesh(jax.devices()[:2], ("d",))


def _experimental(f, *, mesh, in_specs, out_specs, check_vma=True):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.shard_map import shard_map
    return shard_map(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma)


SHARD_MAPS = {"jax.shard_map": jax.shard_map, "jax.experimental.shard_map": _experimental}


def _assert_names(exc, collection, path, words):
    assert (exc.collection, exc.path) == (collection, path), exc
    assert exc.source is not None and HERE in exc.source, exc
    for w in words:
        assert w in str(exc), exc


@pytest.mark.parametrize("shard_map", list(SHARD_MAPS.values()), ids=list(SHARD_MAPS))
def test_param_read_in_the_body_is_replicated(shard_map):
    @vj.functionalize
    def f(x):
        def body(x):
            return x * vj.param("w", nn.initializers.ones, ())
        return shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"))(x)
    assert f.init(jax.random.key(0), X) == {"params": {"w": 1.0}}
    np.testing.assert_allclose(f.apply({"params": {"w": jnp.float32(3.0)}}, X), 3.0 * X)


@pytest.mark.parametrize("shard_map", list(SHARD_MAPS.values()), ids=list(SHARD_MAPS))
def test_write_of_a_replicated_value_is_kept(shard_map):
    @vj.functionalize
    def f(x):
        total = vj.variable("stats", "total", jnp.zeros, ())

        def body(x):
            total.value = total.value + jax.lax.psum(jnp.sum(x), "d")
            return 2.0 * x
        return shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"))(x)
    y, upd = f.apply({"stats": {"total": jnp.float32(1.0)}}, X, mutable=["stats"])
    np.testing.assert_allclose(y, 2.0 * X)
    np.testing.assert_allclose(upd["stats"]["total"], 1.0 + jnp.sum(X))


class ShardedBatchNorm(nn.Module):
    """A running mean over a data-sharded batch, averaged over the shards (``pmean``)."""

    @nn.compact
    def __call__(self, x):
        mean = self.variable("batch_stats", "mean", jnp.zeros, ())
        scale = self.param("scale", nn.initializers.ones, ())

        def body(x):
            m = jax.lax.pmean(jnp.mean(x), "d")
            mean.value = 0.9 * mean.value + 0.1 * m
            return (x - m) * scale
        return jax.shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"))(x)


def test_module_with_a_running_mean_inside_a_raw_shard_map_trains():
    model = ShardedBatchNorm()
    v = model.init(jax.random.key(0), X)
    np.testing.assert_allclose(v["batch_stats"]["mean"], 0.1 * jnp.mean(X), rtol=1e-6)
    y, upd = jax.jit(lambda v, x: model.apply(v, x, mutable=["batch_stats"]))(v, X)
    np.testing.assert_allclose(y, X - jnp.mean(X), rtol=1e-6)
    np.testing.assert_allclose(upd["batch_stats"]["mean"], 0.19 * jnp.mean(X), rtol=1e-6)

    def loss(params):
        y, _ = model.apply({**v, "params": params}, X, mutable=["batch_stats"])
        return jnp.sum(y ** 2)
    grad = jax.grad(loss)(v["params"])["scale"]
    np.testing.assert_allclose(grad, 2.0 * jnp.sum((X - jnp.mean(X)) ** 2), rtol=1e-6)


def test_writes_in_a_loop_inside_the_body_are_carried():
    @vj.functionalize
    def f(x):
        n = vj.variable("stats", "n", jnp.zeros, (), jnp.int32)

        def body(x):
            def step(c, _):
                n.value = n.value + 1
                return c, None
            jax.lax.scan(step, 0, length=3)
            return x
        return jax.shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"))(x)
    _, upd = f.apply({"stats": {"n": jnp.int32(1)}}, X, mutable=["stats"])
    assert int(upd["stats"]["n"]) == 4


@pytest.mark.parametrize("shard_map", list(SHARD_MAPS.values()), ids=list(SHARD_MAPS))
def test_write_that_differs_per_shard_raises_naming_the_lifted_shard_map(shard_map):
    @vj.functionalize
    def f(x):
        total = vj.variable("stats", "total", jnp.zeros, ())

        def body(x):
            total.value = jnp.sum(x)            # each shard's own sum
            return x
        return shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"))(x)
    with pytest.raises(errors.TransformError) as info:
        f.apply({"stats": {"total": jnp.float32(0.0)}}, X, mutable=["stats"])
    _assert_names(info.value, "stats", ("total",), ["differs between shards", "'d'"])
    assert "vj.shard_map" in info.value.fix and "variable_specs" in info.value.fix


def test_write_under_check_vma_false_raises():
    @vj.functionalize
    def f(x):
        total = vj.variable("stats", "total", jnp.zeros, ())

        def body(x):
            total.value = jax.lax.psum(jnp.sum(x), "d")
            return x
        return jax.shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"),
                             check_vma=False)(x)
    with pytest.raises(errors.TransformError) as info:
        f.apply({"stats": {"total": jnp.float32(0.0)}}, X, mutable=["stats"])
    _assert_names(info.value, "stats", ("total",), ["check_vma=False"])


def test_write_inside_a_raw_pmap_raises():
    @vj.functionalize
    def f(x):
        total = vj.variable("stats", "total", jnp.zeros, ())

        def body(x):
            total.value = jax.lax.psum(x, "i")
            return x
        return jax.pmap(body, axis_name="i")(x)
    with pytest.raises(errors.TransformError) as info:
        f.apply({"stats": {"total": jnp.float32(0.0)}}, X[:2], mutable=["stats"])
    _assert_names(info.value, "stats", ("total",), ["jax.pmap"])
    assert "vj.pmap" in info.value.fix


def test_read_under_check_vma_false_and_in_a_raw_pmap_is_replicated():
    @vj.functionalize
    def f(x):
        def body(x):
            return x * vj.param("w", nn.initializers.ones, ())
        return (jax.shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"),
                              check_vma=False)(x), jax.pmap(body)(x[:2]))
    a, b = f.apply({"params": {"w": jnp.float32(3.0)}}, X)
    np.testing.assert_allclose(a, 3.0 * X)
    np.testing.assert_allclose(b, 3.0 * X[:2])


def test_draw_in_the_body_gives_every_shard_the_same_key():
    @vj.functionalize
    def f(x):
        def body(x):
            return x + jax.random.uniform(vj.make_rng("noise"), x.shape)
        return jax.shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"))(x)
    key = jax.random.key(1)
    y = f.apply({}, X, rngs={"noise": key})
    u = jax.random.uniform(streams.derive_at(key, (), 1), (2,))    # the first draw's key
    np.testing.assert_allclose(y - X, jnp.concatenate([u, u]), rtol=1e-6)


def test_draws_from_a_vj_rngs_stream_in_the_body_advance_it():
    @vj.functionalize
    def f(x):
        def body(x):
            return x + jax.random.uniform(vj.make_rng("noise"), x.shape)
        return jax.shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"))(x)
    rngs = vj.Rngs(noise=0)
    first, second = f.apply({}, X, rngs=rngs), f.apply({}, X, rngs=rngs)
    assert not np.allclose(first, second)
    np.testing.assert_allclose((first - X)[:2], (first - X)[2:], rtol=1e-6)


# --- higher-order primitives varjax has no rule for --------------------------------------------

def test_custom_vmap_over_a_variable_is_unsupported():
    from jax.custom_batching import custom_vmap

    @vj.functionalize
    def f(x):
        @custom_vmap
        def g(x):
            return x * vj.param("w", nn.initializers.ones, ())

        @g.def_vmap
        def rule(axis_size, in_batched, x):
            return x, True
        return g(x)
    with pytest.raises(errors.UnsupportedPrimitiveError) as info:
        f.apply({"params": {"w": jnp.float32(3.0)}}, X)
    _assert_names(info.value, "params", ("w",), ["custom_vmap_call"])


def test_composite_that_hides_its_body_effects_is_unsupported():
    # lax.composite's equation drops its body's effects: without the verifier, discharge
    # itself must notice the variable access before it reaches lowering.
    @vj.functionalize(verify=False)
    def f(x):
        return jax.lax.composite(lambda x: x * vj.param("w", nn.initializers.ones, ()),
                                 name="my.scale")(x)
    with pytest.raises(errors.UnsupportedPrimitiveError) as info:
        f.apply({"params": {"w": jnp.float32(3.0)}}, X)
    _assert_names(info.value, "params", ("w",), ["composite"])
