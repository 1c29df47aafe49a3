"""``nnx.RMSNorm``, ``GroupNorm``, ``InstanceNorm``, ``WeightNorm``, ``SpectralNorm``: flax.nnx
0.12.8's parameters and state (paths, types, values bitwise from the same seed), outputs
(bitwise) and errors, side by side."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.convolution import Conv
from varjax.nnx.normalization import GroupNorm, InstanceNorm, RMSNorm
from varjax.nnx.weight_normalization import SpectralNorm, WeightNorm, WrappedLayerChangedError

X = jax.random.normal(jax.random.key(1), (4, 5, 6))
X2 = jax.random.normal(jax.random.key(2), (2, 3))
XC = jax.random.normal(jax.random.key(3), (1, 4, 4, 3))
HERE = __file__.rsplit("/", 1)[-1]


def same(a, b):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


def standard(fn, *args, **kwargs):
    """flax.nnx mixes dtypes implicitly (bfloat16 with float32), so the oracle runs under
    standard promotion; ours runs under the suite's strict promotion."""
    with jax.numpy_dtype_promotion("standard"):
        return fn(*args, **kwargs)


def both(cls, flax_cls, *args, seed=0, **kwargs):
    return cls(*args, rngs=nnx.Rngs(seed), **kwargs), flax_cls(*args, rngs=flax_nnx.Rngs(seed),
                                                                 **kwargs)


def leaf(v):
    return np.asarray(v if isinstance(v, jax.Array) else v[...])


def same_state(ours, theirs):
    """Equal ``nnx.state`` paths, Variable types (or plain arrays) and values, bitwise."""
    a = dict(nnx.to_flat_state(nnx.state(ours)))
    b = dict(flax_nnx.to_flat_state(flax_nnx.state(theirs)))
    assert list(a) == list(b)
    for path in a:
        assert type(a[path]).__name__ == type(b[path]).__name__, path
        same(leaf(a[path]), leaf(b[path]))


def raised_here(info):
    assert HERE in info.value.source


# -- RMSNorm --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {}, {"dtype": jnp.bfloat16, "param_dtype": jnp.bfloat16},
    {"use_scale": False, "use_fast_variance": False, "epsilon": 1e-2},
    {"reduction_axes": (1, 2), "feature_axes": -1},
])
def test_rmsnorm_matches_flax_nnx_bitwise(kwargs):
    ours, theirs = both(RMSNorm, flax_nnx.RMSNorm, 6, **kwargs)
    same_state(ours, theirs)
    same(ours(X), standard(theirs, X))
    same(ours(X.astype(jnp.bfloat16)), standard(theirs, X.astype(jnp.bfloat16)))


def test_rmsnorm_mask_and_axis_name_match_flax_nnx():
    ours, theirs = both(RMSNorm, flax_nnx.RMSNorm, 6, axis_name="batch")
    mask = jnp.arange(6) % 2 == 0
    vmapped = {"in_axes": (0, None), "axis_name": "batch"}
    same(jax.vmap(ours, **vmapped)(X, mask), jax.vmap(theirs, **vmapped)(X, mask))


# -- GroupNorm ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"num_groups": 3}, {"num_groups": None, "group_size": 3, "dtype": jnp.bfloat16},
    {"num_groups": 1, "use_scale": False},
    {"num_groups": 2, "use_bias": False, "param_dtype": jnp.bfloat16},
    {"num_groups": 2, "use_fast_variance": False, "reduction_axes": (1, 2)},
])
def test_groupnorm_matches_flax_nnx_bitwise(kwargs):
    ours, theirs = both(GroupNorm, flax_nnx.GroupNorm, 6, **kwargs)
    same_state(ours, theirs)
    assert (ours.num_groups, ours.group_size) == (theirs.num_groups, theirs.group_size)
    same(ours(X), standard(theirs, X))
    same(ours(X.astype(jnp.bfloat16)), standard(theirs, X.astype(jnp.bfloat16)))


