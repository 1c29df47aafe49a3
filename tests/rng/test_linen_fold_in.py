"""``linen_fold_in``: a Linen draw inside a lifted body, kept symbolic in the IR.  Every
JAX transformation must treat it as the ``fold_in`` of a constant it stands for."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from varjax.ir import streams

PARAMS = {"stream": "params", "path": ("Dense_0",), "count": 2}
DATA = streams.linen_data(("Dense_0", 2))


def fold(key):
    return streams.linen_fold_in_p.bind(key, **PARAMS)


def want(key):
    return jax.random.fold_in(key, DATA)


def _data(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


@pytest.mark.parametrize("make", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw"])
def test_linen_fold_in_is_fold_in_of_its_constant_eagerly_jitted_and_batched(make):
    key = make(3)
    keys = jax.vmap(make)(jnp.arange(3))
    np.testing.assert_array_equal(_data(fold(key)), _data(want(key)))
    np.testing.assert_array_equal(_data(jax.jit(fold)(key)), _data(want(key)))
    np.testing.assert_array_equal(_data(jax.vmap(fold)(keys)), _data(jax.vmap(want)(keys)))
    if make is jax.random.PRNGKey:   # raw keys batched along their last-but-one axis
        moved = jnp.moveaxis(keys, 0, 1)
        np.testing.assert_array_equal(_data(jax.vmap(fold, in_axes=1)(moved)),
                                      _data(jax.vmap(want)(keys)))


def test_linen_fold_in_under_grad_is_a_constant_of_differentiation():
    def loss(x, key):
        return (x * jax.random.normal(fold(key), (2,))).sum()
    key = jax.random.key(0)
    x = jnp.ones(2)
    np.testing.assert_allclose(jax.grad(loss)(x, key), jax.random.normal(want(key), (2,)))
    np.testing.assert_allclose(jax.grad(jax.checkpoint(loss))(x, key),
                               jax.random.normal(want(key), (2,)))
