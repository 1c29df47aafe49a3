"""``nnx.Dropout``, ``LayerNorm``, ``BatchNorm``, ``Conv``, ``Embed``: flax.nnx's parameters,
masks, outputs and running statistics, bit for bit, from the same seed."""
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

import varjax as vj
from varjax import errors, nnx
from varjax.nnx.convolution import Conv
from varjax.nnx.embedding import Embed
from varjax.nnx.normalization import BatchNorm, LayerNorm
from varjax.nnx.stochastic import Dropout

X = jax.random.normal(jax.random.key(1), (4, 5, 6))


def same(a, b):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


def standard(fn):
    """flax.nnx mixes dtypes implicitly (bfloat16 with float32), so the oracle runs under
    standard promotion; ours runs under the suite's strict promotion."""
    def call(*args, **kwargs):
        with jax.numpy_dtype_promotion("standard"):
            return fn(*args, **kwargs)
    return call


def both(cls, flax_cls, *args, seed=0, **kwargs):
    return cls(*args, rngs=nnx.Rngs(seed), **kwargs), flax_cls(*args, rngs=flax_nnx.Rngs(seed),
                                                                 **kwargs)


def same_variables(ours, theirs, names):
    for name in names:
        a, b = getattr(ours, name), getattr(theirs, name)
        if b is None:
            assert a is None, name
        else:
            assert type(a).__name__ == type(b).__name__, name
            same(a[...], b[...])


# -- Dropout ----------------------------------------------------------------------------

@pytest.mark.parametrize("rate, kwargs, seeds", [
    (0.5, {}, {"default": 0}),
    (0.3, {"broadcast_dims": (0,)}, {"dropout": 3, "params": 1}),
    (0.7, {"rng_collection": "noise"}, {"default": 2, "noise": 5}),
])
def test_dropout_masks_match_flax_nnx_from_the_same_seed(rate, kwargs, seeds):
    ours = Dropout(rate, rngs=nnx.Rngs(**seeds), **kwargs)
    theirs = flax_nnx.Dropout(rate, rngs=flax_nnx.Rngs(**seeds), **kwargs)
    for _ in range(3):   # each call draws the next key of the layer's forked stream
        same(ours(X), theirs(X))


@pytest.mark.parametrize("kind", ["Rngs", "RngStream", "key"])
def test_dropout_rngs_given_at_the_call_match_flax_nnx(kind):
    def rngs(module):
        r = module.Rngs(dropout=4)
        return {"Rngs": r, "RngStream": r.dropout, "key": jax.random.key(9)}[kind]
    ours, theirs = Dropout(0.5), flax_nnx.Dropout(0.5)
    r, fr = rngs(nnx), rngs(flax_nnx)
    for _ in range(2):
        same(ours(X, rngs=r), theirs(X, rngs=fr))


def test_dropout_rates_zero_and_one_draw_no_key():
    for rate, want in ((0.0, X), (1.0, jnp.zeros_like(X))):
        layer = Dropout(rate, rngs=nnx.Rngs(0))
        same(layer(X), want)
        assert int(layer.rngs.count) == 0


def test_dropout_deterministic_by_attribute_call_and_modes():
    layer = Dropout(0.5, rngs=nnx.Rngs(0))
    same(layer(X, deterministic=True), X)
    layer.eval()
    assert layer.deterministic is True
    same(layer(X), X)
    layer.train()
    assert layer.deterministic is False
    theirs = flax_nnx.Dropout(0.5, rngs=flax_nnx.Rngs(0))
    same(layer(X), theirs(X))


def test_dropout_without_deterministic_is_a_config_error():
    with pytest.raises(errors.ConfigError, match="deterministic") as info:
        Dropout(0.5, deterministic=None, rngs=nnx.Rngs(0))(X)
    assert isinstance(info.value, ValueError)
    assert "test_nnx_layers.py" in info.value.source


def test_dropout_without_rngs_is_a_config_error():
    with pytest.raises(errors.ConfigError, match="rngs"):
        Dropout(0.5)(X)


