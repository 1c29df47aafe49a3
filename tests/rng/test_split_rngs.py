"""``split_rngs`` in every lifted transform that maps or loops, ``fold_rngs``, and determinism.

A split stream gives each example / iteration / shard its own key; a stream that is not
split (``False``, or not listed at all) gives all of them the same key.  Every lift draws
one key per stream it uses from the enclosing stream, in both RNG modes (explicit keys
and streams kept as state), and results are bitwise the same whichever way a call is run:
eagerly, under ``jax.jit``, with an extra optional pass or without the optional ones.
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import varjax as vj
import varjax.nn as nn
from varjax.ir import streams
from varjax.passes import Pipeline

KEY = jax.random.key(0)
N = 4          # examples / iterations of vmap, scan and the loops
SHARDS = 2     # tests/conftest.py provides 2 CPU devices


def _normal(shape, seed=0):
    # NumPy draws: no XLA compile per shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _key_data(key):
    return np.asarray(jax.random.key_data(key))


def _sample():
    return jax.random.uniform(vj.make_rng("noise"), ())


def _fill(c):
    """Loop body: store a fresh sample at position ``i`` of the buffer."""
    i, buf = c
    return i + 1, buf.at[i].set(_sample())


def _empty():
    return jnp.int32(0), jnp.zeros((N,), jnp.float32)


@functools.cache
def _mesh():
    assert len(jax.devices()) == SHARDS
    # Auto axes: an Explicit mesh (make_mesh's default) would need inputs already sharded.
    return jax.make_mesh((SHARDS,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


# Each entry runs one lifted transform whose body draws one sample per example /
# iteration / shard, and returns those samples (with split_rngs as given).
_LIFTS = {
    "vmap": lambda s: vj.vmap(lambda x: x + _sample(), split_rngs=s)(jnp.zeros((N,), jnp.float32)),
    "scan": lambda s: vj.scan(lambda c: (c, _sample()), length=N, split_rngs=s)(jnp.float32(0))[1],
    "while_loop": lambda s: vj.while_loop(lambda c: c[0] < N, _fill, None, _empty(), split_rngs=s)[1],
    "fori_loop": lambda s: vj.fori_loop(0, N, lambda i, buf: _fill((i, buf))[1], None, _empty()[1],
                                        split_rngs=s),
    "remat_scan": lambda s: vj.remat_scan(_fill, lengths=(2, 2), split_rngs=s)(_empty())[1],
    "shard_map": lambda s: vj.shard_map(lambda x: x + _sample(), mesh=_mesh(), in_specs=P("d"),
                                        out_specs=P("d"), split_rngs=s)(jnp.zeros((SHARDS,), jnp.float32)),
    "pmap": lambda s: vj.pmap(lambda x: x + _sample(), split_rngs=s)(jnp.zeros((SHARDS,), jnp.float32)),
}
_SIZE = {name: SHARDS if name in ("shard_map", "pmap") else N for name in _LIFTS}
_MODES = {"split": {"noise": True}, "broadcast": {"noise": False}, "unlisted": {"params": True}}


@functools.cache
def _sampler(transform, modes):
    """A function running ``transform`` once per split mode in ``modes``, in order."""
    @vj.functionalize
    def run():
        return {mode: _LIFTS[transform](_MODES[mode]) for mode in modes}
    return run


@functools.cache
def _explicit_samples(transform):
    out = _sampler(transform, tuple(_MODES)).apply({}, rngs={"noise": KEY})
    return {mode: np.asarray(v) for mode, v in out.items()}


# -- 1. split vs broadcast ------------------------------------------------------------------

@pytest.mark.parametrize("transform", list(_LIFTS))
def test_split_stream_differs_per_member_and_unsplit_or_unlisted_stream_is_shared(transform):
    samples = _explicit_samples(transform)
    n = _SIZE[transform]
    assert all(v.shape == (n,) for v in samples.values())
    assert len(set(samples["split"].tolist())) == n            # one key per member
    assert len(set(samples["broadcast"].tolist())) == 1        # the same key for all
    assert len(set(samples["unlisted"].tolist())) == 1
    assert all(v[0] != 0.0 for v in samples.values())          # really drawn


# -- 2. split of a stream that only the default stream provides ---------------------------

@pytest.mark.parametrize("transform", list(_LIFTS))
def test_stream_provided_only_through_default_is_still_split_under_its_own_name(transform):
    rngs = vj.Rngs(0)
    out = _sampler(transform, ("split",)).apply({}, rngs=rngs)["split"]
    assert len(set(np.asarray(out).tolist())) == _SIZE[transform]
    assert int(rngs.default.count) == 1                         # one key drawn for the lift
    # default's first draw is fold_in(key(0), 0): the same key as a noise stream of seed 0
    np.testing.assert_array_equal(out, _sampler(transform, ("split",)).apply(
        {}, rngs=vj.Rngs(noise=0))["split"])


# -- lifts draw only the streams their bodies use -------------------------------------------

@pytest.mark.parametrize("transform", list(_LIFTS))
def test_lift_does_not_draw_from_a_split_stream_its_body_never_uses(transform):
    """NNX's convention (a lift draws one key per stream its body uses): the draw after
    the lift is the first of ``params``.  (Under Linen's, a lift never draws.)"""
    # while_loop/fori_loop derive per-iteration keys inside the loop (lifting.DerivedKeys):
    # a stream the body never draws from must not enter the loop, or its enclosing draw
    # would stay and the make_rng('params') after the loop would get fold_in(key, 1).
    @vj.functionalize
    def run():
        _LIFTS[transform]({"noise": True, "params": True})     # the body draws noise only
        return vj.make_rng("params")

    after = run.apply({}, rngs=vj.Rngs(noise=0, params=1))
    np.testing.assert_array_equal(_key_data(after),
                                  _key_data(jax.random.fold_in(jax.random.key(1), 0)))


# -- 3. implicit mode under a lift -----------------------------------------------------------

def test_implicit_stream_advances_by_one_per_lifted_call_and_gives_fresh_samples():
    f = _sampler("vmap", ("split",))
    state = {"rngs": {"noise": {"key": KEY, "count": jnp.uint32(0)}}}
    first, state = f.apply(state, mutable=["rngs"])
    assert int(state["rngs"]["noise"]["count"]) == 1
    np.testing.assert_array_equal(_key_data(state["rngs"]["noise"]["key"]), _key_data(KEY))
    second, state = f.apply(state, mutable=["rngs"])
    assert int(state["rngs"]["noise"]["count"]) == 2
    assert not np.array_equal(first["split"], second["split"])
    assert len(set(np.asarray(second["split"]).tolist())) == N
    # count 0 draws what a fresh Rngs draws
    np.testing.assert_array_equal(first["split"], f.apply({}, rngs=vj.Rngs(noise=KEY))["split"])


# -- 4. fold_rngs ----------------------------------------------------------------------------

def _draws(n):
    return [jax.random.key_data(vj.make_rng("noise")) for _ in range(n)]


@functools.cache
def _with_inner_draws(folded):
    """Draws ``n`` keys inside a body (in ``vj.fold_rngs`` if ``folded``), then one after it."""
    @vj.functionalize
    def run(n):
        inner = vj.fold_rngs(_draws) if folded else _draws
        return inner(n), jax.random.key_data(vj.make_rng("noise"))
    return run


def test_fold_rngs_extra_draw_inside_leaves_the_key_after_it_unchanged():
    """NNX's convention: the body's draws cost the enclosing stream one draw."""
    def after(n):
        rngs = vj.Rngs(noise=0)
        inner, key = _with_inner_draws(True).apply({}, n, rngs=rngs)
        assert len(inner) == n and len({tuple(np.asarray(k).tolist()) for k in inner}) == n
        assert int(rngs.noise.count) == 2                       # one for the body, one after
        return key
    np.testing.assert_array_equal(after(1), after(2))
    np.testing.assert_array_equal(after(1), _key_data(jax.random.fold_in(KEY, 1)))


def test_fold_rngs_under_linen_convention_counts_on_at_the_same_path_as_linen():
    """Linen's ``nn.fold_rngs`` forks one key (draw 1 at the path) for the body, but the
    draws inside at the same module path continue that path's count."""
    def after(n):
        inner, key = _with_inner_draws(True).apply({}, n, rngs={"noise": KEY})
        fork = streams.derive_at(KEY, (), 1)
        for i, k in enumerate(inner):
            np.testing.assert_array_equal(k, _key_data(streams.derive_at(fork, (), i + 2)))
        return key
    np.testing.assert_array_equal(after(1), _key_data(streams.derive_at(KEY, (), 3)))
    np.testing.assert_array_equal(after(2), _key_data(streams.derive_at(KEY, (), 4)))


def test_without_fold_rngs_an_extra_draw_shifts_the_key_after_it():
    def after(n):
        return _with_inner_draws(False).apply({}, n, rngs={"noise": KEY})[1]
    np.testing.assert_array_equal(after(1), _key_data(streams.derive_at(KEY, (), 2)))
    np.testing.assert_array_equal(after(2), _key_data(streams.derive_at(KEY, (), 3)))


# -- 5. determinism --------------------------------------------------------------------------

class DropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(nn.Dense(16)(x))


def _scan_and_cond(xs):
    """Draws in a lax.cond inside a lax.scan body and after the cond: lowered by lower-rng
    into counters threaded through both, which the other passes then rewrite."""
    def uniform():
        return jax.random.uniform(vj.make_rng("dropout"), ())

    def step(c, x):
        a = jax.lax.cond(x > 0, uniform, lambda: -uniform())
        return c + a, a * uniform()
    return jax.lax.scan(step, jnp.float32(0), xs)


_MINIMAL = Pipeline(["check-mutability", "lower-rng", "discharge"], verify=True)


def _ways_to_run(apply, fn, variables, *args):
    """The output of ``apply`` (which runs ``fn``), per way of running it and per RNG mode,
    with the same seed each time."""
    cast = vj.functionalize(fn, passes="cast-params{dtype=float32}")
    assert "cast-params" in [p.name for p in cast.pipeline.passes]
    minimal = vj.functionalize(fn)
    minimal.pipeline = _MINIMAL
    assert not {"forward-stores", "dead-reads"} & {p.name for p in minimal.pipeline.passes}
    ways = {"eager": apply, "jit": jax.jit(apply), "cast-params": cast.apply,
            "minimal pipeline": minimal.apply}
    modes = {"key": lambda: {"dropout": jax.random.key(1)}, "Rngs": lambda: vj.Rngs(dropout=1)}
    return {(way, mode): run(variables, *args, rngs=rngs())
            for way, run in ways.items() for mode, rngs in modes.items()}


def _assert_all_bitwise_equal(results):
    """Equal within each RNG mode (the modes follow different conventions: Linen's for
    keys, NNX's for an Rngs)."""
    for mode in {m for _, m in results}:
        _assert_bitwise_equal({k: v for k, v in results.items() if k[1] == mode})


def _assert_bitwise_equal(results):
    (first_name, first), *rest = results.items()
    for name, got in rest:
        assert jax.tree.structure(got) == jax.tree.structure(first)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(first)):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} vs {first_name}")


