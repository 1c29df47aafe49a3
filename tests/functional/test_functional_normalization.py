"""``varjax.functional.normalization`` against the textbook formulas in ``jnp``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from varjax import functional as F

X = jax.random.normal(jax.random.key(0), (2, 3, 4))


def test_moments_are_mean_and_population_variance_in_either_variance_form():
    for fast in (True, False):
        mean, var = F.moments(X, (1, 2), use_fast_variance=fast)
        np.testing.assert_allclose(mean, X.mean((1, 2)), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(var, X.var((1, 2)), rtol=1e-5, atol=1e-6)


def test_moments_without_mean_give_the_mean_square_and_a_mask_excludes_entries():
    mean, var = F.moments(X, -1, use_mean=False)
    np.testing.assert_array_equal(mean, jnp.zeros((2, 3)))
    np.testing.assert_allclose(var, (X * X).mean(-1), rtol=1e-6)
    mask = jnp.arange(4) < 2
    mean, _ = F.moments(X, -1, mask=jnp.broadcast_to(mask, X.shape))
    np.testing.assert_allclose(mean, X[..., :2].mean(-1), rtol=1e-6)


def test_moments_reduce_in_float32_for_low_precision_inputs():
    mean, var = F.moments(X.astype(jnp.bfloat16), -1)
    assert mean.dtype == var.dtype == jnp.float32


def test_group_moments_are_per_group_statistics_repeated_per_feature():
    mean, var = F.group_moments(X, 2, (1, 2))
    grouped = X.reshape(2, 3, 2, 2)
    np.testing.assert_allclose(mean, jnp.repeat(grouped.mean((1, 3)), 2, axis=-1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(var, jnp.repeat(grouped.var((1, 3)), 2, axis=-1), rtol=1e-5, atol=1e-6)


def test_group_count_takes_exactly_one_of_num_groups_and_group_size():
    assert F.group_count(8, None, 2) == 4 and F.group_count(8, 4, None) == 4
    with pytest.raises(ValueError, match="exactly one"):
        F.group_count(8, 4, 2)
    with pytest.raises(ValueError, match="does not divide"):
        F.group_count(8, 3, None)


def test_normalize_is_centred_scaled_shifted():
    mean, var = F.moments(X, -1)
    scale, bias = jnp.arange(4.0), jnp.ones(4)
    y = F.normalize(X, mean, var, scale, bias, reduction_axes=-1, feature_axes=-1, epsilon=1e-6)
    normed = (X - X.mean(-1, keepdims=True)) / jnp.sqrt(X.var(-1, keepdims=True) + 1e-6)
    want = normed * scale.reshape(1, 1, 4) + bias.reshape(1, 1, 4)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert F.feature_shape(X.shape, -1) == (4,)


def test_normalize_casts_to_the_given_dtype():
    mean, var = F.moments(X, -1)
    y = F.normalize(X, mean, var, reduction_axes=-1, feature_axes=-1, epsilon=1e-6, dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16


def test_ema_moves_by_one_minus_momentum_and_keeps_the_running_dtype():
    old, new = jnp.zeros(3, jnp.float32), jnp.ones(3, jnp.bfloat16)
    out = F.ema(old, new, 0.9)
    # (1 - 0.9) * new is a bfloat16 term, as in flax: 0.1 to bfloat16's precision.
    np.testing.assert_array_equal(out, jnp.full(3, 0.1, jnp.bfloat16).astype(jnp.float32))
    assert out.dtype == jnp.float32