def test_dropout_rngs_of_another_type_is_a_config_error():
    with pytest.raises(errors.ConfigError, match="int"):
        Dropout(0.5, rngs=0)
    with pytest.raises(errors.ConfigError, match="str"):
        Dropout(0.5)(X, rngs="dropout")


def test_dropout_under_vj_jit_draws_the_masks_of_eager_flax_nnx():
    ours = Dropout(0.5, rngs=nnx.Rngs(0))
    theirs = flax_nnx.Dropout(0.5, rngs=flax_nnx.Rngs(0))
    step = vj.jit(lambda m, x: m(x))
    for _ in range(2):   # the layer's stream advances through the transform
        same(step(ours, X), theirs(X))


# -- LayerNorm ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {}, {"use_bias": False}, {"use_scale": False}, {"use_bias": False, "use_scale": False},
    {"dtype": jnp.bfloat16}, {"param_dtype": jnp.bfloat16}, {"use_fast_variance": False},
    {"epsilon": 1e-2, "scale_init": flax_nnx.initializers.normal(1.0),
     "bias_init": flax_nnx.initializers.normal(1.0)},
    {"reduction_axes": (1, 2)},
])
def test_layernorm_matches_flax_nnx_bitwise(kwargs):
    ours, theirs = both(LayerNorm, flax_nnx.LayerNorm, 6, **kwargs)
    same_variables(ours, theirs, ("scale", "bias"))
    same(ours(X), standard(theirs)(X))


def test_layernorm_mask_and_bfloat16_input_match_flax_nnx():
    ours, theirs = both(LayerNorm, flax_nnx.LayerNorm, 6)
    mask = jnp.arange(6) % 2 == 0
    same(ours(X, mask=mask), theirs(X, mask=mask))
    same(ours(X.astype(jnp.bfloat16)), standard(theirs)(X.astype(jnp.bfloat16)))


def test_layernorm_axis_name_averages_over_the_mapped_axis_as_flax_nnx():
    ours, theirs = both(LayerNorm, flax_nnx.LayerNorm, 6, axis_name="batch")
    same(jax.vmap(ours, axis_name="batch")(X), jax.vmap(theirs, axis_name="batch")(X))


# -- BatchNorm ----------------------------------------------------------------------------

@pytest.mark.parametrize("num_features, x, kwargs", [
    (6, X, {}),
    (6, X, {"use_bias": False, "use_scale": False}),
    (5, X, {"axis": 1, "momentum": 0.9}),
    (6, X, {"dtype": jnp.bfloat16}),
    (6, X.astype(jnp.bfloat16), {}),
    (6, X, {"param_dtype": jnp.bfloat16, "use_fast_variance": False, "epsilon": 1e-3}),
])
def test_batchnorm_train_and_eval_match_flax_nnx_bitwise(num_features, x, kwargs):
    ours, theirs = both(BatchNorm, flax_nnx.BatchNorm, num_features, **kwargs)
    names = ("scale", "bias", "mean", "var")
    same_variables(ours, theirs, names)
    for step in range(2):   # training: batch statistics, running averages updated in place
        same(ours(x + step), standard(theirs)(x + step))
        same_variables(ours, theirs, names)
    # evaluation: the running averages, which stay as they are
    same(ours(x, use_running_average=True), standard(theirs)(x, use_running_average=True))
    same_variables(ours, theirs, names)


def test_batchnorm_mask_matches_flax_nnx():
    ours, theirs = both(BatchNorm, flax_nnx.BatchNorm, 6)
    mask = jnp.broadcast_to((jnp.arange(5) < 3)[None, :, None], X.shape)
    same(ours(X, mask=mask), theirs(X, mask=mask))
    same_variables(ours, theirs, ("mean", "var"))


def test_batchnorm_train_and_eval_set_use_running_average():
    ours = BatchNorm(6, rngs=nnx.Rngs(0))
    ours.eval()
    assert ours.use_running_average is True
    before = np.asarray(ours.mean[...])
    ours(X)
    same(ours.mean[...], before)
    ours.train()
    assert ours.use_running_average is False
    ours(X)
    assert not np.array_equal(ours.mean[...], before)