def test_groupnorm_mask_and_axis_name_match_flax_nnx():
    ours, theirs = both(GroupNorm, flax_nnx.GroupNorm, 6, num_groups=2)
    mask = jnp.broadcast_to(jnp.arange(5)[:, None] < 3, X.shape)   # flax.nnx reshapes it
    same(ours(X, mask=mask), theirs(X, mask=mask))
    ours, theirs = both(GroupNorm, flax_nnx.GroupNorm, 6, num_groups=2, axis_name="batch")
    same(jax.vmap(ours, axis_name="batch")(X), jax.vmap(theirs, axis_name="batch")(X))


@pytest.mark.parametrize("groups, match", [
    ({"num_groups": 4}, "does not divide"), ({"num_groups": 0}, "does not divide"),
    ({"num_groups": 2.0}, "does not divide"),
    ({"num_groups": None, "group_size": 4}, "not a multiple"),
    ({"num_groups": 2, "group_size": 3}, "exactly one"), ({"num_groups": None}, "exactly one"),
])
def test_groupnorm_bad_group_counts_are_config_errors_where_flax_nnx_raises(groups, match):
    with pytest.raises(ValueError):
        flax_nnx.GroupNorm(6, **groups, rngs=flax_nnx.Rngs(0))
    with pytest.raises(errors.ConfigError, match=match) as info:
        GroupNorm(6, **groups, rngs=nnx.Rngs(0))
    raised_here(info)


def test_groupnorm_reduction_axes_without_the_feature_axis_is_a_config_error():
    layer = GroupNorm(6, num_groups=2, reduction_axes=(1,), rngs=nnx.Rngs(0))
    with pytest.raises(errors.ConfigError, match="last axis") as info:
        layer(X)
    raised_here(info)


def test_groupnorm_reduction_axes_leaving_out_a_middle_axis_normalize_each_group():
    # flax.nnx 0.12.8 repeats the group statistics along axis 1 and mixes them here; each
    # row of X normalized alone is what the layer means, and what flax.nnx gives for it.
    ours, theirs = both(GroupNorm, flax_nnx.GroupNorm, 6, num_groups=2, reduction_axes=-1)
    same(ours(X).reshape(20, 6), theirs(X.reshape(20, 6)))


# -- InstanceNorm ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_features, kwargs", [
    (6, {}), (6, {"use_bias": False, "use_fast_variance": False, "dtype": jnp.bfloat16}),
    (6, {"param_dtype": jnp.bfloat16}),
    (30, {"feature_axes": (1, 2), "scale_init": flax_nnx.initializers.normal(1.0)}),
])
def test_instancenorm_matches_flax_nnx_bitwise(num_features, kwargs):
    ours, theirs = both(InstanceNorm, flax_nnx.InstanceNorm, num_features, **kwargs)
    same_state(ours, theirs)
    same(ours(X), standard(theirs, X))
    same(ours(X.astype(jnp.bfloat16)), standard(theirs, X.astype(jnp.bfloat16)))


def test_instancenorm_mask_and_axis_name_match_flax_nnx():
    ours, theirs = both(InstanceNorm, flax_nnx.InstanceNorm, 6)
    mask = jnp.arange(5)[:, None] % 2 == 0
    same(ours(X, mask=mask), theirs(X, mask=mask))
    ours, theirs = both(InstanceNorm, flax_nnx.InstanceNorm, 6, axis_name="batch")
    same(jax.vmap(ours, axis_name="batch")(X), jax.vmap(theirs, axis_name="batch")(X))


def test_instancenorm_feature_axes_with_the_batch_axis_is_a_config_error():
    ours, theirs = both(InstanceNorm, flax_nnx.InstanceNorm, 4, feature_axes=(0, -1))
    with pytest.raises(ValueError, match="batch axis"):
        theirs(X)
    with pytest.raises(errors.ConfigError, match="batch axis") as info:
        ours(X)
    raised_here(info)


# -- WeightNorm -----------------------------------------------------------------------------

