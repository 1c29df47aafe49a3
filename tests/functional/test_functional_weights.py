"""``varjax.functional``'s einsum map, weight and spectral normalization and ``prelu``."""
import jax
import jax.numpy as jnp
import numpy as np

from varjax import functional as F

W = jax.random.normal(jax.random.key(0), (3, 4))


def test_einsum_adds_a_bias_over_the_kernel_axes_of_the_output():
    x = jnp.ones((2, 3))
    assert F.einsum_bias_shape("ab,bc->ac", 2, (3, 4)) == (4,)
    bias = jnp.arange(4.0)
    np.testing.assert_allclose(F.einsum("ab,bc->ac", x, W, bias), x @ W + bias.reshape(1, 4), rtol=1e-6)
    assert F.einsum_bias_shape("...b,bc->...c", 3, (3, 4)) == (4,)


def test_weight_norm_gives_unit_columns_times_the_scale():
    y = F.weight_norm(W, jnp.full(4, 2.0), feature_axes=(1,))
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=0), jnp.full(4, 2.0), rtol=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(F.weight_norm(W)), 1.0, rtol=1e-5)


def test_spectral_norm_divides_by_the_largest_singular_value():
    u = jax.random.normal(jax.random.key(1), (1, 4))
    y, u, sigma = F.spectral_norm(W, u, n_steps=50)
    np.testing.assert_allclose(sigma, jnp.linalg.svd(W, compute_uv=False)[0], rtol=1e-4)
    np.testing.assert_allclose(y, W / sigma, rtol=1e-6)
    assert u.shape == (1, 4)


def test_prelu_scales_the_negative_part_in_the_input_dtype():
    x = jnp.array([-2.0, 3.0], jnp.bfloat16)
    y = F.prelu(x, jnp.asarray(0.5, jnp.float32))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(y, jnp.array([-1.0, 3.0], jnp.bfloat16))