def test_batchnorm_without_use_running_average_is_a_config_error():
    layer = BatchNorm(6, use_running_average=None, rngs=nnx.Rngs(0))
    with pytest.raises(errors.ConfigError, match="use_running_average"):
        layer(X)
    layer(X, use_running_average=True)   # the call argument suffices


def test_batchnorm_under_vj_jit_updates_running_stats_in_place_as_flax_nnx_jit():
    ours, theirs = both(BatchNorm, flax_nnx.BatchNorm, 6)
    eager = BatchNorm(6, rngs=nnx.Rngs(0))
    step, flax_step = vj.jit(lambda m, x: m(x)), flax_nnx.jit(lambda m, x: m(x))
    for i in range(2):
        x = X * (i + 1)
        same(step(ours, x), flax_step(theirs, x))
        same_variables(ours, theirs, ("mean", "var"))
        # XLA fuses the jitted statistics differently from eager ops (flax.nnx's own jit
        # and eager calls differ by an ulp too): equal to the eager call up to rounding.
        eager(x)
        for name in ("mean", "var"):
            np.testing.assert_allclose(getattr(ours, name)[...], getattr(eager, name)[...],
                                       rtol=1e-6, atol=1e-7)
    assert sorted(vj.state(ours)) == ["batch_stats", "params"]


def test_train_and_eval_reach_layers_inside_a_model():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.norm = BatchNorm(6, rngs=rngs)
            self.drop = Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.norm(x))

    model = Model(nnx.Rngs(0))
    model.eval()
    assert (model.norm.use_running_average, model.drop.deterministic) == (True, True)
    same(model(X), model.norm(X))
    model.train()
    assert (model.norm.use_running_average, model.drop.deterministic) == (False, False)


# -- Conv -----------------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape, kernel_size, kwargs", [
    ((2, 7, 4), 3, {}),
    ((2, 7, 4), (3,), {"padding": "VALID", "strides": 2}),
    ((2, 7, 4), 3, {"padding": "CIRCULAR", "kernel_dilation": 2}),
    ((2, 7, 4), 2, {"padding": "CAUSAL", "use_bias": False}),
    ((2, 7, 4), 3, {"padding": [(1, 2)], "input_dilation": 2}),
    ((2, 7, 4), 3, {"feature_group_count": 2}),
    ((2, 5, 5, 4), (3, 3), {"strides": (1, 2), "padding": "REFLECT"}),
    ((7, 4), 3, {}),                            # no batch axis
    ((2, 3, 7, 4), 3, {}),                      # two batch axes
    ((2, 7, 4), 3, {"dtype": jnp.bfloat16}),
    ((2, 7, 4), 3, {"param_dtype": jnp.bfloat16, "bias_init": flax_nnx.initializers.ones}),
])
def test_conv_matches_flax_nnx_bitwise(x_shape, kernel_size, kwargs):
    ours, theirs = both(Conv, flax_nnx.Conv, 4, 6, kernel_size, **kwargs)
    same_variables(ours, theirs, ("kernel", "bias"))
    assert ours.kernel_shape == theirs.kernel_shape
    x = jax.random.normal(jax.random.key(2), x_shape)
    same(ours(x), standard(theirs)(x))


def test_conv_mask_and_preferred_element_type_match_flax_nnx():
    mask = jnp.tril(jnp.ones((4, 6)))[None].repeat(3, 0)
    ours, theirs = both(Conv, flax_nnx.Conv, 4, 6, 3, mask=mask, dtype=jnp.bfloat16,
                        preferred_element_type=jnp.float32)
    x = jax.random.normal(jax.random.key(2), (2, 7, 4))
    same(ours(x), standard(theirs)(x))


