"""``vj.Rngs``, ``vj.RngStream`` and ``vj.reseed`` as objects: streams, counts, seeds,
samplers, ``fork``, pytree behaviour, repr and reseeding.  Eager ``jax.random`` only."""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj

# Methods of RngStream / Rngs that are not samplers.
_NON_SAMPLERS = {"fork", "split", "broadcast", "tree_flatten", "tree_unflatten"}


def key_bits(key):
    """A typed or raw key (or key array) as its raw uint32 data, for exact comparison."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(key))
    return np.asarray(key)


def assert_same_key(a, b):
    assert a.dtype == b.dtype
    assert jnp.shape(a) == jnp.shape(b)
    np.testing.assert_array_equal(key_bits(a), key_bits(b))


def assert_bitwise_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def drawn(seed, n):
    """The n-th key a fresh stream seeded with ``seed`` returns."""
    return jax.random.fold_in(jax.random.key(seed), n)


def jax_random_samplers():
    """Every public jax.random function whose first parameter is ``key``, minus the ones that
    manage keys instead of sampling."""
    names = set()
    for name in dir(jax.random):
        fn = getattr(jax.random, name)
        if name.startswith("_") or not callable(fn):
            continue
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if params[:1] == ["key"]:
            names.add(name)
    return names - {"clone", "fold_in", "split"}


def public_methods(cls):
    return {name for name in dir(cls) if not name.startswith("_")}


# -- 1. named streams and default -------------------------------------------------------

def test_named_stream_draws_fold_in_of_its_key_and_count():
    rngs = vj.Rngs(0, params=1)
    assert_same_key(rngs.params(), drawn(1, 0))
    assert_same_key(rngs.params(), drawn(1, 1))
    # default was not touched by the params draws
    assert_same_key(rngs(), drawn(0, 0))


def test_call_and_unknown_name_draw_from_default_and_share_its_count():
    rngs = vj.Rngs(0, params=1)
    assert_same_key(rngs(), drawn(0, 0))
    assert_same_key(rngs.dropout(), drawn(0, 1))
    assert_same_key(rngs(), drawn(0, 2))
    assert rngs.dropout is rngs.default
    assert int(rngs.default.count) == 3
    assert int(rngs.params.count) == 0


def test_getitem_returns_the_same_stream_as_attribute_access():
    rngs = vj.Rngs(0, params=1)
    assert rngs["params"] is rngs.params
    assert_same_key(rngs["params"](), drawn(1, 0))
    assert rngs["dropout"] is rngs["default"]


def test_contains_is_true_only_for_streams_really_held():
    rngs = vj.Rngs(0, params=1)
    assert "params" in rngs
    assert "default" in rngs
    assert "dropout" not in rngs   # falls back to default, but is not a stream of its own


def test_iteration_yields_stream_names_sorted():
    assert list(vj.Rngs(0, params=1)) == ["default", "params"]
    assert list(vj.Rngs(zeta=1, alpha=2, mid=3)) == ["alpha", "mid", "zeta"]
    assert list(vj.Rngs()) == []


def test_typed_key_keyword_stream():
    key = jax.random.key(2)
    rngs = vj.Rngs(0, params=1, dropout=key)
    assert list(rngs) == ["default", "dropout", "params"]
    assert_same_key(rngs.dropout(), jax.random.fold_in(key, 0))


def test_rngstream_on_its_own():
    stream = vj.RngStream(3)
    assert stream.tag == "default"
    assert_same_key(stream(), drawn(3, 0))
    assert_same_key(stream(), drawn(3, 1))
    assert vj.RngStream(3, tag="params").tag == "params"


# -- 2. key and count ---------------------------------------------------------------

def test_key_never_changes_and_count_increments_as_uint32():
    rngs = vj.Rngs(0, params=1)
    key0 = rngs.params.key
    assert rngs.params.count.dtype == jnp.uint32
    assert jnp.shape(rngs.params.count) == ()
    assert int(rngs.params.count) == 0
    for n in range(1, 4):
        rngs.params()
        assert int(rngs.params.count) == n
        assert rngs.params.count.dtype == jnp.uint32
        assert_same_key(rngs.params.key, key0)
        assert_same_key(rngs.params.key, jax.random.key(1))


def test_draws_are_all_distinct():
    rngs = vj.Rngs(0)
    bits = {tuple(key_bits(rngs()).tolist()) for _ in range(5)}
    assert len(bits) == 5


def test_stream_with_given_count_starts_there():
    stream = vj.RngStream(4, jnp.uint32(7))
    assert_same_key(stream(), drawn(4, 7))
    assert int(stream.count) == 8


# -- 3. unknown stream without default ------------------------------------------------

def test_unknown_stream_without_default_raises_unknown_stream_error():
    rngs = vj.Rngs(params=1)
    with pytest.raises(vj.errors.UnknownStreamError) as info:
        rngs.dropout
    assert isinstance(info.value, vj.errors.MissingRngError)
    assert isinstance(info.value, AttributeError)
    assert "dropout" in str(info.value)
    assert info.value.collection == "dropout"


def test_unknown_stream_without_default_raises_via_getitem_and_call():
    rngs = vj.Rngs(params=1)
    with pytest.raises(vj.errors.UnknownStreamError, match="dropout"):
        rngs["dropout"]
    with pytest.raises(vj.errors.UnknownStreamError, match="default"):
        rngs()
    with pytest.raises(vj.errors.UnknownStreamError):
        rngs.normal((2,))   # samplers on Rngs use default


def test_hasattr_is_false_for_unknown_stream_without_default():
    rngs = vj.Rngs(params=1)
    assert not hasattr(rngs, "dropout")
    assert hasattr(rngs, "params")
    assert hasattr(vj.Rngs(0), "dropout")   # falls back to default


def test_private_attribute_lookup_is_a_plain_attribute_error():
    rngs = vj.Rngs(0)
    with pytest.raises(AttributeError) as info:
        rngs._nope
    assert not isinstance(info.value, vj.errors.MissingRngError)


# -- 4. seeds ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [5, np.int64(5), np.uint32(5), jnp.int32(5), jnp.array(5, jnp.uint32)],
                         ids=["int", "np.int64", "np.uint32", "jnp.int32", "jnp.uint32"])
def test_integer_seeds_become_jax_random_key(seed):
    rngs = vj.Rngs(seed, params=seed)
    assert_same_key(rngs.default.key, jax.random.key(5))
    assert_same_key(rngs.params.key, jax.random.key(5))
    assert_same_key(rngs.params(), drawn(5, 0))


def test_typed_key_seed_is_kept():
    key = jax.random.key(9)
    rngs = vj.Rngs(key)
    assert_same_key(rngs.default.key, key)
    assert_same_key(rngs(), jax.random.fold_in(key, 0))


def test_raw_prngkey_seed_is_accepted_and_drawn_from():
    raw = jax.random.PRNGKey(0)
    rngs = vj.Rngs(raw)
    assert rngs.default.key.dtype == jnp.uint32
    assert jnp.shape(rngs.default.count) == ()
    assert_same_key(rngs(), jax.random.fold_in(raw, 0))
    assert_same_key(rngs(), jax.random.fold_in(raw, 1))


@pytest.mark.parametrize("bad", [1.5, np.float32(1.0), jnp.float32(1.0), True, "0", jnp.arange(3)],
                         ids=["float", "np.float32", "jnp.float32", "bool", "str", "int-vector"])
def test_non_seed_raises_config_error(bad):
    with pytest.raises(vj.errors.ConfigError):
        vj.Rngs(bad)
    with pytest.raises(vj.errors.ConfigError, match="dropout"):
        vj.Rngs(0, dropout=bad)


def test_float_seed_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        vj.Rngs(0.0)


# -- 5. samplers -------------------------------------------------------------------------

def test_sampler_methods_are_exactly_jax_random_samplers():
    expected = jax_random_samplers()
    assert "normal" in expected and "split" not in expected   # sanity of the computed set
    assert public_methods(vj.RngStream) - _NON_SAMPLERS == expected
    assert public_methods(vj.Rngs) - _NON_SAMPLERS == expected


def test_rngs_normal_equals_jax_random_normal_and_advances_default():
    rngs = vj.Rngs(0, params=1)
    got = rngs.normal((2, 3))
    assert_bitwise_equal(got, jax.random.normal(drawn(0, 0), (2, 3)))
    assert int(rngs.default.count) == 1
    assert int(rngs.params.count) == 0
    assert_bitwise_equal(rngs.normal((2, 3)), jax.random.normal(drawn(0, 1), (2, 3)))
    assert_same_key(rngs(), drawn(0, 2))


def test_stream_bernoulli_equals_jax_random_bernoulli():
    rngs = vj.Rngs(0, params=1)
    assert_bitwise_equal(rngs.params.bernoulli(0.5, (10,)), jax.random.bernoulli(drawn(1, 0), 0.5, (10,)))
    assert int(rngs.params.count) == 1
    assert int(rngs.default.count) == 0


def test_stream_uniform_equals_jax_random_uniform():
    rngs = vj.Rngs(0, params=1)
    rngs.params()
    got = rngs.params.uniform((4,), minval=-1.0, maxval=2.0)
    assert_bitwise_equal(got, jax.random.uniform(drawn(1, 1), (4,), minval=-1.0, maxval=2.0))


def test_stream_categorical_equals_jax_random_categorical():
    rngs = vj.Rngs(0, params=1)
    logits = jnp.log(jnp.array([0.1, 0.2, 0.7], jnp.float32))
    got = rngs.params.categorical(logits, shape=(6,))
    assert_bitwise_equal(got, jax.random.categorical(drawn(1, 0), logits, shape=(6,)))


def test_stream_permutation_equals_jax_random_permutation():
    rngs = vj.Rngs(0, params=1)
    x = jnp.arange(8)
    assert_bitwise_equal(rngs.params.permutation(x), jax.random.permutation(drawn(1, 0), x))
    assert_bitwise_equal(rngs.params.permutation(8), jax.random.permutation(drawn(1, 1), 8))


def test_unknown_stream_sampler_draws_from_default():
    rngs = vj.Rngs(0, params=1)
    assert_bitwise_equal(rngs.dropout.uniform((3,)), jax.random.uniform(drawn(0, 0), (3,)))
    assert int(rngs.default.count) == 1


@pytest.mark.parametrize("name", ["normal", "uniform", "bits", "gumbel", "laplace", "logistic",
                                  "rademacher", "exponential", "cauchy"])
def test_shape_only_samplers_match_jax_random(name):
    rngs = vj.Rngs(0)
    got = getattr(rngs, name)(shape=(3,))
    assert_bitwise_equal(got, getattr(jax.random, name)(drawn(0, 0), shape=(3,)))


def test_sampler_signature_on_the_class_is_self_then_jax_signature_without_key():
    for name in sorted(jax_random_samplers()):
        expected = list(inspect.signature(getattr(jax.random, name)).parameters)[1:]
        for cls in (vj.RngStream, vj.Rngs):
            params = list(inspect.signature(getattr(cls, name)).parameters)
            assert "key" not in params, (cls, name)
            assert params == ["self", *expected], (cls, name)


def test_bound_sampler_signature_is_jax_signature_without_key():
    rngs = vj.Rngs(0, params=1)
    for name in ("normal", "bernoulli", "uniform", "permutation"):
        expected = list(inspect.signature(getattr(jax.random, name)).parameters)[1:]
        assert list(inspect.signature(getattr(rngs, name)).parameters) == expected, name
        assert list(inspect.signature(getattr(rngs.params, name)).parameters) == expected, name


def test_sampler_docstring_names_the_jax_random_function():
    for name in sorted(jax_random_samplers()):
        for cls in (vj.RngStream, vj.Rngs):
            doc = getattr(cls, name).__doc__
            assert f"jax.random.{name}" in doc, (cls, name)
            assert getattr(cls, name).__name__ == name


# -- 6. fork -----------------------------------------------------------------------------

def test_fork_keys_are_draws_from_parent_with_zero_counts():
    rngs = vj.Rngs(0, params=1)
    rngs.params()   # params count 1 before the fork
    child = rngs.fork()
    assert list(child) == ["default", "params"]
    assert_same_key(child.default.key, drawn(0, 0))
    assert_same_key(child.params.key, drawn(1, 1))
    assert int(child.default.count) == 0 and int(child.params.count) == 0
    assert child.default.count.dtype == jnp.uint32
    # the parent advanced by exactly one draw per stream
    assert int(rngs.default.count) == 1
    assert int(rngs.params.count) == 2
    # the child draws from its own keys
    assert_same_key(child.params(), jax.random.fold_in(drawn(1, 1), 0))
    assert child.params.tag == "params"


def test_fork_children_are_independent_of_parent_and_each_other():
    rngs = vj.Rngs(0)
    a, b = rngs.fork(), rngs.fork()
    assert not np.array_equal(key_bits(a.default.key), key_bits(b.default.key))
    a()
    assert int(b.default.count) == 0
    assert int(rngs.default.count) == 2


def test_fork_split_int_gives_leading_axis():
    rngs = vj.Rngs(0, params=1)
    child = rngs.fork(split=5)
    for name, seed in (("default", 0), ("params", 1)):
        stream = child[name]
        assert jnp.shape(stream.key) == (5,)
        assert jnp.shape(stream.count) == (5,)
        assert stream.count.dtype == jnp.uint32
        np.testing.assert_array_equal(np.asarray(stream.count), np.zeros(5, np.uint32))
        assert_same_key(stream.key, jax.random.split(drawn(seed, 0), 5))
        rows = {tuple(r) for r in key_bits(stream.key).tolist()}
        assert len(rows) == 5   # members differ
    assert int(rngs.default.count) == 1 and int(rngs.params.count) == 1


def test_fork_split_shape_tuple():
    rngs = vj.Rngs(0)
    child = rngs.fork(split=(2, 3))
    assert jnp.shape(child.default.key) == (2, 3)
    assert jnp.shape(child.default.count) == (2, 3)
    assert_same_key(child.default.key, jax.random.split(drawn(0, 0), (2, 3)))
    assert len({tuple(r) for r in key_bits(child.default.key).reshape(6, -1).tolist()}) == 6


def test_fork_split_dict_splits_only_matching_streams():
    rngs = vj.Rngs(0, dropout=1)
    child = rngs.fork(split={"dropout": 4})
    assert jnp.shape(child.dropout.key) == (4,)
    assert jnp.shape(child.dropout.count) == (4,)
    assert jnp.shape(child.default.key) == ()
    assert jnp.shape(child.default.count) == ()
    assert_same_key(child.dropout.key, jax.random.split(drawn(1, 0), 4))
    assert_same_key(child.default.key, drawn(0, 0))
    assert int(rngs.default.count) == 1 and int(rngs.dropout.count) == 1


def test_fork_split_dict_with_filters():
    rngs = vj.Rngs(0, dropout=1, noise=2)
    child = rngs.fork(split={vj.DenyList("default"): 3})
    assert {n: jnp.shape(child[n].key) for n in child} == {"default": (), "dropout": (3,), "noise": (3,)}
    child = vj.Rngs(0, dropout=1, noise=2).fork(split={("noise", "default"): 2, True: 5})
    assert {n: jnp.shape(child[n].key) for n in child} == {"default": (2,), "dropout": (5,), "noise": (2,)}


def test_rngstream_fork():
    stream = vj.RngStream(0, tag="params")
    child = stream.fork(split=3)
    assert child.tag == "params"
    assert_same_key(child.key, jax.random.split(drawn(0, 0), 3))
    assert jnp.shape(child.count) == (3,)
    assert int(stream.count) == 1


# -- 7. pytree -----------------------------------------------------------------------------

def test_tree_leaves_are_keys_and_counts_sorted_by_stream():
    rngs = vj.Rngs(0, params=1)
    rngs.params()
    leaves = jax.tree.leaves(rngs)
    assert len(leaves) == 4
    assert_same_key(leaves[0], jax.random.key(0))
    assert int(leaves[1]) == 0 and leaves[1].dtype == jnp.uint32
    assert_same_key(leaves[2], jax.random.key(1))
    assert int(leaves[3]) == 1


def test_tree_roundtrip_keeps_streams_and_tags():
    rngs = vj.Rngs(0, params=1)
    leaves, treedef = jax.tree.flatten(rngs)
    back = jax.tree.unflatten(treedef, leaves)
    assert isinstance(back, vj.Rngs)
    assert list(back) == ["default", "params"]
    assert back.params.tag == "params"
    assert_same_key(back.params(), drawn(1, 0))
    # a stream alone is a pytree too
    assert len(jax.tree.leaves(vj.RngStream(0))) == 2


def test_rngs_through_jit_draws_like_eager_and_returns_advanced_count():
    def draw(rngs):
        return rngs.params(), rngs

    key, out = jax.jit(draw)(vj.Rngs(0, params=1))
    assert isinstance(out, vj.Rngs)
    assert_same_key(key, drawn(1, 0))
    assert int(out.params.count) == 1
    assert int(out.default.count) == 0
    # and the returned Rngs keeps drawing where it left off
    assert_same_key(out.params(), drawn(1, 1))


def test_rngs_passed_to_jit_is_a_copy():
    rngs = vj.Rngs(0)
    jax.jit(lambda r: r())(rngs)
    assert int(rngs.default.count) == 0


def test_rngs_through_vmap_over_forked_split():
    rngs = vj.Rngs(0)
    forked = rngs.fork(split=5)
    split_keys = jax.random.split(drawn(0, 0), 5)

    def draw(r):
        return r(), r

    keys, out = jax.vmap(draw)(forked)
    assert jnp.shape(keys) == (5,)
    assert len({tuple(r) for r in key_bits(keys).tolist()}) == 5
    for i in range(5):
        assert_same_key(keys[i], jax.random.fold_in(split_keys[i], 0))
    np.testing.assert_array_equal(np.asarray(out.default.count), np.ones(5, np.uint32))


def test_sampler_inside_vmap_over_forked_split():
    forked = vj.Rngs(0).fork(split=3)
    split_keys = jax.random.split(drawn(0, 0), 3)
    got = jax.vmap(lambda r: r.normal((2,)))(forked)
    want = jnp.stack([jax.random.normal(jax.random.fold_in(k, 0), (2,)) for k in split_keys])
    assert_bitwise_equal(got, want)


# -- 8. repr --------------------------------------------------------------------------------

def test_repr_shows_streams_key_data_and_counts():
    rngs = vj.Rngs(0, params=1)
    rngs.params()
    text = repr(rngs)
    assert text.startswith("Rngs(")
    assert "default=RngStream(" in text
    assert "params=RngStream(" in text
    assert "count=uint32[] 0" in text
    assert "count=uint32[] 1" in text
    assert "[0, 0]" in text   # key(0)'s data
    assert "[0, 1]" in text   # key(1)'s data
    assert text.index("default=") < text.index("params=")
    assert repr(vj.Rngs()) == "Rngs()"


def test_repr_of_forked_split_shows_batched_types():
    text = repr(vj.Rngs(0).fork(split=2))
    assert "count=uint32[2] [0, 0]" in text
    assert "[2]" in text.split("key=")[1].split(" ")[0]


def test_repr_of_stream():
    text = repr(vj.RngStream(0))
    assert text.startswith("RngStream(key=")
    assert "count=uint32[] 0" in text


def test_repr_inside_jit_shows_types_of_tracers():
    seen = []

    def f(rngs):
        seen.append(repr(rngs))
        return rngs()

    jax.jit(f)(vj.Rngs(0))
    assert len(seen) == 1
    assert "default=RngStream(" in seen[0]
    assert "uint32[]" in seen[0]
    assert "key<" in seen[0]


# -- 9. reseed -----------------------------------------------------------------------------

def _variables():
    return {"rngs": {"dropout": {"key": jax.random.key(0), "count": jnp.uint32(7)}},
            "params": {"w": jnp.ones((2,), jnp.float32)}}


def test_reseed_variables_returns_new_dict_with_fresh_stream():
    variables = _variables()
    params = variables["params"]
    old_dropout = variables["rngs"]["dropout"]
    out = vj.reseed(variables, dropout=1)
    assert out is not variables
    assert_same_key(out["rngs"]["dropout"]["key"], jax.random.key(1))
    assert int(out["rngs"]["dropout"]["count"]) == 0
    assert out["rngs"]["dropout"]["count"].dtype == jnp.uint32
    assert out["params"] is params
    # the input is not mutated
    assert variables["rngs"]["dropout"] is old_dropout
    assert_same_key(variables["rngs"]["dropout"]["key"], jax.random.key(0))
    assert int(variables["rngs"]["dropout"]["count"]) == 7
    assert set(variables) == {"rngs", "params"}


def test_reseed_variables_with_a_key_value():
    key = jax.random.key(42)
    out = vj.reseed(_variables(), dropout=key)
    assert_same_key(out["rngs"]["dropout"]["key"], key)
    assert int(out["rngs"]["dropout"]["count"]) == 0


def test_reseed_leaves_other_streams_alone():
    variables = _variables()
    variables["rngs"]["noise"] = {"key": jax.random.key(3), "count": jnp.uint32(2)}
    out = vj.reseed(variables, dropout=1)
    assert out["rngs"]["noise"] is variables["rngs"]["noise"]


def test_reseed_keeps_a_raw_stored_key_raw():
    v = {"rngs": {"d": {"key": jax.random.PRNGKey(0), "count": jnp.uint32(3)}}}
    key = vj.reseed(v, d=1)["rngs"]["d"]["key"]
    assert key.dtype == jnp.uint32
    assert (key == jax.random.key_data(jax.random.key(1))).all()


def test_default_seed_given_twice_is_a_config_error():
    with pytest.raises(vj.errors.ConfigError, match="given twice"):
        vj.Rngs(0, default=1)


def test_reseed_forked_stream_splits_new_key():
    forked = vj.Rngs(dropout=0).fork(split=5)
    variables = {"rngs": {"dropout": {"key": forked.dropout.key, "count": jnp.ones(5, jnp.uint32)}}}
    out = vj.reseed(variables, dropout=1)
    assert_same_key(out["rngs"]["dropout"]["key"], jax.random.split(jax.random.key(1), 5))
    np.testing.assert_array_equal(np.asarray(out["rngs"]["dropout"]["count"]), np.zeros(5, np.uint32))
    assert out["rngs"]["dropout"]["count"].dtype == jnp.uint32


def test_reseed_rngs_returns_new_rngs_with_fresh_seed():
    rngs = vj.Rngs(0, dropout=5)
    rngs.dropout()
    rngs()
    out = vj.reseed(rngs, dropout=1)
    assert isinstance(out, vj.Rngs)
    assert out is not rngs
    assert list(out) == ["default", "dropout"]
    assert_same_key(out.dropout.key, jax.random.key(1))
    assert int(out.dropout.count) == 0
    assert_same_key(out.dropout(), drawn(1, 0))
    assert out.dropout.tag == "dropout"
    # the untouched stream keeps its state; the original is unchanged
    assert int(out.default.count) == 1
    assert_same_key(rngs.dropout.key, jax.random.key(5))
    assert int(rngs.dropout.count) == 1


def test_reseed_forked_rngs():
    forked = vj.Rngs(0).fork(split=3)
    out = vj.reseed(forked, default=1)
    assert_same_key(out.default.key, jax.random.split(jax.random.key(1), 3))
    np.testing.assert_array_equal(np.asarray(out.default.count), np.zeros(3, np.uint32))


def test_reseed_matches_a_fresh_rngs():
    out = vj.reseed(vj.Rngs(0, dropout=5), dropout=1, default=2)
    fresh = vj.Rngs(2, dropout=1)
    assert_same_key(out.dropout(), fresh.dropout())
    assert_same_key(out(), fresh())


def test_reseed_unknown_stream_raises_naming_it():
    with pytest.raises(vj.errors.UnknownStreamError, match="noise"):
        vj.reseed(_variables(), noise=1)
    with pytest.raises(vj.errors.UnknownStreamError, match="noise"):
        vj.reseed(vj.Rngs(0), noise=1)
    with pytest.raises(vj.errors.UnknownStreamError, match="dropout"):
        vj.reseed({"params": {}}, dropout=1)


def test_reseed_bad_seed_raises_config_error():
    with pytest.raises(vj.errors.ConfigError):
        vj.reseed(_variables(), dropout=1.5)


@pytest.mark.parametrize("target", [None, 3, [("rngs", {})], "rngs"])
def test_reseed_rejects_non_dict_non_rngs(target):
    with pytest.raises(TypeError):
        vj.reseed(target, dropout=1)
