"""Dense, DenseGeneral, Conv, ConvTranspose and Embed against flax.linen."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import check_parity, layout

from varjax.nn.linear import Conv, ConvTranspose, Dense, DenseGeneral, Embed

KEY = jax.random.key(42)


def _x(*shape, dtype=jnp.float32):
    return jax.random.normal(KEY, shape).astype(dtype)


@pytest.mark.parametrize("kwargs, shape", [
    ({}, (2, 4, 3)),
    ({"use_bias": False, "precision": "highest", "kernel_init": jax.nn.initializers.normal(0.5),
      "bias_init": jax.nn.initializers.ones}, (3,)),
    ({"dtype": jnp.float16}, (2, 3)),
])
def test_dense_matches_linen(kwargs, shape):
    check_parity(Dense(4, **kwargs), flax_nn.Dense(4, **kwargs), _x(*shape),
                 atol=1e-2 if "dtype" in kwargs else 1e-5)


def test_dense_param_dtype_and_mixed_input_dtype_follow_standard_promotion_under_strict_mode():
    x = _x(2, 3, dtype=jnp.bfloat16)
    layer = Dense(4, param_dtype=jnp.float16)
    v = layer.init(KEY, x)
    assert v["params"]["kernel"].dtype == jnp.float16
    with jax.numpy_dtype_promotion("standard"):
        want = flax_nn.Dense(4, param_dtype=jnp.float16).apply(v, x)
    got = layer.apply(v, x)  # the test config is strict: no implicit promotion allowed here
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_dense_integer_dtype_is_rejected():
    with pytest.raises(ValueError, match="inexact"):
        Dense(4, dtype=jnp.int32).init(KEY, _x(2, 3))


def test_dense_custom_dot_general_is_used():
    calls = []

    def dot_general(*args, **kwargs):
        calls.append(1)
        return jax.lax.dot_general(*args, **kwargs)

    check_parity(Dense(4, dot_general=dot_general), flax_nn.Dense(4), _x(2, 3))
    assert calls


@pytest.mark.parametrize("kwargs, shape", [
    ({"features": (4, 5)}, (2, 3)),
    ({"features": (4, 5), "axis": (1, -1)}, (2, 3, 6, 7)),
    ({"features": 3, "axis": -1, "batch_dims": (0,)}, (2, 5, 4)),
    ({"features": (2, 3), "axis": (2,), "batch_dims": (0, 1), "use_bias": False}, (2, 3, 4, 5)),
])
def test_dense_general_matches_linen(kwargs, shape):
    check_parity(DenseGeneral(**kwargs), flax_nn.DenseGeneral(**kwargs), _x(*shape))


def test_dense_general_initializers_see_the_flattened_fan_in_and_fan_out():
    seen = []

    def init(key, shape, dtype=jnp.float32):
        seen.append(tuple(shape))
        return jnp.ones(shape, dtype)

    v = DenseGeneral((4, 5), axis=(1, -1), kernel_init=init, bias_init=init).init(KEY, _x(2, 3, 6, 7))
    assert seen == [(21, 20), (20,)]
    assert v["params"]["kernel"].shape == (3, 7, 4, 5) and v["params"]["bias"].shape == (4, 5)


def test_dense_general_rejects_non_leading_batch_dims():
    with pytest.raises(ValueError, match="consecutive leading"):
        DenseGeneral(3, axis=-1, batch_dims=(1,)).init(KEY, _x(2, 5, 4))


# Each padding mode once, the other options spread over the cases.  Few
# distinct shapes, so JAX's per-shape compilations are shared between cases.
@pytest.mark.parametrize("kwargs, shape", [
    ({"kernel_size": 3, "padding": "SAME", "use_bias": False}, (2, 7, 4)),  # int kernel_size
    ({"kernel_size": (3, 3), "padding": "VALID", "strides": (2, 1), "kernel_dilation": (2, 1)}, (1, 6, 6, 4)),
    ({"kernel_size": (3, 3), "padding": "CIRCULAR", "kernel_dilation": 2, "strides": 2}, (1, 6, 6, 4)),
    ({"kernel_size": (3, 3), "padding": "REFLECT"}, (6, 6, 4)),  # unbatched
    ({"kernel_size": (3,), "padding": "CAUSAL", "kernel_dilation": 2}, (2, 3, 7, 4)),  # two batch dims
    ({"kernel_size": (3,), "padding": 1, "feature_group_count": 2}, (2, 7, 4)),
    ({"kernel_size": (3, 3), "padding": [(1, 0), (0, 2)], "input_dilation": 2}, (1, 6, 6, 4)),
    ({"kernel_size": (3, 3), "padding": [1, (0, 2)], "precision": "highest"}, (1, 6, 6, 4)),
])
def test_conv_matches_linen(kwargs, shape):
    check_parity(Conv(4, **kwargs), flax_nn.Conv(4, **kwargs), _x(*shape))


def test_conv_mask_multiplies_the_kernel():
    mask = jnp.tril(jnp.ones((3, 4, 4)))
    x = _x(2, 7, 4)
    v, out, _ = check_parity(Conv(4, (3,), mask=mask), flax_nn.Conv(4, (3,), mask=mask), x)
    masked = {"params": {**v["params"], "kernel": v["params"]["kernel"] * mask}}
    np.testing.assert_allclose(out, Conv(4, (3,)).apply(masked, x), atol=1e-6)


def test_conv_mask_of_wrong_shape_is_rejected():
    with pytest.raises(ValueError, match="same shape as weights"):
        Conv(4, (3,), mask=jnp.ones((3, 4))).init(KEY, _x(2, 6, 3))


def test_conv_causal_padding_needs_one_spatial_axis():
    with pytest.raises(ValueError, match="1D"):
        Conv(4, (3, 3), padding="CAUSAL").init(KEY, _x(1, 5, 5, 2))


def test_conv_causal_output_does_not_see_the_future():
    x = _x(2, 7, 4)
    layer = Conv(4, (3,), padding="CAUSAL")
    v = layer.init(KEY, x)
    y1 = layer.apply(v, x)
    y2 = layer.apply(v, x.at[:, 4:].set(9.0))
    np.testing.assert_array_equal(y1[:, :4], y2[:, :4])


@pytest.mark.parametrize("padding", [[(1, 2, 3), (0, 0)], [1], 1.5])
def test_conv_invalid_padding_is_rejected(padding):
    with pytest.raises(ValueError):
        Conv(4, (3, 3), padding=padding).init(KEY, _x(1, 5, 5, 2))


def test_conv_feature_group_count_must_divide_input_features():
    with pytest.raises(ValueError, match="feature_group_count"):
        Conv(4, (3,), feature_group_count=2).init(KEY, _x(2, 6, 3))


@pytest.mark.parametrize("kwargs, shape", [
    ({"kernel_size": 3, "padding": "VALID", "use_bias": False}, (2, 5, 4)),
    ({"kernel_size": (3,), "padding": "SAME", "strides": (2,), "kernel_dilation": (2,)}, (5, 4)),  # unbatched
    ({"kernel_size": (3, 2), "padding": [(1, 0), (0, 1)], "strides": (2, 1)}, (1, 3, 3, 4)),
    ({"kernel_size": (3,), "transpose_kernel": True, "strides": (2,)}, (2, 2, 5, 4)),  # two batch dims
    ({"kernel_size": (4, 4), "padding": "CIRCULAR", "strides": (2, 2)}, (1, 3, 3, 4)),
    ({"kernel_size": (4, 4), "padding": "CIRCULAR", "strides": 2, "transpose_kernel": True}, (1, 3, 3, 4)),
    ({"kernel_size": (3,), "padding": "CIRCULAR"}, (2, 5, 4)),
])
def test_conv_transpose_matches_linen(kwargs, shape):
    check_parity(ConvTranspose(4, **kwargs), flax_nn.ConvTranspose(4, **kwargs), _x(*shape))


def test_conv_transpose_mask():
    mask = jnp.tril(jnp.ones((3, 4, 4)))
    check_parity(ConvTranspose(4, (3,), mask=mask), flax_nn.ConvTranspose(4, (3,), mask=mask), _x(2, 5, 4))
    with pytest.raises(ValueError, match="same shape as weights"):
        ConvTranspose(4, (3,), mask=jnp.ones((3, 4))).init(KEY, _x(2, 5, 4))


IDS = jnp.array([[0, 1, 4], [3, -1, 2]])


@pytest.mark.parametrize("kwargs", [{}, {"dtype": jnp.float16}, {"param_dtype": jnp.float16}])
def test_embed_lookup_matches_linen(kwargs):
    check_parity(Embed(5, 3, **kwargs), flax_nn.Embed(5, 3, **kwargs), IDS, atol=1e-2 if kwargs else 1e-5)


def test_embed_single_row_broadcasts():
    check_parity(Embed(1, 3), flax_nn.Embed(1, 3), IDS * 0)


def test_embed_attend_matches_linen_and_ties_the_table():
    q = _x(2, 3)
    v, out, _ = check_parity(Embed(5, 3), flax_nn.Embed(5, 3), q, method="attend")
    assert layout(v) == layout(Embed(5, 3).init(KEY, IDS))
    np.testing.assert_allclose(out, q @ v["params"]["embedding"].T, atol=1e-5)


def test_embed_rejects_float_indices():
    with pytest.raises(ValueError, match="integer"):
        Embed(5, 3).init(KEY, jnp.zeros((2,)))
