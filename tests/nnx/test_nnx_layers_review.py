"""The layer-library review's fixes (issue 36), against flax.nnx 0.12.8 where it behaves:
axes out of range, immutable static mappings, the checks shared by both frontends."""
import copy
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.functional.linear import AxisError, dense_general_axes
from varjax.nnx.linear import LinearGeneral

X = jnp.ones((2, 3, 4))


# -- LinearGeneral / dense_general_axes: axes must lie within the input's rank -------------

@pytest.mark.parametrize("axis", [5, 3, -4])
def test_linear_general_axis_out_of_range_is_a_type_error_as_flax_nnx(axis):
    """``a % ndim`` used to contract another axis silently (axis=5 of a rank-3 input: 2)."""
    with pytest.raises(TypeError):
        flax_nnx.LinearGeneral(4, 5, axis=axis, rngs=flax_nnx.Rngs(0))(X)
    layer = LinearGeneral(4, 5, axis=axis, rngs=nnx.Rngs(0))
    with pytest.raises(AxisError, match=f"axis {axis} is out of range") as info:
        layer(X)
    assert isinstance(info.value, TypeError) and isinstance(info.value, errors.ConfigError)
    assert info.value.path == ("axis",)
    assert "test_nnx_layers_review.py" in info.value.source


def test_linear_general_batch_axis_out_of_range_is_a_type_error_as_flax_nnx():
    batch_axis = {0: 2, 1: 3, 2: 4, 3: 1}
    with pytest.raises(TypeError):
        flax_nnx.LinearGeneral(4, 5, batch_axis=batch_axis, rngs=flax_nnx.Rngs(0))(X)
    layer = LinearGeneral(4, 5, batch_axis=batch_axis, rngs=nnx.Rngs(0))
    with pytest.raises(AxisError, match="batch_axis 3 is out of range") as info:
        layer(X)
    assert info.value.path == ("batch_axis",)


def test_linear_general_axis_needs_only_the_call_s_rank():
    """The range is checked against the input, not a rank guessed at construction."""
    layer = LinearGeneral(4, 5, axis=4, rngs=nnx.Rngs(0))
    theirs = flax_nnx.LinearGeneral(4, 5, axis=4, rngs=flax_nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 2, 1, 3, 4))
    np.testing.assert_allclose(layer(x), theirs(x), rtol=1e-6)


def test_dense_general_axes_refuses_out_of_range_axes_under_the_layer_s_names():
    assert dense_general_axes(3, (-3, 2), (0,)) == ((0, 2), (0,))
    with pytest.raises(TypeError) as info:
        dense_general_axes(3, 3, names=("axis", "batch_dims"))
    assert info.value.path == ("axis",)


def test_linen_dense_general_refuses_an_axis_out_of_range():
    from varjax.nn import DenseGeneral
    with pytest.raises(TypeError, match="axis 5 is out of range"):
        DenseGeneral(3, axis=5).init(jax.random.key(0), X)


# -- LinearGeneral.batch_axis is immutable, as flax.nnx's FrozenDict -----------------------

def test_linear_general_batch_axis_is_immutable_and_hashes_into_one_graphdef():
    one = LinearGeneral(4, 5, batch_axis={0: 2}, rngs=nnx.Rngs(0))
    other = LinearGeneral(4, 5, batch_axis={0: 2}, rngs=nnx.Rngs(1))
    with pytest.raises(TypeError):
        one.batch_axis[0] = 3
    # It copies and pickles, as flax.nnx's FrozenDict (a MappingProxyType does neither).
    for copied in (copy.deepcopy(one).batch_axis, pickle.loads(pickle.dumps(one.batch_axis))):
        assert copied == one.batch_axis and hash(copied) == hash(one.batch_axis)
    assert dict(one.batch_axis) == dict(flax_nnx.LinearGeneral(
        4, 5, batch_axis={0: 2}, rngs=flax_nnx.Rngs(0)).batch_axis)
    assert nnx.graphdef(one) == nnx.graphdef(other)
    assert hash(nnx.graphdef(one)) == hash(nnx.graphdef(other))
    traces = []

    @nnx.jit
    def apply(layer, x):
        traces.append(1)
        return layer(x)
    x = jnp.ones((2, 3, 4))
    np.testing.assert_array_equal(apply(one, x), one(x))
    apply(other, x)
    assert len(traces) == 1


# -- nnx.nn's submodules hold flax's helpers that ported code imports ----------------------