def test_conv_mask_of_another_shape_is_an_error():
    layer = Conv(4, 6, 3, mask=jnp.ones((3, 4, 5)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="same shape"):
        layer(jnp.ones((2, 7, 4)))


def test_conv_groups_that_do_not_divide_the_input_features_is_an_error():
    with pytest.raises(ValueError, match="feature_group_count=3"):
        Conv(4, 6, 3, feature_group_count=3, rngs=nnx.Rngs(0))


def test_vj_grad_through_conv_matches_flax_nnx():
    ours, theirs = both(Conv, flax_nnx.Conv, 4, 6, 3)
    x = jax.random.normal(jax.random.key(2), (2, 7, 4))

    def loss(m, x):
        return jnp.sum(m(x) ** 2)
    got, want = vj.grad(loss)(ours, x), flax_nnx.grad(loss)(theirs, x)
    assert type(got) is Conv
    same_variables(got, want, ("kernel", "bias"))


def test_out_sharding_is_not_provided():
    conv = Conv(4, 6, 3, rngs=nnx.Rngs(0))
    embed = Embed(5, 4, rngs=nnx.Rngs(0))
    for call in (lambda: conv(jnp.ones((1, 3, 4)), out_sharding="x"),
                 lambda: embed(jnp.zeros((2,), int), out_sharding="x"),
                 lambda: embed.attend(jnp.ones((2, 4)), out_sharding="x")):
        with pytest.raises(errors.NotProvidedError, match="out_sharding") as info:
            call()
        assert "varjax.nnx" in str(info.value)


# -- Embed ----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_embeddings, kwargs", [
    (7, {}), (7, {"param_dtype": jnp.bfloat16}), (7, {"dtype": jnp.float16}), (1, {}),
])
def test_embed_matches_flax_nnx_bitwise(num_embeddings, kwargs):
    ours, theirs = both(Embed, flax_nnx.Embed, num_embeddings, 3, **kwargs)
    same_variables(ours, theirs, ("embedding",))
    assert ours.dtype == theirs.dtype
    indices = jnp.array([[0, num_embeddings - 1], [num_embeddings - 1, 0]])
    same(ours(indices), theirs(indices))
    query = X[..., :3]
    same(ours.attend(query), theirs.attend(query))


def test_embed_of_a_float_input_is_an_error():
    with pytest.raises(ValueError, match="integer"):
        Embed(5, 3, rngs=nnx.Rngs(0))(jnp.ones((2,)))


# -- the layers together ----------------------------------------------------------------------

OURS = SimpleNamespace(LayerNorm=LayerNorm, Conv=Conv, Dropout=Dropout, Embed=Embed,
                       BatchNorm=BatchNorm, Rngs=nnx.Rngs)


def test_layers_draw_from_one_rngs_in_flax_nnx_order():
    def build(m):
        r = m.Rngs(0)
        return [m.LayerNorm(3, rngs=r), m.Conv(3, 4, 2, rngs=r), m.Dropout(0.5, rngs=r),
                m.Embed(5, 3, rngs=r), m.BatchNorm(4, use_bias=False, rngs=r)], r
    ours, r = build(OURS)
    theirs, fr = build(flax_nnx)
    same_variables(ours[1], theirs[1], ("kernel", "bias"))
    same_variables(ours[3], theirs[3], ("embedding",))
    same(ours[2](X), theirs[2](X))
    same(jax.random.key_data(r.params()), jax.random.key_data(fr.params()))
    same(jax.random.key_data(r.dropout()), jax.random.key_data(fr.dropout()))


@pytest.mark.parametrize("cls, flax_cls, args, metadata", [
    (Conv, flax_nnx.Conv, (2, 3, 1), {"kernel": "k", "bias": "b"}),
    (LayerNorm, flax_nnx.LayerNorm, (3,), {"scale": "s", "bias": "b"}),
    (BatchNorm, flax_nnx.BatchNorm, (3,), {"scale": "s", "bias": "b"}),
    (Embed, flax_nnx.Embed, (4, 3), {"embedding": "e"}),
])
def test_metadata_arguments_reach_the_variables_as_in_flax_nnx(cls, flax_cls, args, metadata):
    kwargs = {f"{name}_metadata": {"tag": tag} for name, tag in metadata.items()}
    ours, theirs = both(cls, flax_cls, *args, **kwargs)
    for name, tag in metadata.items():
        assert getattr(ours, name).tag == getattr(theirs, name).tag == tag