def test_dropout_module_is_bitwise_deterministic_across_jit_pipelines_and_rng_modes():
    model, x = DropoutNet(), _normal((2, 4))
    variables = model.init(jax.random.key(0), x)
    results = _ways_to_run(model.apply, model.functionalize().fn, variables, x)
    _assert_all_bitwise_equal(results)
    y = results[("eager", "key")]
    assert 0 < int((y == 0).sum()) < y.size                 # dropout really dropped something
    assert not np.array_equal(model.apply(variables, x, rngs={"dropout": jax.random.key(2)}), y)


def test_scan_and_cond_draws_are_bitwise_deterministic_across_jit_pipelines_and_rng_modes():
    xs = jnp.array([1.0, -1.0, 1.0], jnp.float32)
    results = _ways_to_run(vj.functionalize(_scan_and_cond).apply, _scan_and_cond, {}, xs)
    _assert_all_bitwise_equal(results)
    c, ys = results[("eager", "key")]
    assert len(set(np.asarray(ys).tolist())) == 3           # fresh keys at every step
    assert float(c) != 0.0


# -- 6. a stream nobody provided -------------------------------------------------------------

class Noisy(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jax.random.uniform(self.make_rng("noise"), x.shape)


class Outer(nn.Module):
    @nn.compact
    def __call__(self, xs):
        return nn.vmap(Noisy, split_rngs={"noise": True})(name="inner")(xs)


def test_missing_stream_in_a_lifted_module_body_names_stream_module_path_and_source():
    with pytest.raises(vj.errors.MissingRngError) as info:
        Outer().apply({}, jnp.zeros((2, 3), jnp.float32), rngs={"dropout": KEY})
    assert info.value.collection == "noise"
    assert tuple(info.value.path) == ("inner",)
    assert info.value.module.startswith("Outer/inner")
    assert os.path.basename(__file__) in info.value.source


def test_missing_stream_in_a_lifted_function_body_names_stream_and_source():
    @vj.functionalize
    def run(xs):
        return vj.scan(lambda c, x: (c, x + _sample()), split_rngs={"noise": True})(jnp.float32(0), xs)

    with pytest.raises(vj.errors.MissingRngError) as info:
        run.apply({}, jnp.zeros((3,), jnp.float32), rngs={"dropout": KEY})
    assert info.value.collection == "noise"
    assert info.value.path is None
    assert os.path.basename(__file__) in info.value.source