HELPERS = {"recurrent": ["flip_sequences", "modified_orthogonal", "RNNBase",
                         "default_kernel_init", "default_bias_init"],
           "linear": ["default_kernel_init", "default_bias_init", "default_embed_init",
                      "canonicalize_padding"],
           "lora": ["default_a_initializer", "default_b_initializer"]}


@pytest.mark.parametrize("sub", sorted(HELPERS))
def test_nnx_nn_submodules_hold_flax_s_helpers_as_attributes_not_exports(sub):
    import varjax.nnx.nn as nnx_nn
    ours, theirs = getattr(nnx_nn, sub), getattr(flax_nnx.nn, sub)
    for name in HELPERS[sub]:
        assert hasattr(theirs, name) and hasattr(ours, name), name
        assert name not in ours.__all__
        obj = getattr(ours, name)
        if name.startswith("default_"):
            key, shape = jax.random.key(3), (3, 4)
            np.testing.assert_array_equal(obj(key, shape, jnp.float32),
                                          getattr(theirs, name)(key, shape, jnp.float32))


def test_nnx_nn_recurrent_helpers_compute_as_flax_s():
    from varjax.nnx.nn import recurrent
    theirs = flax_nnx.nn.recurrent
    key = jax.random.key(4)
    np.testing.assert_array_equal(recurrent.modified_orthogonal(key, (4, 4)),
                                  theirs.modified_orthogonal(key, (4, 4)))
    x, lengths = jnp.arange(2 * 3 * 1.0).reshape(2, 3, 1), jnp.array([2, 3])
    np.testing.assert_array_equal(recurrent.flip_sequences(x, lengths, 1, False),
                                  theirs.flip_sequences(x, lengths, 1, False))


@pytest.mark.parametrize("padding", ["SAME", "VALID", "CIRCULAR", 1, (1, 2), [(1, 2), (0, 1)]])
def test_nnx_nn_linear_canonicalize_padding_as_flax_s(padding):
    from varjax.nnx.nn import linear
    got, want = (m.canonicalize_padding(padding, 2) for m in (linear, flax_nnx.nn.linear))
    assert (got if isinstance(got, str) else [tuple(p) for p in got]) == \
        (want if isinstance(want, str) else [tuple(p) for p in want])


# -- one copy of the normalization rules, raised at the user's line by both frontends ------

def test_batch_norm_and_instance_norm_axes_are_one_rule():
    from varjax.functional.normalization import batch_norm_axes, instance_norm_axes
    assert batch_norm_axes(4, (1, -1)) == ((1, 3), (0, 2))
    assert instance_norm_axes(4, (1, -1)) == ((1, 3), (2,))


def test_instance_norm_batch_axis_feature_is_the_same_config_error_in_both_frontends():
    from varjax import nn
    from varjax.nnx.normalization import InstanceNorm
    x = jnp.ones((2, 3, 4))
    with pytest.raises(errors.ConfigError, match="include axis 0, which is the batch") as ours:
        InstanceNorm(4, feature_axes=(0, -1), rngs=nnx.Rngs(0))(x)
    with pytest.raises(errors.ConfigError, match="include axis 0, which is the batch") as linen:
        nn.InstanceNorm(feature_axes=(0, -1)).init(jax.random.key(0), x)
    for info in (ours, linen):
        assert "test_nnx_layers_review.py" in info.value.source


def test_spectral_norm_error_on_non_matrix_is_one_rule_in_both_frontends():
    from varjax import nn
    from varjax.nnx.convolution import Conv
    from varjax.nnx.weight_normalization import SpectralNorm
    with pytest.raises(ValueError, match="3D but error_on_non_matrix"):
        flax_nnx.SpectralNorm(flax_nnx.Conv(2, 3, (2,), rngs=flax_nnx.Rngs(0)),
                              error_on_non_matrix=True, rngs=flax_nnx.Rngs(1))
    with pytest.raises(errors.ConfigError, match="3D but error_on_non_matrix") as ours:
        SpectralNorm(Conv(2, 3, (2,), rngs=nnx.Rngs(0)), error_on_non_matrix=True,
                     rngs=nnx.Rngs(1))
    assert ours.value.path == ("kernel",)
    layer = nn.SpectralNorm(nn.Conv(3, (2,)), error_on_non_matrix=True)
    with pytest.raises(errors.ConfigError, match="3D but error_on_non_matrix") as linen:
        layer.init(jax.random.key(0), jnp.ones((1, 4, 2)), update_stats=False)
    assert linen.value.path[-1] == "kernel"
    assert "test_nnx_layers_review.py" in linen.value.source