def linear(nn):
    return nn.Linear(3, 4, rngs=nn.Rngs(0))


def conv(nn):
    return nn.Conv(3, 4, (2, 2), rngs=nn.Rngs(0))


OURS_NN = type("OursNN", (), {"Linear": nnx.Linear, "Conv": Conv, "Rngs": nnx.Rngs})


def wrapped(cls, flax_cls, layer, seed=1, **kwargs):
    flax_kwargs = {k: flax_nnx.PathContains(v.key) if k == "variable_filter" else v
                   for k, v in kwargs.items()}
    return (cls(layer(OURS_NN), rngs=nnx.Rngs(seed), **kwargs),
            flax_cls(layer(flax_nnx), rngs=flax_nnx.Rngs(seed), **flax_kwargs))


@pytest.mark.parametrize("layer, x, kwargs", [
    (linear, X2, {}), (linear, X2, {"feature_axes": None}),
    (linear, X2, {"variable_filter": nnx.PathContains("bias"), "use_scale": False,
                  "epsilon": 1e-3}),
    (linear, X2, {"dtype": jnp.bfloat16, "scale_init": flax_nnx.initializers.constant(2.0)}),
    (conv, XC, {"feature_axes": (2, 3)}),
])
def test_weightnorm_state_and_calls_match_flax_nnx_bitwise(layer, x, kwargs):
    ours, theirs = wrapped(WeightNorm, flax_nnx.WeightNorm, layer, **kwargs)
    same_state(ours, theirs)
    for _ in range(2):      # the weight is normalized in place, then again
        same(ours(x), standard(theirs, x))
        same_state(ours, theirs)


