"""Attention: parity with flax.linen.attention, the decode cache, dropout, errors."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import assert_close, check_parity, layout

from varjax import errors
from varjax.nn import attention as vj_attn

B, L, F = 2, 3, 4


def _x(seed=1, shape=(B, L, F)):
    # NumPy draws: no XLA compile per input shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _pair(cls="MultiHeadDotProductAttention", **kw):
    kw = {"num_heads": 2, "qkv_features": 4, **kw}
    return getattr(vj_attn, cls)(**kw), getattr(flax_nn, cls)(**kw)


def test_self_attention_matches_flax():
    check_parity(*_pair(), _x())


def test_cross_attention_with_separate_key_and_value_matches_flax():
    check_parity(*_pair(out_features=5), _x(1), _x(2, (B, 5, F)), _x(3, (B, 5, F)))


def test_inputs_kv_matches_flax():
    q, kv = _x(1), _x(2, (B, 5, F))
    check_parity(*_pair(), q, init_kwargs={"inputs_kv": kv}, apply_kwargs={"inputs_kv": kv})


def test_padding_mask_matches_flax():
    valid = jnp.array([[1, 1, 0], [1, 0, 0]])
    mask = vj_attn.make_attention_mask(valid, valid)
    np.testing.assert_array_equal(mask, flax_nn.make_attention_mask(valid, valid))
    check_parity(*_pair(), _x(), init_kwargs={"mask": mask}, apply_kwargs={"mask": mask})


def test_causal_mask_matches_flax():
    mask = vj_attn.make_causal_mask(jnp.ones((B, L)))
    np.testing.assert_array_equal(mask, flax_nn.make_causal_mask(jnp.ones((B, L))))
    check_parity(*_pair(), _x(), init_kwargs={"mask": mask}, apply_kwargs={"mask": mask})


def test_combine_masks_ands_given_masks_and_skips_none():
    a = jnp.array([[1.0, 0.0, 1.0]])
    b = jnp.array([[1.0, 1.0, 0.0]])
    np.testing.assert_array_equal(vj_attn.combine_masks(a, None, b), flax_nn.combine_masks(a, None, b))
    assert vj_attn.combine_masks(None, None) is None


def test_optional_fields_match_flax():
    def einsum_cls():
        return jnp.einsum

    layers = _pair(use_bias=False, normalize_qk=True, out_kernel_init=jax.nn.initializers.normal(0.5),
                   qk_attn_weights_einsum_cls=einsum_cls, attn_weights_value_einsum_cls=einsum_cls)
    check_parity(*layers, _x())


def test_bfloat16_compute_dtype_matches_flax():
    check_parity(*_pair(dtype=jnp.bfloat16), _x(), atol=2e-2)


def test_fp32_softmax_under_bfloat16_matches_flax_and_needs_no_implicit_promotion():
    vj_layer, flax_layer = _pair(dtype=jnp.bfloat16, force_fp32_for_softmax=True)
    x = _x()
    variables = vj_layer.init(jax.random.key(0), x)
    out = vj_layer.apply(variables, x)                   # strict promotion (conftest)
    with jax.numpy_dtype_promotion("standard"):          # Linen mixes float32 and bfloat16 implicitly
        expected = flax_layer.apply(variables, x)
    assert out.dtype == expected.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=2e-2)


def test_multi_head_attention_alias_is_auto_named_like_linen():
    class Net(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            return flax_nn.MultiHeadAttention(num_heads=2)(x)

    import varjax.nn.module as vj_module

    class VjNet(vj_module.Module):
        @vj_module.compact
        def __call__(self, x):
            return vj_attn.MultiHeadAttention(num_heads=2)(x)

    variables, _, _ = check_parity(VjNet(), Net(), _x())
    assert list(variables["params"]) == ["MultiHeadAttention_0"]


def test_self_attention_layer_matches_flax():
    mask = vj_attn.make_causal_mask(jnp.ones((B, L)))
    with pytest.warns(DeprecationWarning):   # Linen's SelfAttention warns; varjax's does not
        check_parity(*_pair("SelfAttention"), _x(), init_kwargs={"mask": mask}, apply_kwargs={"mask": mask})


def test_sow_weights_matches_flax():
    _, (out, sown), _ = check_parity(*_pair(), _x(), mutable=["intermediates"],
                                     apply_kwargs={"sow_weights": True})
    assert sown["intermediates"]["attention_weights"][0].shape == (B, 2, L, L)


def test_decode_step_by_step_matches_flax_outputs_and_cache():
    vj_layer, flax_layer = _pair(decode=True)
    x = _x(1, (B, L, F))
    flax_vars = flax_layer.init(jax.random.key(0), x)
    vj_vars = vj_layer.init(jax.random.key(0), x)
    assert layout(vj_vars) == layout(flax_vars)
    assert set(vj_vars["cache"]) == {"cached_key", "cached_value", "cache_index"}
    params = jax.tree.map(lambda p: p + 0.1, flax_vars["params"])
    vj_cache = flax_cache = flax_vars["cache"]
    for t in range(L):
        token = x[:, t:t + 1]
        vj_out, vj_upd = vj_layer.apply({"params": params, "cache": vj_cache}, token, mutable=["cache"])
        fx_out, fx_upd = flax_layer.apply({"params": params, "cache": flax_cache}, token, mutable=["cache"])
        assert_close(vj_out, fx_out, 1e-5)
        assert_close(vj_upd, fx_upd, 1e-5)
        vj_cache, flax_cache = vj_upd["cache"], fx_upd["cache"]
    assert int(vj_cache["cache_index"]) == L


def test_decode_steps_equal_full_causal_attention():
    vj_layer, _ = _pair(decode=True)
    full, _ = _pair()
    x = _x()
    variables = vj_layer.init(jax.random.key(0), x)
    expected = full.apply({"params": variables["params"]}, x, mask=vj_attn.make_causal_mask(x[..., 0]))
    cache = variables["cache"]
    for t in range(L):
        out, upd = vj_layer.apply({"params": variables["params"], "cache": cache}, x[:, t:t + 1],
                                  mutable=["cache"])
        np.testing.assert_allclose(out[:, 0], expected[:, t], atol=1e-5)
        cache = upd["cache"]


def test_decode_without_cache_raises_missing_variable():
    vj_layer, _ = _pair(decode=True)
    params = vj_layer.init(jax.random.key(0), _x())["params"]
    with pytest.raises(errors.MissingVariableError, match="cache"):
        vj_layer.apply({"params": params}, _x()[:, :1])


def test_decode_with_immutable_cache_raises_immutable_collection():
    vj_layer, _ = _pair(decode=True)
    variables = vj_layer.init(jax.random.key(0), _x())
    with pytest.raises(errors.ImmutableCollectionError, match="mutable=\\['cache'\\]"):
        vj_layer.apply(variables, _x()[:, :1])


def test_decode_with_more_than_one_token_raises_shape_error():
    vj_layer, _ = _pair(decode=True)
    variables = vj_layer.init(jax.random.key(0), _x())
    with pytest.raises(errors.VariableShapeError, match="one position"):
        vj_layer.apply(variables, _x()[:, :2], mutable=["cache"])


def test_deterministic_dropout_matches_flax_exactly():
    check_parity(*_pair(dropout_rate=0.5, deterministic=True), _x())
    check_parity(*_pair(dropout_rate=0.5), _x(), apply_kwargs={"deterministic": True},
                 init_kwargs={"deterministic": True})


def test_dropout_drops_weights_reproducibly_and_varies_with_the_key():
    layer, _ = _pair(dropout_rate=0.5, deterministic=False)
    x = _x()
    variables = layer.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    clean = _pair(dropout_rate=0.0)[0].apply(variables, x)
    a = layer.apply(variables, x, rngs={"dropout": jax.random.key(2)})
    b = layer.apply(variables, x, rngs={"dropout": jax.random.key(2)})
    c = layer.apply(variables, x, rngs={"dropout": jax.random.key(3)})
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    assert not np.allclose(a, clean)


def test_dropout_rng_argument_overrides_the_stream():
    layer, _ = _pair(dropout_rate=0.5, deterministic=False)
    x = _x()
    variables = layer.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    key = jax.random.key(7)
    a = layer.apply(variables, x, dropout_rng=key, rngs={"dropout": jax.random.key(2)})
    b = layer.apply(variables, x, dropout_rng=key, rngs={"dropout": jax.random.key(3)})
    np.testing.assert_array_equal(a, b)


def test_dropout_weights_have_flax_keep_rate_and_scale():
    q = k = _x(1, (1, 64, 1, 8))
    weights = vj_attn.dot_product_attention_weights(q, k, dropout_rng=jax.random.key(0), dropout_rate=0.25,
                                                    broadcast_dropout=False)
    clean = vj_attn.dot_product_attention_weights(q, k)
    kept = np.asarray(weights) != 0
    assert 0.65 < kept.mean() < 0.85
    np.testing.assert_allclose(np.asarray(weights)[kept], np.asarray(clean / 0.75)[kept], rtol=1e-5)


def test_deterministic_given_twice_raises():
    layer, _ = _pair(dropout_rate=0.5, deterministic=True)
    with pytest.raises(errors.ConfigError, match="deterministic"):
        layer.init(jax.random.key(0), _x(), deterministic=True)


def test_deterministic_missing_with_dropout_raises():
    layer, _ = _pair(dropout_rate=0.5)
    with pytest.raises(errors.ConfigError, match="deterministic"):
        layer.init(jax.random.key(0), _x())


def test_functions_match_flax():
    q, k, v = _x(1, (B, L, 2, 2)), _x(2, (B, 5, 2, 2)), _x(3, (B, 5, 2, 3))
    bias = _x(4, (B, 2, L, 5))
    mask = _x(5, (B, 1, L, 5)) > 0
    cases = [("dot_product_attention_weights", (q, k, bias, mask)),
             ("dot_product_attention", (q, k, v, bias, mask))]
    for fn, args in cases:
        np.testing.assert_allclose(jax.jit(getattr(vj_attn, fn))(*args), jax.jit(getattr(flax_nn, fn))(*args),
                                   atol=1e-6)


def test_custom_attention_fn_gets_only_the_keywords_it_declares():
    seen = {}

    def attention_fn(query, key, value, mask=None):
        seen["mask"] = mask
        return vj_attn.dot_product_attention(query, key, value, mask=mask)

    layer, _ = _pair(attention_fn=attention_fn)
    layer.init(jax.random.key(0), _x())
    assert "mask" in seen


@pytest.mark.parametrize("kwargs, match", [
    ({"inputs_kv": _x(), "inputs_k": _x()}, "inputs_kv"),
    ({"inputs_v": _x()}, "inputs_v needs inputs_k"),
])
def test_conflicting_key_value_inputs_raise(kwargs, match):
    layer, _ = _pair()
    with pytest.raises(ValueError, match=match):
        layer.init(jax.random.key(0), _x(), **kwargs)


def test_heads_not_dividing_features_raises():
    layer, _ = _pair(num_heads=3)
    with pytest.raises(ValueError, match="divisible"):
        layer.init(jax.random.key(0), _x())


ein = jnp.einsum


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: vj_attn.dot_product_attention_weights(q, k, precision="highest", einsum=jnp.einsum),
     "mutually exclusive"),
    (lambda q, k, v: vj_attn.dot_product_attention(q, k, v, qk_attn_weights_einsum=jnp.einsum), "together"),
    (lambda q, k, v: vj_attn.dot_product_attention(q, k, v, precision="highest", qk_attn_weights_einsum=ein,
                                                   attn_weights_value_einsum=ein), "mutually exclusive"),
    (lambda q, k, v: vj_attn.dot_product_attention_weights(q, k[..., :1]), "must agree"),
    (lambda q, k, v: vj_attn.dot_product_attention(q, k, v[:, :2]), "must agree"),
    (lambda q, k, v: vj_attn.combine_masks(q, k[0]), "same rank"),
])
def test_attention_function_argument_errors(call, match):
    x = _x(1, (B, L, 2, 2))
    with pytest.raises(ValueError, match=match):
        call(x, x, x)
