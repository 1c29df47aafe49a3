"""``nnx.MultiHeadAttention`` and NNX's attention functions against flax.nnx 0.12.8: the
parameters bit for bit from the same seed, outputs with masks, dropout masks, sown weights,
the decode cache (types, paths, values) and the errors for bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from flax.nnx.nn import attention as flax_attention

from varjax import errors, nnx
from varjax.nnx import attention as A
from varjax.nnx.attention import MultiHeadAttention

B, L, F = 2, 3, 4
X = jax.random.normal(jax.random.key(1), (B, L, F))
KV = jax.random.normal(jax.random.key(2), (B, 5, 6))


def standard(fn, *args, **kwargs):
    """flax.nnx mixes ranks and dtypes implicitly, so the oracle runs under standard
    promotion; ours runs under the suite's strict promotion."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        return fn(*args, **kwargs)


def jitted(fn, **static):
    """``fn(*arrays, **static)`` compiled once: one XLA compilation instead of an eager
    one per operation and shape (the file's CPU budget); the same code is traced."""
    return jax.jit(lambda *arrays: fn(*arrays, **static))


def call_both(ours, theirs, *inputs, **options):
    """The two modules' outputs for ``inputs``, each call compiled (``nnx.jit``)."""
    def call(module, *xs):
        return module(*xs, **options)
    return nnx.jit(call)(ours, *inputs), standard(flax_nnx.jit(call), theirs, *inputs)


def both(seed=0, **kwargs):
    kwargs = {"num_heads": 2, "in_features": F, "decode": False, **kwargs}
    return (MultiHeadAttention(**kwargs, rngs=nnx.Rngs(seed)),
            standard(flax_nnx.MultiHeadAttention, **kwargs, rngs=flax_nnx.Rngs(seed)))


