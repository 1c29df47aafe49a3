"""``varjax.functional``'s dense maps, convolutions and embeddings against plain ``lax``/``jnp``.

Eager and tiny: each function is compared with the one ``lax`` call it stands for, so a
change to the shared math shows here before it shows in two frontends' parity tests.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from varjax import functional as F

KEYS = jax.random.split(jax.random.key(0), 4)


def _normal(i: int, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    return jax.random.normal(KEYS[i], shape, dtype)


def test_dense_is_a_dot_over_the_last_axis_plus_bias():
    x, kernel, bias = _normal(0, (2, 3, 4)), _normal(1, (4, 5)), _normal(2, (5,))
    dot = lax.dot_general(x, kernel, (((2,), (0,)), ((), ())))
    np.testing.assert_array_equal(F.dense(x, kernel, bias), dot + bias.reshape(1, 1, 5))
    np.testing.assert_array_equal(F.dense(x, kernel), dot)


def test_dense_computes_in_the_promoted_or_given_dtype():
    x, kernel = _normal(0, (2, 4), jnp.bfloat16), _normal(1, (4, 5))
    assert F.dense(x, kernel).dtype == jnp.float32
    assert F.dense(x, kernel, dtype=jnp.bfloat16).dtype == jnp.bfloat16


def test_dense_general_contracts_several_axes_with_a_kernel_per_batch_index():
    x, kernel, bias = _normal(0, (2, 3, 4, 5)), _normal(1, (2, 4, 5, 6)), _normal(2, (2, 6))
    axis, batch_dims = F.dense_general_axes(x.ndim, (-2, -1), (0,))
    assert (axis, batch_dims) == ((2, 3), (0,))
    want = jnp.einsum("bnij,bijf->bnf", x, kernel) + bias[:, None, :]
    np.testing.assert_allclose(F.dense_general(x, kernel, bias, axis=axis, batch_dims=batch_dims), want,
                               rtol=1e-6, atol=1e-6)


def test_dense_general_axes_refuses_batch_dims_that_are_not_leading():
    with pytest.raises(ValueError, match="consecutive leading"):
        F.dense_general_axes(3, -1, (1,))


def test_conv_folds_leading_batch_axes_and_adds_the_bias():
    x, kernel, bias = _normal(0, (2, 3, 6, 2)), _normal(1, (3, 2, 4)), _normal(2, (4,))
    y = F.conv(x, kernel, bias, padding="SAME")
    flat = lax.conv_general_dilated(x.reshape(6, 6, 2), kernel, (1,), "SAME",
                                    dimension_numbers=("NWC", "WIO", "NWC"))
    np.testing.assert_array_equal(y, (flat + bias.reshape(1, 1, 4)).reshape(2, 3, 6, 4))


@pytest.mark.parametrize("padding, mode", [("CIRCULAR", "wrap"), ("REFLECT", "reflect")])
def test_conv_pads_periodic_and_reflected_inputs_then_convolves_valid(padding, mode):
    x, kernel = _normal(0, (1, 5, 1)), _normal(1, (3, 1, 1))
    want = lax.conv_general_dilated(jnp.pad(x, [(0, 0), (1, 1), (0, 0)], mode=mode), kernel, (1,), "VALID",
                                    dimension_numbers=("NWC", "WIO", "NWC"))
    np.testing.assert_array_equal(F.conv(x, kernel, padding=padding), want)


def test_conv_causal_padding_lets_output_t_see_inputs_up_to_t():
    x, kernel = jnp.zeros((1, 5, 1)).at[0, 3, 0].set(1.0), jnp.ones((3, 1, 1))
    np.testing.assert_array_equal(F.conv(x, kernel, padding="CAUSAL")[0, :, 0], [0, 0, 0, 1, 1])


def test_conv_masks_the_kernel_and_refuses_a_mask_of_another_shape():
    x, kernel = _normal(0, (1, 4, 2)), _normal(1, (3, 2, 2))
    mask = jnp.zeros_like(kernel).at[0].set(1.0)
    np.testing.assert_array_equal(F.conv(x, kernel, mask=mask), F.conv(x, kernel * mask))
    with pytest.raises(ValueError, match="same shape as weights"):
        F.conv(x, kernel, mask=mask[:1])


def test_conv_kernel_shape_divides_inputs_by_feature_groups():
    assert F.conv_kernel_shape((3,), 4, 6, feature_group_count=2) == (3, 2, 6)
    with pytest.raises(ValueError, match="does not divide"):
        F.conv_kernel_shape((3,), 3, 6, feature_group_count=2)


def test_conv_local_has_a_kernel_per_output_position():
    x = _normal(0, (1, 4, 2))
    kernel_shape, bias_shape = F.conv_local_shapes(x, (3,), 5, padding="VALID")
    assert (kernel_shape, bias_shape) == ((2, 6, 5), (2, 5))
    kernel = _normal(1, kernel_shape)
    want = lax.conv_general_dilated_local(x, kernel, (1,), "VALID", (3,),
                                          dimension_numbers=("NWC", "WIO", "NWC"))
    np.testing.assert_array_equal(F.conv_local(x, kernel, kernel_size=(3,), padding="VALID"), want)


def test_conv_transpose_is_lax_conv_transpose_and_circular_folds_onto_the_period():
    x, kernel = _normal(0, (1, 3, 1)), _normal(1, (3, 1, 1))
    want = lax.conv_transpose(x, kernel, (2,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
    np.testing.assert_array_equal(F.conv_transpose(x, kernel, strides=(2,)), want)
    full = lax.conv_transpose(x, kernel, (2,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))
    y = F.conv_transpose(x, kernel, strides=(2,), padding="CIRCULAR")
    assert y.shape == (1, 6, 1)
    np.testing.assert_allclose(y.sum(), full.sum(), rtol=1e-6)   # folding keeps every term


def test_embed_takes_rows_and_attend_is_the_tied_projection():
    table, ids = _normal(0, (5, 3)), jnp.array([[0, 4], [2, 2]])
    np.testing.assert_array_equal(F.embed(ids, table), table[ids])
    query = _normal(1, (2, 3))
    np.testing.assert_array_equal(F.attend(query, table), jnp.dot(query, table.T))
    with pytest.raises(ValueError, match="integer dtype"):
        F.embed(ids.astype(jnp.float32), table)
