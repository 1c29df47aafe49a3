"""``nnx.avg_pool``/``max_pool``/``min_pool``/``pool``: flax.nnx's outputs from the same inputs.

flax.nnx re-exports Linen's functions; varjax.nnx re-exports ``varjax.functional.pooling``'s,
the ones ``varjax.nn`` exports, so each case here also checks the shared implementation.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax import lax

import varjax.nn as vnn
from varjax.nnx import pooling

X = jax.random.normal(jax.random.key(0), (2, 5, 4, 3))


@pytest.fixture(autouse=True)
def default_promotion():
    # Flax's avg_pool divides a float32 by a NumPy integer, which strict promotion refuses.
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.mark.parametrize("name", ["avg_pool", "max_pool", "min_pool"])
@pytest.mark.parametrize("kwargs", [{}, {"strides": (2, 1), "padding": "SAME"},
                                    {"padding": ((1, 0), (0, 2))}])
def test_pooling_matches_flax_nnx(name, kwargs):
    got = getattr(pooling, name)(X, (2, 3), **kwargs)
    want = getattr(flax_nnx, name)(X, (2, 3), **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("padding", ["SAME", ((1, 1), (2, 0))])
def test_avg_pool_without_padding_in_the_count_matches_flax_nnx(padding):
    got = pooling.avg_pool(X, (3, 3), padding=padding, count_include_pad=False)
    want = flax_nnx.avg_pool(X, (3, 3), padding=padding, count_include_pad=False)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_unbatched_input_pools_as_flax_nnx():
    x = X[0]
    for name in ("avg_pool", "max_pool"):
        got = getattr(pooling, name)(x, (2, 2), padding="SAME")
        want = getattr(flax_nnx, name)(x, (2, 2), padding="SAME")
        assert got.shape == want.shape == (5, 4, 3)
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_pool_with_a_custom_reduction_matches_flax_nnx():
    got = pooling.pool(X, 1.0, lax.mul, (2, 2), (2, 2), "VALID")
    want = flax_nnx.pool(X, 1.0, lax.mul, (2, 2), (2, 2), "VALID")
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_nnx_and_linen_share_one_pooling_implementation():
    for name in pooling.__all__:
        assert getattr(pooling, name) is getattr(vnn, name)


def test_strides_of_another_length_than_the_window_are_named():
    with pytest.raises(ValueError, match=r"strides \(2,\) must have one entry per window axis"):
        pooling.max_pool(X, (2, 2), strides=(2,))


def test_pooling_under_jit_and_grad_matches_flax_nnx():
    f = jax.jit(jax.grad(lambda x: jnp.sum(pooling.avg_pool(x, (2, 2), padding="SAME") ** 2)))
    g = jax.grad(lambda x: jnp.sum(flax_nnx.avg_pool(x, (2, 2), padding="SAME") ** 2))
    np.testing.assert_allclose(f(X), g(X), rtol=1e-6)