def same_state(ours, theirs):
    """The same paths, Variable types (a stream's key and count are views here, of
    flax.nnx's types) and values."""
    a, b = nnx.to_flat_state(nnx.state(ours)), flax_nnx.to_flat_state(flax_nnx.state(theirs))
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, v), (_, w) in zip(a, b):
        assert isinstance(v, getattr(nnx, type(w).__name__)), path
        x, y = v[...], w[...]
        if jnp.issubdtype(y.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(x, y, err_msg=str(path))


def close(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def plain():
    return both()


@pytest.fixture(scope="module")
def grouped():
    """Grouped-query attention, QK normalization, its own key/value and output features."""
    return both(seed=3, num_heads=4, num_kv_heads=2, qkv_features=8, in_kv_features=6,
                out_features=5, normalize_qk=True)


# -- construction -------------------------------------------------------------------------

def test_mha_parameters_match_flax_nnx_bitwise_paths_types_and_values(plain, grouped):
    for ours, theirs in (plain, grouped):
        same_state(ours, theirs)
    assert grouped[0].key.kernel.shape == (6, 2, 2)


def test_mha_with_dropout_keeps_a_forked_stream_as_flax_nnx(plain):
    ours, theirs = both(seed=5, dropout_rate=0.5)
    same_state(ours, theirs)   # rngs/count, rngs/key beside the projections
    assert ours.rngs is not None
    ours, theirs = both(dropout_rate=0.5, keep_rngs=False)
    assert ours.rngs is None and theirs.rngs is None
    same_state(ours, theirs)


def test_mha_metadata_reaches_the_projections_as_flax_nnx():
    tagged = {"kernel_metadata": {"role": "qkv"}, "out_kernel_metadata": {"role": "out"},
              "bias_metadata": {"role": "bias"}}
    ours, theirs = both(**tagged)
    for name in ("query", "value", "out"):
        layer, layer_f = getattr(ours, name), getattr(theirs, name)
        assert layer.kernel.role == layer_f.kernel.role and layer.bias.role == layer_f.bias.role


@pytest.mark.parametrize("kwargs, fix", [
    ({"num_heads": 3, "num_kv_heads": 2, "qkv_features": 6}, "num_kv_heads"),
    ({"num_heads": 3}, "qkv_features"),
])
def test_mha_bad_head_counts_are_value_errors_naming_the_argument(kwargs, fix):
    with pytest.raises(ValueError):
        standard(flax_nnx.MultiHeadAttention, in_features=F, **kwargs, rngs=flax_nnx.Rngs(0))
    with pytest.raises(errors.ConfigError, match=fix) as info:
        MultiHeadAttention(in_features=F, **kwargs, rngs=nnx.Rngs(0))
    assert info.value.path == (fix,) and "test_nnx_layers_attention.py" in info.value.source


# -- outputs ------------------------------------------------------------------------------

def test_mha_self_attention_outputs_match_flax_nnx(plain):
    ours, theirs = plain
    close(ours(X), standard(theirs, X))
    close(ours(X, X), ours(X))


def test_mha_outputs_with_padding_and_causal_masks_match_flax_nnx(plain):
    ours, theirs = plain
    padding = A.make_attention_mask(jnp.array([[1, 1, 0], [1, 1, 1]]),
                                    jnp.array([[1, 1, 0], [1, 1, 1]]))
    mask = A.combine_masks(padding, A.make_causal_mask(X[..., 0]))
    close(ours(X, mask=mask), standard(theirs, X, mask=mask))
    close(ours(X, is_causal=True), standard(theirs, X, is_causal=True))
    close(ours(X, mask=padding, is_causal=True), standard(theirs, X, mask=padding, is_causal=True))


def test_mha_grouped_cross_attention_outputs_match_flax_nnx(grouped):
    ours, theirs = grouped
    close(*call_both(ours, theirs, X, KV, KV[..., ::-1]))


def test_mha_sow_weights_keeps_flax_nnx_attention_weights(plain):
    ours, theirs = plain
    out, sown = nnx.capture(ours, nnx.Intermediate)(X, sow_weights=True)
    out_f, sown_f = standard(flax_nnx.capture(theirs, flax_nnx.Intermediate), X,
                             sow_weights=True)
    close(out, out_f)
    (weights,), (weights_f,) = sown["attention_weights"], sown_f["attention_weights"]
    assert weights.shape == (B, 2, L, L)
    close(weights, weights_f)


def test_mha_float16_computation_matches_flax_nnx():
    ours, theirs = both(dtype=jnp.float16, param_dtype=jnp.float16)
    same_state(ours, theirs)
    # eager: under jit, XLA:CPU refuses jax.nn.dot_product_attention's float16 dot algorithm
    # (F16_F16_F32), for flax.nnx too
    x = X.astype(jnp.float16)
    out = ours(x)
    assert out.dtype == jnp.float16
    np.testing.assert_array_equal(out, standard(theirs, x))


# -- dropout ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dropping():
    """Masks drawn per batch element and head (flax's broadcast masks are tested with the
    functions below)."""
    return both(seed=7, dropout_rate=0.5, broadcast_dropout=False)


def test_mha_dropout_masks_match_flax_nnx_from_the_forked_stream(dropping):
    ours, theirs = dropping
    for _ in range(2):   # each call draws the stream's next key
        close(ours(X, deterministic=False), standard(theirs, X, deterministic=False))
    close(ours(X, deterministic=False, rngs=nnx.Rngs(dropout=9)),
          standard(theirs, X, deterministic=False, rngs=flax_nnx.Rngs(dropout=9)))
    same_state(ours, theirs)


def test_mha_deterministic_dropout_is_the_plain_output(dropping):
    ours, theirs = dropping
    close(ours(X, deterministic=True), standard(theirs, X, deterministic=True))
    no_dropout = MultiHeadAttention(2, F, decode=False, rngs=nnx.Rngs(7))
    close(ours(X, deterministic=True), no_dropout(X))


def test_mha_dropout_without_a_mode_or_rngs_is_a_value_error_naming_it(dropping):
    ours, _ = dropping
    with pytest.raises(errors.ConfigError, match="deterministic"):
        ours(X)
    keepless = MultiHeadAttention(2, F, decode=False, dropout_rate=0.5, keep_rngs=False,
                                  rngs=nnx.Rngs(0))
    with pytest.raises(errors.ConfigError, match="keep_rngs") as info:
        keepless(X, deterministic=False)
    assert info.value.path == ("rngs",)


# -- decode cache -------------------------------------------------------------------------

def test_mha_decode_over_three_steps_equals_the_full_causal_pass_as_flax_nnx():
    ours, theirs = both(seed=2, decode=True)
    ours.init_cache(X.shape)
    theirs.init_cache(X.shape)
    same_state(ours, theirs)   # cached_key, cached_value, cache_index: nnx.Cache
    assert type(ours.cached_key) is nnx.Cache
    steps = [ours(X[:, i:i + 1]) for i in range(L)]
    steps_f = [standard(theirs, X[:, i:i + 1]) for i in range(L)]
    for step, step_f in zip(steps, steps_f):
        close(step, step_f)
    same_state(ours, theirs)   # the caches written and the index at 3, as flax's
    assert int(ours.cache_index[...]) == L
    full = ours(X, decode=False, mask=A.make_causal_mask(X[..., 0]))
    close(jnp.concatenate(steps, axis=1), full)


def test_mha_decode_errors_name_the_cache_and_the_users_line():
    ours, theirs = both(decode=True)
    with pytest.raises(ValueError, match="init_cache"):
        standard(theirs, X[:, :1])
    with pytest.raises(errors.ConfigError, match="init_cache") as info:
        ours(X[:, :1])
    assert info.value.path == ("cached_key",)
    ours.init_cache(X.shape)
    with pytest.raises(errors.ConfigError, match="one position") as info:
        ours(X)
    assert info.value.collection == "cache"
    assert "test_nnx_layers_attention.py" in info.value.source


def test_mha_decode_step_under_nnx_jit_writes_the_cache_back():
    ours, theirs = both(seed=4, decode=True)
    ours.init_cache(X.shape)
    theirs.init_cache(X.shape)
    step = nnx.jit(lambda m, x: m(x))
    for i in range(2):
        close(step(ours, X[:, i:i + 1]), standard(theirs, X[:, i:i + 1]))
    assert int(ours.cache_index[...]) == 2
    same_state(ours, theirs)


def test_mha_view_sets_decode_and_deterministic_as_flax_nnx(dropping):
    ours, theirs = dropping
    view = nnx.view(ours, decode=True, deterministic=True)
    view_f = flax_nnx.view(theirs, decode=True, deterministic=True)
    assert (view.decode, view.deterministic) == (view_f.decode, view_f.deterministic)
    assert ours.decode is False and view.query.kernel is ours.query.kernel
    assert view.cached_key is None and view_f.cached_key is None   # init_cache makes it
    assert nnx.view_info(ours) == flax_nnx.view_info(theirs)


# -- transforms ---------------------------------------------------------------------------

def test_mha_gradient_under_nnx_grad_matches_flax_nnx(plain):
    ours, theirs = plain
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(X) ** 2)))(ours)
    grads_f = standard(flax_nnx.jit(flax_nnx.grad(lambda m: jnp.sum(m(X) ** 2))), theirs)
    for (path, g), (_, g_f) in zip(nnx.to_flat_state(grads), flax_nnx.to_flat_state(grads_f)):
        # the key's bias has no gradient (a shift of every score): both are rounding noise
        np.testing.assert_allclose(g[...], g_f[...], rtol=1e-5, atol=1e-5, err_msg=str(path))


