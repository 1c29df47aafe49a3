"""Streams as state: how init/apply/bind take keys, dicts of keys and ``vj.Rngs``, which mode
each stream is lowered in, and which stream a draw falls back to."""
import jax
import jax.numpy as jnp
import pytest

import varjax as vj
import varjax.nn as nn
from varjax import errors
from varjax.ir import streams

X = jnp.ones((1, 4), jnp.float32)


def same(a, b) -> bool:
    return bool((jax.random.key_data(a) == jax.random.key_data(b)).all())


def fold(seed, n):
    """NNX's convention (state, vj.Rngs): draw n of a call."""
    return jax.random.fold_in(jax.random.key(seed), n)


def linen(seed, count, path=()):
    """Linen's convention (explicit keys): draw ``count`` of the module at ``path``."""
    return streams.derive_at(jax.random.key(seed), path, count)


@vj.functionalize
def two_keys(x):
    return vj.make_rng("dropout"), vj.make_rng("dropout")


def state(seed=1, count=0, stream="dropout"):
    return {"rngs": {stream: {"key": jax.random.key(seed), "count": jnp.uint32(count)}}}


class Model(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(32)(x))


# --- modes ------------------------------------------------------------------------------

def test_explicit_key_draws_linen_keys_from_static_counts():
    a, b = two_keys.apply({}, X, rngs={"dropout": jax.random.key(1)})
    assert same(a, linen(1, 1)) and same(b, linen(1, 2))


def test_stored_state_draws_from_its_count_and_returns_the_advanced_count():
    (a, b), new = two_keys.apply(state(count=5), X, mutable=["rngs"])
    assert same(a, fold(1, 5)) and same(b, fold(1, 6))
    assert int(new["rngs"]["dropout"]["count"]) == 7
    assert same(new["rngs"]["dropout"]["key"], jax.random.key(1))   # the key never changes


def test_explicit_key_and_fresh_state_follow_linen_and_nnx_conventions():
    explicit = two_keys.apply({}, X, rngs={"dropout": jax.random.key(1)})
    implicit, _ = two_keys.apply(state(), X, mutable=["rngs"])
    assert [same(k, linen(1, n + 1)) for n, k in enumerate(explicit)] == [True, True]
    assert [same(k, fold(1, n)) for n, k in enumerate(implicit)] == [True, True]


def test_a_key_given_for_a_stream_wins_over_its_stored_state():
    (a, _), new = two_keys.apply(state(count=5), X, rngs={"dropout": jax.random.key(1)},
                                 mutable=["rngs"])
    assert same(a, linen(1, 1))
    assert int(new["rngs"]["dropout"]["count"]) == 5


def test_each_mode_lowers_to_its_own_ir():
    text = dict(vj.dump(two_keys, X, rngs={"dropout": jax.random.key(1)}, source=False))
    assert "var_get[__rng__:dropout]" in text["lower-rng"] and "rngs:" not in text["lower-rng"]
    text = dict(vj.dump(two_keys, X, variables=state(), mutable=["rngs"], source=False))
    assert "var_get[rngs:dropout/count]" in text["lower-rng"]
    assert "var_set[rngs:dropout/count]" in text["lower-rng"] and "__rng__" not in text["lower-rng"]


def test_a_loop_over_stored_state_draws_one_loop_key_and_advances_the_count_once():
    @vj.functionalize
    def per_step(x):
        return jax.lax.scan(lambda c, _: (c, vj.make_rng("dropout")), None, length=3)[1]

    keys, new = per_step.apply(state(count=2), X, mutable=["rngs"])
    loop_key = fold(1, 2)
    assert all(same(keys[i], jax.random.fold_in(loop_key, i)) for i in range(3))
    assert int(new["rngs"]["dropout"]["count"]) == 3


# --- init / apply with vj.Rngs -------------------------------------------------------------

def test_init_with_rngs_draws_params_in_call_order_and_with_a_key_as_linen():
    model = Model()
    by_key = model.init(jax.random.key(0), X)["params"]["Dense_0"]["kernel"]
    by_rngs = model.init(vj.Rngs(0), X)["params"]["Dense_0"]["kernel"]
    init = nn.initializers.lecun_normal()
    assert bool((by_rngs == init(fold(0, 0), (4, 32))).all())
    assert bool((by_key == init(linen(0, 1, ("Dense_0",)), (4, 32))).all())


def test_init_with_rngs_keeps_the_non_params_streams_as_given():
    variables = Model().init(vj.Rngs(0, params=1, dropout=2), X, train=True)
    assert sorted(variables["rngs"]) == ["default", "dropout"]
    assert int(variables["rngs"]["dropout"]["count"]) == 0     # init drew a mask: not kept
    assert int(variables["rngs"]["default"]["count"]) == 0
    assert same(variables["rngs"]["dropout"]["key"], jax.random.key(2))


