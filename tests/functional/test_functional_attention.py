"""``varjax.functional.attention`` against softmax attention written out in ``jnp``."""
import jax
import jax.numpy as jnp
import numpy as np

from varjax import functional as F

Q, K, V = (jax.random.normal(k, (1, 3, 2, 4)) for k in jax.random.split(jax.random.key(0), 3))


def _reference(q, k, v, mask=None):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q / jnp.sqrt(4.0), k)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits), v)


def test_attention_is_softmax_of_scaled_logits_and_a_causal_mask_hides_the_future():
    np.testing.assert_allclose(F.dot_product_attention(Q, K, V), _reference(Q, K, V), rtol=1e-5, atol=1e-6)
    mask = F.make_causal_mask(jnp.ones((1, 3)))
    assert mask.shape == (1, 1, 3, 3)
    np.testing.assert_allclose(F.dot_product_attention(Q, K, V, mask=mask), _reference(Q, K, V, mask),
                               rtol=1e-5, atol=1e-6)


def test_attention_records_the_weights_before_dropout():
    seen = []
    weights = F.dot_product_attention_weights(Q, K, dropout_rate=0.5, dropout_rng=jax.random.key(1),
                                              record=seen.append)
    assert seen[0].shape == weights.shape == (1, 2, 3, 3)
    np.testing.assert_allclose(seen[0].sum(-1), jnp.ones((1, 2, 3)), rtol=1e-6)
    kept = weights != 0
    np.testing.assert_allclose(weights[kept], 2 * seen[0][kept], rtol=1e-6)


def test_combine_masks_ands_the_given_masks():
    a, b = jnp.array([[True, False]]), jnp.array([[True, True]])
    np.testing.assert_array_equal(F.combine_masks(a, None, b), jnp.array([[1.0, 0.0]]))
    assert F.combine_masks(None) is None


def test_decode_cache_update_writes_one_position_and_masks_the_unwritten():
    cache = jnp.zeros((1, 4, 2, 3))
    step = jnp.ones((1, 1, 2, 3))
    key, value, written = F.decode_cache_update(cache, cache, jnp.array(1, jnp.int32), step, 2 * step)
    np.testing.assert_array_equal(key[0, :, 0, 0], [0, 1, 0, 0])
    np.testing.assert_array_equal(value[0, :, 0, 0], [0, 2, 0, 0])
    np.testing.assert_array_equal(written[0, 0, 0], [True, True, False, False])