def test_mha_under_nnx_vmap_over_the_batch_matches_the_batched_call(plain):
    ours, _ = plain
    mapped = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(ours, X)
    close(mapped, ours(X))


# -- functions ----------------------------------------------------------------------------

Q = jax.random.normal(jax.random.key(3), (B, L, 4, 2))
K = jax.random.normal(jax.random.key(4), (B, L, 2, 2))
V = jax.random.normal(jax.random.key(5), (B, L, 2, 2))   # fused attention: v depth = q depth


def test_masks_match_flax_nnx():
    a, b = jnp.array([[1, 0, 1]]), jnp.array([[1, 1, 0, 1]])
    for ours, theirs in (
        (A.make_attention_mask(a, b, extra_batch_dims=1),
         flax_nnx.make_attention_mask(a, b, extra_batch_dims=1)),
        (A.make_causal_mask(b, dtype=jnp.bool_), flax_nnx.make_causal_mask(b, dtype=jnp.bool_)),
        (A.combine_masks(None, A.make_causal_mask(a), A.make_attention_mask(a, a)),
         flax_nnx.combine_masks(None, flax_nnx.make_causal_mask(a),
                                flax_nnx.make_attention_mask(a, a))),
    ):
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(ours, theirs)
    assert A.combine_masks(None, None) is None