def test_init_with_a_key_has_no_rngs_collection():
    assert "rngs" not in Model().init(jax.random.key(0), X, train=True)


def test_apply_with_mutable_rngs_draws_fresh_keys_each_call():
    model = Model()
    variables = model.init(vj.Rngs(params=0, dropout=1), X)
    y1, new = model.apply(variables, X, train=True, mutable=["rngs"])
    y2, new2 = model.apply({**variables, **new}, X, train=True, mutable=["rngs"])
    assert not bool((y1 == y2).all())
    assert [int(n["rngs"]["dropout"]["count"]) for n in (new, new2)] == [1, 2]


def test_an_rngs_given_to_apply_is_advanced_in_place():
    model = Model()
    variables = model.init(jax.random.key(0), X)
    rngs = vj.Rngs(0, dropout=3)
    y1 = model.apply(variables, X, train=True, rngs=rngs)
    y2 = model.apply(variables, X, train=True, rngs=rngs)
    assert int(rngs.dropout.count) == 2 and int(rngs.default.count) == 0
    assert not bool((y1 == y2).all())
    # the first call drew what a fresh Rngs with the same seeds draws
    assert bool((y1 == model.apply(variables, X, train=True, rngs=vj.Rngs(0, dropout=3))).all())


def test_init_advances_the_rngs_it_draws_params_from():
    rngs = vj.Rngs(0)
    first = Model().init(rngs, X)
    assert int(rngs.default.count) == 2                          # kernel and bias
    second = Model().init(rngs, X)
    assert not bool((first["params"]["Dense_0"]["kernel"] ==
                     second["params"]["Dense_0"]["kernel"]).all())


def test_an_rngs_given_to_apply_replaces_the_stored_state_and_returns_it_only_if_mutable():
    rngs = vj.Rngs(dropout=7)
    (a, _), new = two_keys.apply(state(count=5), X, rngs=rngs, mutable=["rngs"])
    assert same(a, fold(7, 0))
    assert int(new["rngs"]["dropout"]["count"]) == 2
    out = two_keys.apply(state(count=5), X, rngs=vj.Rngs(dropout=7))
    assert same(out[0], fold(7, 0))                               # no mutable needed, no state out


def test_bind_with_rngs_advances_it_on_every_call():
    model = Model()
    variables = model.init(jax.random.key(0), X)
    rngs = vj.Rngs(dropout=1)
    bound = model.bind(variables, rngs=rngs)
    y1, y2 = bound(X, train=True), bound(X, train=True)
    assert int(rngs.dropout.count) == 2 and not bool((y1 == y2).all())
    assert bound.has_rng("dropout") and not bound.has_rng("noise")


# --- which stream a draw uses -----------------------------------------------------------------

def test_an_unknown_stream_falls_back_to_default_and_the_ir_names_default():
    keys = two_keys.apply({}, X, rngs={"default": jax.random.key(4)})
    assert same(keys[0], linen(4, 1)) and same(keys[1], linen(4, 2))
    assert "rng_draw[default:#1]" in str(two_keys.jaxpr(X, rngs={"default": jax.random.key(4)}))


def test_two_streams_falling_back_to_default_share_its_counter():
    @vj.functionalize
    def f(x):
        return vj.make_rng("dropout"), vj.make_rng("noise")

    a, b = f.apply({}, X, rngs=vj.Rngs(4))
    assert same(a, fold(4, 0)) and same(b, fold(4, 1))


def test_module_make_rng_falls_back_to_default_then_params():
    class Draw(nn.Module):
        @nn.compact
        def __call__(self, x):
            return self.make_rng("dropout")

    assert same(Draw().apply({}, X, rngs={"params": jax.random.key(2), "default": jax.random.key(3)}),
                linen(3, 1))
    assert same(Draw().apply({}, X, rngs={"params": jax.random.key(2)}), linen(2, 1))


def test_vj_make_rng_has_no_params_fallback():
    with pytest.raises(errors.MissingRngError, match="neither 'dropout' nor 'default'"):
        two_keys.apply({}, X, rngs={"params": jax.random.key(2)})


def test_a_stream_the_lift_was_not_asked_to_lift_is_an_error_not_a_fallback():
    @vj.functionalize
    def f(x):
        return vj.lift(lambda region, groups, rngs: region(groups, rngs),
                       lambda: vj.make_rng("dropout"), rngs=("noise",))()

    with pytest.raises(errors.TransformError, match="'dropout'"):
        f.apply({}, X, rngs={"dropout": jax.random.key(0), "noise": jax.random.key(1)})