def test_spectral_norm_writes_keep_the_variables_dtypes_as_flax_nnx():
    """``v[...] = x`` casts, so a bfloat16 ``u``/``sigma`` stays bfloat16 after a float32
    power iteration, and the kernel keeps its dtype."""
    from varjax.nnx.linear import Linear
    from varjax.nnx.weight_normalization import SpectralNorm
    ours = SpectralNorm(Linear(3, 4, rngs=nnx.Rngs(0)), param_dtype=jnp.bfloat16,
                        dtype=jnp.float32, rngs=nnx.Rngs(1))
    theirs = flax_nnx.SpectralNorm(flax_nnx.Linear(3, 4, rngs=flax_nnx.Rngs(0)),
                                   param_dtype=jnp.bfloat16, dtype=jnp.float32,
                                   rngs=flax_nnx.Rngs(1))
    x = jax.random.normal(jax.random.key(2), (2, 3))
    with jax.numpy_dtype_promotion("standard"):
        want = theirs(x)
    np.testing.assert_array_equal(ours(x), want)
    for path in (("kernel", "u"), ("kernel", "sigma")):
        got, exp = ours.batch_stats[path][...], theirs.batch_stats[path][...]
        assert got.dtype == exp.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, exp)
    assert ours.layer_instance.kernel.dtype == theirs.layer_instance.kernel.dtype


# -- F.ema blends in the promoted dtype, as flax.nnx's EMA and BatchNorm ---------------------

def test_ema_adds_in_the_promoted_dtype_then_casts_once_as_flax():
    from varjax.functional.normalization import ema
    old = jax.random.normal(jax.random.key(5), (64,), jnp.bfloat16)
    new = jax.random.normal(jax.random.key(6), (64,), jnp.float32)
    got = ema(old, new, 0.9)
    want = ((0.9 * old).astype(jnp.float32) + (1 - 0.9) * new).astype(jnp.bfloat16)
    cast_first = 0.9 * old + (1 - 0.9) * new.astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, cast_first)


def test_nnx_ema_of_bfloat16_params_with_float32_updates_matches_flax_nnx():
    from varjax.nnx.ema import EMA
    from varjax.nnx.linear import Linear
    averaged = Linear(2, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    update = Linear(2, 3, rngs=nnx.Rngs(1))
    flax_averaged = flax_nnx.Linear(2, 3, param_dtype=jnp.bfloat16, rngs=flax_nnx.Rngs(0))
    flax_update = flax_nnx.Linear(2, 3, rngs=flax_nnx.Rngs(1))
    ours, theirs = EMA(averaged, 0.9), flax_nnx.EMA(flax_averaged, 0.9)
    ours.update(update)
    with jax.numpy_dtype_promotion("standard"):
        theirs.update(flax_update)
    for name in ("kernel", "bias"):
        got, want = ours.params[name][...], theirs.params[name][...]
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got, want)


# -- argument checks -----------------------------------------------------------------------

@pytest.mark.parametrize("group_size", [0, -2, 1.5])
def test_group_norm_group_size_must_be_a_positive_int(group_size):
    from varjax.nnx.normalization import GroupNorm
    with pytest.raises(errors.ConfigError, match="must be a positive int") as info:
        GroupNorm(4, num_groups=None, group_size=group_size, rngs=nnx.Rngs(0))
    assert info.value.path == ("group_size",)
    assert "test_nnx_layers_review.py" in info.value.source


@pytest.mark.parametrize("key, want", [("3", 3), ("-2", -2), ("+1", 1), ("kernel", "kernel"),
                                       ("1.5", "1.5"), (" 3", " 3"), ("1_0", "1_0"),
                                       ("", ""), (1.5, 1.5), (None, None), (4, 4)])
def test_int_or_key_converts_only_a_string_of_digits(key, want):
    from varjax.nnx.statelib import int_or_key
    got = int_or_key(key)
    assert got == want and type(got) is type(want)


def test_a_normalization_axis_out_of_range_is_an_error_not_another_axis_in_both_frontends():
    from varjax import nn as linen
    with pytest.raises(IndexError, match="axis 5 is out of range") as caught:
        nnx.LayerNorm(4, reduction_axes=5, rngs=nnx.Rngs(0))(jnp.ones((2, 4)))
    assert __file__ in str(caught.value)
    with pytest.raises(IndexError):                   # flax.nnx's own, from the shape lookup
        flax_nnx.LayerNorm(4, reduction_axes=5, rngs=flax_nnx.Rngs(0))(jnp.ones((2, 4)))
    with pytest.raises(IndexError, match="axis -3 is out of range"):
        linen.LayerNorm(reduction_axes=-3).init(jax.random.key(0), jnp.ones((2, 4)))