def test_weightnorm_scale_init_that_needs_a_key_fails_as_in_flax_nnx():
    # flax.nnx passes the stream itself as the key: a random scale_init cannot run.
    init = flax_nnx.initializers.normal()
    with pytest.raises(TypeError):
        flax_nnx.WeightNorm(linear(flax_nnx), scale_init=init, rngs=flax_nnx.Rngs(1))
    with pytest.raises(TypeError):
        WeightNorm(linear(OURS_NN), scale_init=init, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("cls, flax_cls", [(WeightNorm, flax_nnx.WeightNorm),
                                           (SpectralNorm, flax_nnx.SpectralNorm)])
def test_a_weight_added_after_wrapping_is_a_runtime_error_as_in_flax_nnx(cls, flax_cls):
    ours, theirs = wrapped(cls, flax_cls, linear)
    theirs.layer_instance.extra = flax_nnx.Linear(4, 4, rngs=flax_nnx.Rngs(2))
    ours.layer_instance.extra = nnx.Linear(4, 4, rngs=nnx.Rngs(2))
    with pytest.raises(RuntimeError):
        theirs(X2)
    with pytest.raises(WrappedLayerChangedError, match="changed after") as info:
        ours(X2)
    assert info.value.path == ("extra", "kernel")
    raised_here(info)


# -- SpectralNorm ---------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types")  # flax.nnx's
@pytest.mark.parametrize("layer, x, kwargs", [
    (linear, X2, {}), (linear, X2, {"n_steps": 3, "param_dtype": jnp.bfloat16}),
    (linear, X2, {"update_stats": False, "epsilon": 1e-3}), (linear, X2, {"n_steps": 0}),
    (linear, X2, {"dtype": jnp.bfloat16}),
    (conv, XC, {}),
])
def test_spectralnorm_state_and_calls_match_flax_nnx_bitwise(layer, x, kwargs):
    ours, theirs = wrapped(SpectralNorm, flax_nnx.SpectralNorm, layer, **kwargs)
    same_state(ours, theirs)
    for _ in range(2):      # u and sigma carried from call to call
        same(ours(x), standard(theirs, x))
        same_state(ours, theirs)


def test_spectralnorm_update_stats_by_call_and_by_train_eval_as_flax_nnx():
    ours, theirs = wrapped(SpectralNorm, flax_nnx.SpectralNorm, linear)
    u = ours.batch_stats[("kernel", "u")][...]
    same(ours(X2, update_stats=False), theirs(X2, update_stats=False))
    same(ours.batch_stats[("kernel", "u")][...], u)
    ours.eval(), theirs.eval()
    assert ours.use_running_average and theirs.use_running_average
    same(ours(X2), theirs(X2))
    same(ours.batch_stats[("kernel", "u")][...], u)
    ours.train(), theirs.train()
    same(ours(X2), theirs(X2))
    same_state(ours, theirs)
    assert not np.array_equal(ours.batch_stats[("kernel", "u")][...], u)


def test_spectralnorm_error_on_non_matrix_is_a_config_error_naming_the_weight():
    with pytest.raises(ValueError, match="3D|4D"):
        flax_nnx.SpectralNorm(conv(flax_nnx), error_on_non_matrix=True, rngs=flax_nnx.Rngs(1))
    with pytest.raises(errors.ConfigError, match="4D but error_on_non_matrix") as info:
        SpectralNorm(conv(OURS_NN), error_on_non_matrix=True, rngs=nnx.Rngs(1))
    assert info.value.path == ("kernel",)
    raised_here(info)


# -- under transforms, and in a model ---------------------------------------------------------

def loss(model, x):
    return jnp.sum(model(x) ** 2)


def _norms(nn):
    class Norms(nn.Module):
        def __init__(self, rngs):
            normal = nn.initializers.normal(1.0)
            self.rms = nn.RMSNorm(6, scale_init=normal, rngs=rngs)
            self.group = nn.GroupNorm(6, num_groups=2, scale_init=normal, bias_init=normal,
                                      rngs=rngs)
            self.inst = nn.InstanceNorm(6, scale_init=normal, bias_init=normal, rngs=rngs)
            self.spectral = nn.SpectralNorm(nn.Linear(6, 6, rngs=rngs), rngs=rngs)
            self.weight = nn.WeightNorm(nn.Linear(6, 6, rngs=rngs), rngs=rngs)

        def __call__(self, x):
            return self.weight(self.spectral(self.inst(self.group(self.rms(x)))))
    return Norms


OURS_NORMS = type("OursNorms", (), {
    "Module": nnx.Module, "initializers": nnx.initializers, "RMSNorm": RMSNorm,
    "GroupNorm": GroupNorm, "InstanceNorm": InstanceNorm, "SpectralNorm": SpectralNorm,
    "WeightNorm": WeightNorm, "Linear": nnx.Linear})


def test_norm_layers_draw_from_one_rngs_in_flax_nnx_order_and_run_under_jit_grad_vmap():
    ours, theirs = _norms(OURS_NORMS)(nnx.Rngs(0)), _norms(flax_nnx)(flax_nnx.Rngs(0))
    same_state(ours, theirs)
    # Gradients through every layer, the wrappers' in-place weights and u/sigma inside jit.
    grads = nnx.jit(nnx.grad(loss))(ours, X)
    flax_grads = flax_nnx.jit(flax_nnx.grad(loss))(theirs, X)
    a, b = nnx.to_flat_state(grads), flax_nnx.to_flat_state(flax_grads)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, g), (_, h) in zip(a, b):
        np.testing.assert_allclose(g[...], h[...], rtol=1e-5, atol=1e-6, err_msg=str(path))
    for (path, v), (_, w) in zip(nnx.to_flat_state(nnx.state(ours)),
                                 flax_nnx.to_flat_state(flax_nnx.state(theirs))):
        np.testing.assert_allclose(leaf(v), leaf(w), rtol=1e-6, err_msg=str(path))
    mapped = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(ours.group, X)
    flax_mapped = flax_nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(theirs.group, X)
    # nnx.vmap compiles the body where flax.nnx's runs op by op, and the one-pass variance
    # of a group of 3 values magnifies the rounding that fusion changes.
    np.testing.assert_allclose(mapped, flax_mapped, rtol=1e-4)
