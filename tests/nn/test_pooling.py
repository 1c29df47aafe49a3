"""Pooling functions against flax.linen.pooling."""
import flax.linen.pooling as flax_pooling
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from varjax.nn.pooling import avg_pool, max_pool, min_pool, pool

OURS = {"max_pool": max_pool, "min_pool": min_pool, "avg_pool": avg_pool}
X = jax.random.normal(jax.random.key(0), (2, 5, 6, 3))

CASES = [
    {},
    {"strides": (2, 2)},
    {"padding": "SAME", "strides": (2, 3)},
    {"padding": ((1, 0), (0, 2))},
    {"padding": [[1, 1], [1, 1]]},
]


@pytest.mark.parametrize("kwargs", CASES)
@pytest.mark.parametrize("name", ["max_pool", "min_pool", "avg_pool"])
def test_pool_matches_linen(name, kwargs):
    got = OURS[name](X, (2, 3), **kwargs)
    with jax.numpy_dtype_promotion("standard"):  # Linen's avg_pool divides by a numpy int64
        want = getattr(flax_pooling, name)(X, (2, 3), **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("padding", ["SAME", ((1, 1), (2, 0))])
def test_avg_pool_count_include_pad_false_divides_by_real_entries(padding):
    got = avg_pool(X, (3, 3), padding=padding, count_include_pad=False)
    want = flax_pooling.avg_pool(X, (3, 3), padding=padding, count_include_pad=False)
    np.testing.assert_allclose(got, want, atol=1e-6)
    ones = avg_pool(jnp.ones_like(X), (3, 3), padding=padding, count_include_pad=False)
    np.testing.assert_allclose(ones, 1.0, atol=1e-6)
    assert float(avg_pool(jnp.ones_like(X), (3, 3), padding=padding).min()) < 1.0


def test_pool_unbatched_and_multi_batch_inputs():
    for f in (max_pool, avg_pool):
        np.testing.assert_allclose(f(X[0], (2, 2)), f(X, (2, 2))[0], atol=1e-6)
        np.testing.assert_allclose(f(X.reshape(1, 2, 5, 6, 3), (2, 2), padding="SAME")[0],
                                   f(X, (2, 2), padding="SAME"), atol=1e-6)
    np.testing.assert_allclose(max_pool(X[0], (2, 2), padding=((1, 0), (0, 1))),
                               flax_pooling.max_pool(X[0], (2, 2), padding=((1, 0), (0, 1))))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32])
def test_pool_dtypes_match_linen_under_strict_promotion(dtype):
    x = (X * 4).astype(dtype)
    for name in ("max_pool", "min_pool", "avg_pool"):
        got = OURS[name](x, (2, 2), padding="SAME")
        with jax.numpy_dtype_promotion("standard"):
            want = getattr(flax_pooling, name)(x, (2, 2), padding="SAME")
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_generic_pool_with_custom_reduction():
    summed = pool(X, 0.0, lax.add, (2, 3), None, "VALID")
    np.testing.assert_allclose(summed, avg_pool(X, (2, 3)) * 6, rtol=1e-5)


@pytest.mark.parametrize("args, match", [
    (((2, 2), (1,), "VALID"), "one entry per window axis"),
    (((2, 2), None, ((1, 1),)), "one \\(low, high\\) pair"),
    (((2, 2), None, ((1, 1, 1), (0, 0))), "one \\(low, high\\) pair"),
    (((2, 2, 2, 2), None, "VALID"), "too few axes"),
])
def test_pool_rejects_malformed_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        pool(X, 0.0, lax.add, *args)
