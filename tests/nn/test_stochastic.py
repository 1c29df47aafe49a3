"""Dropout: behaviour and statistics (masks differ from Linen's: keys are derived differently)."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import check_parity

from varjax import errors
from varjax.nn.module import Module, compact
from varjax.nn.stochastic import Dropout

X = jnp.ones((4, 500), jnp.float32)
RNGS = {"dropout": jax.random.key(3)}


def _apply(layer, x=X, rngs=RNGS, **kwargs):
    return layer.apply({}, x, rngs=rngs, **kwargs)


def test_dropout_deterministic_is_identity_and_has_no_variables():
    check_parity(Dropout(0.5), flax_nn.Dropout(0.5), X, init_kwargs={"deterministic": True},
                 apply_kwargs={"deterministic": True})
    np.testing.assert_array_equal(_apply(Dropout(0.5, deterministic=True), rngs=None), X)


def test_dropout_rate_zero_is_identity_without_an_rng():
    np.testing.assert_array_equal(_apply(Dropout(0.0), rngs=None, deterministic=False), X)


def test_dropout_rate_one_gives_zeros():
    np.testing.assert_array_equal(_apply(Dropout(1.0), deterministic=False), jnp.zeros_like(X))


def test_dropout_keeps_about_one_minus_rate_and_rescales_kept_values():
    y = _apply(Dropout(0.3), deterministic=False)
    kept = y != 0
    assert abs(float(kept.mean()) - 0.7) < 0.03
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)
    assert abs(float(y.mean()) - 1.0) < 0.05  # unbiased


def test_dropout_same_key_gives_same_mask_and_other_key_another():
    a = _apply(Dropout(0.5), deterministic=False)
    b = _apply(Dropout(0.5), deterministic=False)
    c = _apply(Dropout(0.5), rngs={"dropout": jax.random.key(4)}, deterministic=False)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_dropout_broadcast_dims_share_the_mask_along_those_axes():
    x = jnp.ones((3, 50, 4))
    y = _apply(Dropout(0.5, broadcast_dims=(1,)), x, deterministic=False)
    np.testing.assert_array_equal(y, jnp.broadcast_to(y[:, :1], x.shape))
    y = _apply(Dropout(0.5, broadcast_dims=(0, -1)), x, deterministic=False)
    np.testing.assert_array_equal(y, jnp.broadcast_to(y[:1, :, :1], x.shape))
    assert 0 < float((y[0, :, 0] == 0).mean()) < 1


def test_dropout_explicit_rng_argument_needs_no_stream():
    key = jax.random.key(5)
    a = Dropout(0.5).apply({}, X, deterministic=False, rng=key)
    b = Dropout(0.5).apply({}, X, deterministic=False, rng=key)
    np.testing.assert_array_equal(a, b)
    assert 0 < float((a == 0).mean()) < 1


def test_dropout_custom_rng_collection():
    noise = {"noise": jax.random.key(1)}
    y = Dropout(0.5, rng_collection="noise").apply({}, X, deterministic=False, rngs=noise)
    assert 0 < float((y == 0).mean()) < 1


def test_two_dropout_layers_draw_different_masks():
    class Twice(Module):
        @compact
        def __call__(self, x):
            return Dropout(0.5)(x, deterministic=False), Dropout(0.5)(x, deterministic=False)

    a, b = Twice().apply({}, X, rngs=RNGS)
    assert not np.array_equal(a, b)


def test_dropout_without_dropout_rng_raises_missing_rng():
    with pytest.raises(errors.MissingRngError, match="dropout"):
        _apply(Dropout(0.5), rngs=None, deterministic=False)


def test_dropout_deterministic_given_twice_is_an_error():
    with pytest.raises(errors.ConfigError, match="'deterministic' was given both"):
        _apply(Dropout(0.5, deterministic=True), deterministic=True)


def test_dropout_deterministic_given_nowhere_is_an_error():
    with pytest.raises(errors.ConfigError, match="'deterministic' was given neither"):
        _apply(Dropout(0.5))