def test_grouped_dot_product_attention_matches_flax_nnx_fused_and_explicit(plain):
    mask = jnp.broadcast_to(jnp.arange(L) < 2, (B, 1, L, L))
    close(jitted(A.dot_product_attention, is_causal=True)(Q, K, V, None, mask),
          standard(jitted(flax_nnx.dot_product_attention, is_causal=True), Q, K, V, None, mask))
    # with a module to sow into, the weights are computed and mixed explicitly
    ours, theirs = plain
    out, sown = nnx.capture(lambda m: A.dot_product_attention(Q, K, V, mask=mask, module=m),
                            nnx.Intermediate)(ours)
    out_f, sown_f = standard(flax_nnx.capture(
        lambda m: flax_nnx.dot_product_attention(Q, K, V, mask=mask, module=m),
        flax_nnx.Intermediate), theirs)
    close(out, out_f)
    close(sown["attention_weights"][0], sown_f["attention_weights"][0])


def test_dot_product_attention_over_two_batch_axes_matches_flax_nnx():
    q, k, v = (x.reshape(1, *x.shape) for x in (Q, K, V))
    close(A.dot_product_attention(q, k, v), standard(flax_nnx.dot_product_attention, q, k, v))


def test_attention_weights_broadcast_dropout_matches_flax_nnx_bitwise():
    options = dict(dropout_rng=jax.random.key(0), dropout_rate=0.4, is_causal=True)
    np.testing.assert_array_equal(
        A.dot_product_attention_weights(Q, K, **options),
        standard(flax_attention.dot_product_attention_weights, Q, K, **options))
    close(A.dot_product_attention(Q, K, V, **options),
          standard(flax_nnx.dot_product_attention, Q, K, V, **options))


@pytest.mark.parametrize("q, k, v, match", [
    (Q, K[0], V[0], "same rank"),
    (Q, K[:1], V[:1], "batch dims"),
    (Q, K, V[:, :2], "lengths must match"),
    (Q, K[..., :1], V, "depths must match"),
    (Q[..., :3, :], K, V, "must be multiple of"),
])
def test_bad_attention_shapes_are_value_errors_with_flax_nnx_wording(q, k, v, match):
    with pytest.raises(ValueError, match=match):
        standard(flax_nnx.dot_product_attention, q, k, v, dropout_rate=0.1,
                 dropout_rng=jax.random.key(0))
    with pytest.raises(errors.ConfigError, match=match) as info:
        standard(A.dot_product_attention, q, k, v, dropout_rate=0.1,
                 dropout_rng=jax.random.key(0))
    assert "test_nnx_layers_attention.py" in info.value.source


def test_mha_bad_inputs_are_value_errors_naming_the_argument(plain):
    ours, theirs = plain
    for call in (lambda m: m(X, inputs_v=X), lambda m: m(KV)):
        with pytest.raises(ValueError):
            standard(call, theirs)
    with pytest.raises(errors.ConfigError, match="inputs_k") as info:
        ours(X, inputs_v=X)
    assert info.value.path == ("inputs_k",)
    with pytest.raises(errors.ConfigError, match="in_features=4") as info:
        ours(KV)
    assert "test_nnx_layers_attention.py" in info.value.source


def test_mha_without_a_decode_mode_is_a_value_error_naming_decode():
    ours = MultiHeadAttention(2, F, rngs=nnx.Rngs(0))
    theirs = standard(flax_nnx.MultiHeadAttention, 2, F, rngs=flax_nnx.Rngs(0))
    with pytest.raises(ValueError, match="decode"):
        standard(theirs, X)
    with pytest.raises(errors.ConfigError, match="decode") as info:
        ours(X)
    assert info.value.path == ("decode",)
    close(ours(X, decode=False), standard(theirs, X, decode=False))


def test_mha_sharding_call_arguments_are_not_provided_naming_the_argument(plain):
    ours, _ = plain
    for option in ("out_sharding", "qkv_sharding"):
        with pytest.raises(errors.NotProvidedError, match=rf"\(\.\.\., {option}=") as info:
            ours(X, **{option: ("data",)})
        assert f"leave {option}=None" in str(info.value)


def test_mha_grouped_decode_step_caches_the_kv_heads_as_flax_nnx(grouped):
    ours, theirs = grouped
    for layer in grouped:
        layer.init_cache(KV.shape)
    assert ours.cached_key.shape == (B, 5, 2, 2)
    x, kv = X[:, :1], KV[:, :1]
    close(ours(x, kv, decode=True), standard(theirs, x, kv, decode=True))
    same_state(ours, theirs)
    for layer in grouped:   # the module-scoped fixture goes back to no cache
        layer.cached_key = layer.cached_value = layer.cache_index = None
