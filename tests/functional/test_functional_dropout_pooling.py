"""``varjax.functional``'s dropout and pooling against ``jax.random`` and ``lax.reduce_window``."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from varjax import functional as F

X = jnp.arange(1.0, 13.0).reshape(1, 4, 3)


def test_dropout_keeps_the_bernoulli_mask_of_the_key_and_rescales():
    key = jax.random.key(3)
    keep = jax.random.bernoulli(key, 0.75, X.shape)
    np.testing.assert_allclose(F.dropout(X, 0.25, key), jnp.where(keep, X / 0.75, 0.0), rtol=1e-6)


def test_dropout_broadcast_dims_share_one_mask_entry():
    y = F.dropout(jnp.ones((4, 6)), 0.5, jax.random.key(0), broadcast_dims=(0,))
    np.testing.assert_array_equal(y, jnp.broadcast_to(y[:1], (4, 6)))


def test_dropout_rate_zero_and_one_need_no_key():
    assert F.dropout(X, 0.0, None) is X
    np.testing.assert_array_equal(F.dropout(X, 1.0, None), jnp.zeros_like(X))


def test_pooling_slides_over_the_spatial_axes_only():
    want = lax.reduce_window(X, -jnp.inf, lax.max, (1, 2, 1), (1, 2, 1), "VALID")
    np.testing.assert_array_equal(F.max_pool(X, (2,), strides=(2,)), want)
    np.testing.assert_array_equal(F.min_pool(X, (2,), strides=(2,)),
                                  lax.reduce_window(X, jnp.inf, lax.min, (1, 2, 1), (1, 2, 1), "VALID"))
    np.testing.assert_allclose(F.avg_pool(X, (2,), strides=(2,)),
                               lax.reduce_window(X, 0.0, lax.add, (1, 2, 1), (1, 2, 1), "VALID") / 2)


def test_avg_pool_without_padding_in_the_count_divides_by_the_real_entries():
    y = F.avg_pool(X, (2,), padding=((1, 0),), count_include_pad=False)
    np.testing.assert_allclose(y[0, 0], X[0, 0])          # the first window holds one real entry
