"""Porting whole Linen programs: the same source runs on flax.linen and varjax.nn.

Each program below is written once, inside a function that takes the ``nn``
namespace, so the *identical* model code is instantiated against ``flax.linen``
and ``varjax.nn``.  For every program the tests check that

* ``init`` with the same key gives the same variable-dict layout (collections,
  paths -- hence auto names --, shapes, dtypes);
* applied to the same (perturbed) variables, both give the same outputs, and
  where relevant the same gradients and the same updated mutable collections.

The model code is valid under ``jax_numpy_dtype_promotion='strict'`` and
``jax_numpy_rank_promotion='raise'`` (tests/conftest.py) for both libraries.
"""
from __future__ import annotations

import functools

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import assert_close, layout, perturb

import varjax.nn as vj_nn

ATOL = 1e-5

# Flax warns on nn.SelfAttention (used on purpose: it is part of the ported API).
pytestmark = pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated:DeprecationWarning")


# ---------------------------------------------------------------------------------------
# helpers


def _data(shape, seed=0, dtype=jnp.float32):
    # NumPy draws: no XLA compile per input shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _tokens(shape, vocab, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


@functools.cache
def _program(program, nn):
    """Each program's classes are built once per library, so equal models built by different
    tests are equal (and varjax reuses its traces/compilations across them)."""
    return program(nn)


def _both(program, *args, name=None, **kwargs):
    """``(flax model, varjax model)`` built from the same program source."""
    def build(nn):
        made = _program(program, nn)
        return (made if name is None else made[name])(*args, **kwargs)
    return build(flax_nn), build(vj_nn)


def _key(seed=0):
    # RBG keys: XLA:CPU compiles a threefry init program several times slower, and the key
    # implementation is orthogonal to porting (the default-key path is covered by the
    # autoencoder tests here and by parity.check_parity in the layer tests).
    return jax.random.key(seed, impl="rbg")


def _init_same_layout(flax_model, vj_model, *args, key=None, **kwargs):
    """Inits both with the same key, asserts the same layout (collections, paths, shapes,
    dtypes) and returns varjax's variables.

    Flax's init runs abstractly (``jax.eval_shape``): it is a pure function of the key and
    inputs, so that is exactly its layout, without compiling it.  The values do not need to
    come from Flax: the tests perturb them and apply *both* libraries to the same variables
    (varjax's init values differ from Flax's by design: its own RNG derivation)."""
    key = _key() if key is None else key
    flax_vars = jax.eval_shape(functools.partial(flax_model.init, **kwargs), key, *args)
    vj_vars = vj_model.init(key, *args, **kwargs)
    assert layout(vj_vars) == layout(flax_vars), (layout(vj_vars), layout(flax_vars))
    return jax.tree.map(jnp.asarray, dict(vj_vars))


def _perturb_batch_stats(variables, seed=7):
    """Noise on running means, positive noise on running variances."""
    rng = np.random.default_rng(seed)
    flat, tree = jax.tree_util.tree_flatten_with_path(variables["batch_stats"])
    out = []
    for path, x in flat:
        noise = rng.standard_normal(np.shape(x)).astype(np.float32)
        if jax.tree_util.keystr(path).endswith("['var']"):
            out.append(jnp.asarray(np.asarray(x) * np.exp(0.3 * noise), x.dtype))
        else:
            out.append(jnp.asarray(np.asarray(x) + 0.3 * noise, x.dtype))
    return {**variables, "batch_stats": jax.tree.unflatten(tree, out)}


def _unfreeze(tree):
    """Plain dicts (Flax may hand back FrozenDicts inside mutable results)."""
    if hasattr(tree, "items"):
        return {k: _unfreeze(v) for k, v in tree.items()}
    return tree


# ---------------------------------------------------------------------------------------
# 1. MNIST-style CNN, compact


def cnn_program(nn):
    def avg_pool(x):
        # Linen's avg_pool divides by a NumPy integer, which strict promotion rejects; the
        # narrowest scope that lets the shared source run on Flax too.
        with jax.numpy_dtype_promotion("standard"):
            return nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))

    class CNN(nn.Module):
        num_classes: int = 10

        @nn.compact
        def __call__(self, x):
            x = nn.Conv(features=4, kernel_size=(3, 3))(x)
            x = nn.relu(x)
            x = avg_pool(x)
            x = nn.Conv(features=6, kernel_size=(3, 3))(x)
            x = nn.relu(x)
            x = avg_pool(x)
            x = x.reshape((x.shape[0], -1))
            x = nn.Dense(features=16)(x)
            x = nn.relu(x)
            x = nn.Dense(features=self.num_classes)(x)
            return nn.log_softmax(x)

    return CNN


@functools.cache
def _cnn():
    """(flax model, varjax model, input, perturbed variables), shared by the CNN tests."""
    flax_m, vj_m = _both(cnn_program, num_classes=5)
    x = _data((2, 8, 8, 1))
    variables = _init_same_layout(flax_m, vj_m, x)
    assert set(variables["params"]) == {"Conv_0", "Conv_1", "Dense_0", "Dense_1"}
    return flax_m, vj_m, x, perturb(variables)


def test_cnn_compact_auto_names_and_logits_match_flax():
    flax_m, vj_m, x, variables = _cnn()
    assert_close(vj_m.apply(variables, x), flax_m.apply(variables, x), ATOL)


def test_cnn_loss_gradients_match_flax():
    flax_m, vj_m, x, variables = _cnn()
    labels = jax.nn.one_hot(jnp.array([1, 4], jnp.int32), 5, dtype=jnp.float32)

    def grads(model):
        def loss(params):
            logp = model.apply({"params": params}, x)
            return -jnp.mean(jnp.sum(labels * logp, axis=-1))
        return jax.jit(jax.value_and_grad(loss))(variables["params"])

    assert_close(grads(vj_m), grads(flax_m), ATOL)


# ---------------------------------------------------------------------------------------
# 2. setup-style autoencoder with encode/decode


def autoencoder_program(nn):
    class AutoEncoder(nn.Module):
        latent: int = 3
        out: int = 6

        def setup(self):
            self.encoder = nn.Dense(self.latent)
            self.decoder = nn.Dense(self.out)

        def encode(self, x):
            return nn.tanh(self.encoder(x))

        def decode(self, z):
            return nn.sigmoid(self.decoder(z))

        def __call__(self, x):
            return self.decode(self.encode(x))

    return AutoEncoder


def test_autoencoder_setup_names_and_reconstruction_match_flax():
    flax_m, vj_m = _both(autoencoder_program)
    x = _data((4, 6))
    variables = _init_same_layout(flax_m, vj_m, x, key=jax.random.key(0))  # default impl
    assert set(variables["params"]) == {"encoder", "decoder"}
    variables = perturb(variables)
    assert_close(vj_m.apply(variables, x), flax_m.apply(variables, x), ATOL)


def test_autoencoder_method_by_name_and_by_function_match_flax():
    flax_m, vj_m = _both(autoencoder_program)
    x = _data((4, 6), seed=2)
    z = _data((4, 3), seed=5)
    variables = perturb(_init_same_layout(flax_m, vj_m, x, key=jax.random.key(0)))
    flax_cls, vj_cls = type(flax_m), type(vj_m)

    assert_close(vj_m.apply(variables, x, method="encode"),
                 flax_m.apply(variables, x, method="encode"), ATOL)
    assert_close(vj_m.apply(variables, z, method=vj_cls.decode),
                 flax_m.apply(variables, z, method=flax_cls.decode), ATOL)
    # A method given by function equals the method given by name.
    assert_close(vj_m.apply(variables, x, method=vj_cls.encode),
                 vj_m.apply(variables, x, method="encode"), 0)


def test_autoencoder_init_through_one_method_creates_only_its_params():
    flax_m, vj_m = _both(autoencoder_program)
    x = _data((4, 6))
    variables = _init_same_layout(flax_m, vj_m, x, method="encode", key=jax.random.key(0))
    assert set(variables["params"]) == {"encoder"}


def test_autoencoder_nn_init_and_nn_apply_with_custom_function_match_flax():
    flax_m, vj_m = _both(autoencoder_program)
    x = _data((4, 6), seed=4)

    def roundtrip_error(model, x):
        recon = model.decode(model.encode(x))
        return jnp.mean((recon - x) ** 2), model.encode(x)

    flax_vars = jax.eval_shape(flax_nn.init(roundtrip_error, flax_m), jax.random.key(0), x)
    vj_vars = vj_nn.init(roundtrip_error, vj_m)(jax.random.key(0), x)
    assert layout(vj_vars) == layout(flax_vars)
    variables = perturb(jax.tree.map(jnp.asarray, dict(vj_vars)))
    assert_close(vj_nn.apply(roundtrip_error, vj_m)(variables, x),
                 flax_nn.apply(roundtrip_error, flax_m)(variables, x), ATOL)


def test_autoencoder_lambda_method_bind_jit_and_vmap_match_flax():
    flax_m, vj_m = _both(autoencoder_program)
    x = _data((4, 6), seed=23)
    variables = perturb(_init_same_layout(flax_m, vj_m, x, key=jax.random.key(0)))

    def doubled_latent(model, x):
        return model.decode(model.encode(x) * 2.0)

    assert_close(vj_m.apply(variables, x, method=doubled_latent),
                 flax_m.apply(variables, x, method=doubled_latent), ATOL)
    # bind: an interactive bound model, methods callable directly.
    assert_close(vj_m.bind(variables).encode(x), flax_m.bind(variables).encode(x), ATOL)
    # apply under jax.jit, and per example under jax.vmap.
    assert_close(jax.jit(vj_m.apply)(variables, x), flax_m.apply(variables, x), ATOL)
    per_example = lambda m: jax.vmap(lambda xi: m.apply(variables, xi))(x)  # noqa: E731
    assert_close(per_example(vj_m), per_example(flax_m), ATOL)


def test_autoencoder_init_with_output_layout_matches_flax():
    flax_m, vj_m = _both(autoencoder_program)
    x = _data((4, 6), seed=24)
    flax_res = jax.eval_shape(flax_m.init_with_output, jax.random.key(0), x)
    vj_res = vj_m.init_with_output(jax.random.key(0), x)
    assert layout(vj_res) == layout(flax_res)
    assert_close(vj_res[0], vj_m.apply(vj_res[1], x), ATOL)


# ---------------------------------------------------------------------------------------
# 3. transformer encoder block


def transformer_program(nn):
    class MLP(nn.Module):
        hidden: int
        rate: float

        @nn.compact
        def __call__(self, x, deterministic):
            y = nn.Dense(self.hidden)(x)
            y = nn.gelu(y)
            y = nn.Dropout(rate=self.rate)(y, deterministic=deterministic)
            return nn.Dense(x.shape[-1])(y)

    class EncoderBlock(nn.Module):
        num_heads: int = 2
        qkv_features: int = 8
        mlp_hidden: int = 16
        rate: float = 0.1
        self_attention_class: bool = False

        @nn.compact
        def __call__(self, x, mask, train):
            deterministic = not train
            y = nn.LayerNorm()(x)
            if self.self_attention_class:
                y = nn.SelfAttention(num_heads=self.num_heads, qkv_features=self.qkv_features,
                                     dropout_rate=self.rate)(y, mask=mask,
                                                             deterministic=deterministic)
            else:
                y = nn.MultiHeadDotProductAttention(
                    num_heads=self.num_heads, qkv_features=self.qkv_features,
                    dropout_rate=self.rate, deterministic=deterministic)(y, y, mask=mask)
            y = nn.Dropout(rate=self.rate)(y, deterministic=deterministic)
            x = x + y
            y = nn.LayerNorm()(x)
            y = MLP(self.mlp_hidden, self.rate)(y, deterministic)
            y = nn.Dropout(rate=self.rate, deterministic=deterministic)(y)
            return x + y

    class Encoder(nn.Module):
        vocab: int = 13
        width: int = 8
        depth: int = 2
        self_attention_class: bool = False

        @nn.compact
        def __call__(self, tokens, valid, train=False):
            x = nn.Embed(self.vocab, self.width)(tokens)
            pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                             (1, tokens.shape[1], self.width))
            x = x + jnp.broadcast_to(pos, x.shape)
            mask = nn.make_attention_mask(valid, valid)
            mask = nn.combine_masks(mask, nn.make_causal_mask(tokens))
            for _ in range(self.depth):
                x = EncoderBlock(self_attention_class=self.self_attention_class)(x, mask, train)
            return nn.LayerNorm(name="final_norm")(x)

    return Encoder


def _transformer_inputs():
    tokens = _tokens((2, 5), 13, seed=1)
    valid = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], jnp.bool_)
    return tokens, valid


@functools.cache
def _transformer(self_attention_class=False):
    # Two blocks with MultiHeadDotProductAttention (auto names EncoderBlock_0/1); one block
    # with SelfAttention, which also serves the gradient and dropout tests (compile time).
    depth = 1 if self_attention_class else 2
    flax_m, vj_m = _both(transformer_program, self_attention_class=self_attention_class,
                         depth=depth)
    tokens, valid = _transformer_inputs()
    variables = _init_same_layout(flax_m, vj_m, tokens, valid)
    blocks = {f"EncoderBlock_{i}" for i in range(depth)}
    assert set(variables["params"]) == {"Embed_0", "final_norm", "pos_embedding"} | blocks
    return flax_m, vj_m, tokens, valid, perturb(variables)


@pytest.mark.parametrize("self_attention_class", [False, True],
                         ids=["MultiHeadDotProductAttention", "SelfAttention"])
def test_transformer_encoder_masked_deterministic_outputs_match_flax(self_attention_class):
    flax_m, vj_m, tokens, valid, variables = _transformer(self_attention_class)
    flax_out = flax_m.apply(variables, tokens, valid, train=False)
    vj_out = vj_m.apply(variables, tokens, valid, train=False)
    assert_close(vj_out, flax_out, ATOL)


def test_transformer_encoder_param_gradients_match_flax():
    flax_m, vj_m, tokens, valid, variables = _transformer(self_attention_class=True)

    def grads(model):
        def loss(params):
            return jnp.sum(model.apply({"params": params}, tokens, valid) ** 2)
        return jax.jit(jax.grad(loss))(variables["params"])

    assert_close(grads(vj_m), grads(flax_m), ATOL)


def test_transformer_encoder_train_mode_runs_with_dropout_rng():
    # Dropout masks come from each library's own RNG streams, so only shapes/finiteness and
    # "dropout changes the output" are comparable here.
    flax_m, vj_m, tokens, valid, variables = _transformer(self_attention_class=True)
    rngs = {"dropout": _key(5)}
    vj_train = vj_m.apply(variables, tokens, valid, train=True, rngs=rngs)
    flax_train = flax_m.apply(variables, tokens, valid, train=True, rngs=rngs)
    assert vj_train.shape == flax_train.shape
    assert np.all(np.isfinite(np.asarray(vj_train)))
    assert not np.allclose(np.asarray(vj_train), np.asarray(vj_m.apply(variables, tokens, valid)))


def test_transformer_init_in_train_mode_with_only_a_params_key_like_flax():
    # Common Linen idiom: model.init(key, x, train=True) with a single key; Linen's
    # Scope.make_rng uses the 'params' stream for a missing 'dropout' stream.
    flax_m, vj_m = _both(transformer_program)
    tokens, valid = _transformer_inputs()
    variables = _init_same_layout(flax_m, vj_m, tokens, valid, train=True)
    rngs = {"params": _key(3)}
    assert vj_m.apply(variables, tokens, valid, train=True, rngs=rngs).shape == \
        flax_m.apply(variables, tokens, valid, train=True, rngs=rngs).shape


# ---------------------------------------------------------------------------------------
# 4. ResNet block with BatchNorm


def resnet_program(nn):
    class ResBlock(nn.Module):
        features: int
        strides: tuple = (1, 1)

        @nn.compact
        def __call__(self, x, train):
            norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                     epsilon=1e-5)
            residual = x
            y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)
            y = norm()(y)
            y = nn.relu(y)
            y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
            y = norm(scale_init=nn.initializers.zeros)(y)
            if residual.shape != y.shape:
                residual = nn.Conv(self.features, (1, 1), self.strides, use_bias=False,
                                   name="proj")(residual)
                residual = norm(name="proj_norm")(residual)
            return nn.relu(residual + y)

    class ResNet(nn.Module):
        num_classes: int = 3

        @nn.compact
        def __call__(self, x, train=True):
            x = nn.Conv(4, (3, 3), name="stem")(x)
            x = nn.BatchNorm(use_running_average=not train, name="stem_norm")(x)
            x = nn.relu(x)
            x = ResBlock(4)(x, train)
            x = ResBlock(6, (2, 2))(x, train)
            x = jnp.mean(x, axis=(1, 2))
            return nn.Dense(self.num_classes)(x)

    return ResNet


@functools.cache
def _resnet_setup():
    flax_m, vj_m = _both(resnet_program)
    x = _data((2, 6, 6, 2), seed=11)
    variables = _init_same_layout(flax_m, vj_m, x, train=False)
    assert set(variables) == {"params", "batch_stats"}
    assert {"proj", "proj_norm"} <= set(variables["params"]["ResBlock_1"])
    assert "proj" not in variables["params"]["ResBlock_0"]
    return flax_m, vj_m, x, _perturb_batch_stats(perturb(variables))


def test_resnet_jitted_train_step_grads_and_batch_stats_match_flax():
    flax_m, vj_m, x, variables = _resnet_setup()
    labels = jax.nn.one_hot(jnp.array([0, 2], jnp.int32), 3, dtype=jnp.float32)

    def train_step(model, params, batch_stats):
        def loss_fn(p):
            logits, updates = model.apply({"params": p, "batch_stats": batch_stats}, x,
                                          train=True, mutable=["batch_stats"])
            loss = -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))
            return loss, updates["batch_stats"]
        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, grads, new_stats

    flax_res = jax.jit(functools.partial(train_step, flax_m))(variables["params"],
                                                              variables["batch_stats"])
    vj_res = jax.jit(functools.partial(train_step, vj_m))(variables["params"],
                                                          variables["batch_stats"])
    assert layout(vj_res[2]) == layout(flax_res[2])
    assert_close(_unfreeze(vj_res), _unfreeze(flax_res), ATOL)
    # The running statistics did move.
    assert not np.allclose(np.asarray(vj_res[2]["stem_norm"]["mean"]),
                           np.asarray(variables["batch_stats"]["stem_norm"]["mean"]))


def test_resnet_eval_with_running_average_matches_flax_and_leaves_stats():
    flax_m, vj_m, x, variables = _resnet_setup()
    assert_close(vj_m.apply(variables, x, train=False),
                 flax_m.apply(variables, x, train=False), ATOL)
    # In eval mode batch_stats are read, not written, even when mutable.
    vj_out, vj_upd = vj_m.apply(variables, x, train=False, mutable=["batch_stats"])
    flax_out, flax_upd = flax_m.apply(variables, x, train=False, mutable=["batch_stats"])
    assert_close(vj_out, flax_out, ATOL)
    assert_close(_unfreeze(vj_upd)["batch_stats"], variables["batch_stats"], 0)
    assert_close(_unfreeze(vj_upd), _unfreeze(flax_upd), 0)


# ---------------------------------------------------------------------------------------
# 5. sow intermediates and capture_intermediates


def sow_program(nn):
    class Block(nn.Module):
        features: int

        @nn.compact
        def __call__(self, x):
            h = nn.Dense(self.features)(x)
            self.sow("intermediates", "pre_activation", h)
            h = nn.relu(h)
            self.sow("intermediates", "activation_sum", jnp.sum(h),
                     reduce_fn=lambda acc, v: acc + v, init_fn=lambda: jnp.zeros((), jnp.float32))
            self.sow("losses", "l2", jnp.mean(h ** 2))
            return h

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = Block(4)
            h = block(x)
            h = block(h)  # the same block twice: its sown tuples get two entries
            h = Block(3, name="last")(h)
            self.sow("intermediates", "features", h)
            return nn.Dense(2)(h)

    return Net


@functools.cache
def _sow():
    flax_m, vj_m = _both(sow_program)
    x = _data((3, 4), seed=6)
    variables = _init_same_layout(flax_m, vj_m, x)
    # init drops 'intermediates' (DenyList default) but keeps other sown collections.
    assert set(variables) == {"params", "losses"}
    return flax_m, vj_m, x, perturb({"params": variables["params"]})


def test_sow_intermediates_layout_and_values_match_flax():
    flax_m, vj_m, x, variables = _sow()
    flax_res = flax_m.apply(variables, x, mutable=["intermediates", "losses"])
    vj_res = vj_m.apply(variables, x, mutable=["intermediates", "losses"])
    assert layout(_unfreeze(vj_res[1])) == layout(_unfreeze(flax_res[1]))
    assert len(vj_res[1]["intermediates"]["Block_0"]["pre_activation"]) == 2
    assert_close(_unfreeze(vj_res), _unfreeze(flax_res), ATOL)


def test_sow_into_immutable_collection_is_a_no_op_like_flax():
    flax_m, vj_m, x, variables = _sow()
    assert_close(vj_m.apply(variables, x), flax_m.apply(variables, x), ATOL)
    flax_res = flax_m.apply(variables, x, mutable=["losses"])
    vj_res = vj_m.apply(variables, x, mutable=["losses"])
    assert set(vj_res[1]) == set(flax_res[1]) == {"losses"}
    assert_close(_unfreeze(vj_res), _unfreeze(flax_res), ATOL)


def test_capture_intermediates_layout_and_values_match_flax():
    flax_m, vj_m, x, variables = _cnn()
    flax_res = flax_m.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    vj_res = vj_m.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
    assert layout(_unfreeze(vj_res[1])) == layout(_unfreeze(flax_res[1]))
    assert "__call__" in vj_res[1]["intermediates"]  # the root module's own output
    assert_close(_unfreeze(vj_res), _unfreeze(flax_res), ATOL)


def test_capture_intermediates_with_filter_and_sow_match_flax():
    flax_m, vj_m, x, variables = _sow()

    def run(model, nn):
        only_dense = lambda mdl, method_name: isinstance(mdl, nn.Dense)  # noqa: E731
        return model.apply(variables, x, capture_intermediates=only_dense,
                           mutable=["intermediates"])

    flax_res, vj_res = run(flax_m, flax_nn), run(vj_m, vj_nn)
    assert layout(_unfreeze(vj_res[1])) == layout(_unfreeze(flax_res[1]))
    assert_close(_unfreeze(vj_res), _unfreeze(flax_res), ATOL)


def test_attention_sow_weights_match_flax():
    def program(nn):
        class Attend(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4)(
                    x, sow_weights=True)
        return Attend

    flax_m, vj_m = _both(program)
    x = _data((2, 3, 4), seed=10)
    variables = perturb(_init_same_layout(flax_m, vj_m, x))
    flax_res = flax_m.apply(variables, x, mutable=["intermediates"])
    vj_res = vj_m.apply(variables, x, mutable=["intermediates"])
    assert layout(_unfreeze(vj_res[1])) == layout(_unfreeze(flax_res[1]))
    assert_close(_unfreeze(vj_res), _unfreeze(flax_res), ATOL)


# ---------------------------------------------------------------------------------------
# 6. weight sharing, module fields, Sequential, lists/dicts of submodules


def sharing_program(nn):
    CNN = _program(cnn_program, nn)

    class SharedTwice(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = nn.Dense(x.shape[-1])
            return dense(nn.relu(dense(x))) + nn.Dense(x.shape[-1])(x)

    class TwoHeads(nn.Module):
        def setup(self):
            self.trunk = nn.Dense(4)
            self.head = nn.Dense(2)

        def classify(self, x):
            return self.head(nn.relu(self.trunk(x)))

        def embed(self, x):
            return nn.tanh(self.trunk(x))

        def __call__(self, x):
            return self.classify(x), self.embed(x)

    class Classifier(nn.Module):
        backbone: nn.Module
        num_classes: int = 3

        @nn.compact
        def __call__(self, x):
            return nn.Dense(self.num_classes)(nn.relu(self.backbone(x)))

    class Siamese(nn.Module):
        """A setup submodule handed to another submodule: both paths share its params."""

        def setup(self):
            self.encoder = nn.Dense(3)
            self.scorer = Classifier(backbone=self.encoder, num_classes=1)

        def __call__(self, a, b):
            return self.scorer(a) - self.scorer(b), self.encoder(a)

    class Stack(nn.Module):
        def setup(self):
            self.layers = [nn.Dense(4) for _ in range(3)]
            self.heads = {"mean": nn.Dense(2), "logvar": nn.Dense(2)}
            self.mlp = nn.Sequential([nn.Dense(5), nn.relu, nn.Dense(4)])

        def __call__(self, x):
            for layer in self.layers:
                x = nn.relu(layer(x))
            x = self.mlp(x)
            return self.heads["mean"](x), self.heads["logvar"](x)

    class Tower(nn.Module):
        encoder: nn.Module

        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.relu(self.encoder(x)))

    class TwoTower(nn.Module):
        query: nn.Module
        doc: nn.Module

        def __call__(self, q, d):
            return jnp.sum(self.query(q) * self.doc(d), axis=-1)

    class Base(nn.Module):
        features: int = 3

        def setup(self):
            self.proj = nn.Dense(self.features)
            self.scale = self.param("scale", nn.initializers.ones, (1, self.features))
            self.unused = nn.Dense(7)  # never called: creates no params (lazy, like Linen)
            self.blocks = [[nn.Dense(3), nn.Dense(3)], (nn.Dense(3),)]
            shared = nn.Dense(3)
            self.left, self.right = shared, shared  # one instance, two attributes

        def __call__(self, x):
            for group in self.blocks:
                for block in group:
                    x = nn.relu(block(x))
            x = self.left(x) + self.right(x)
            return self.proj(x) * jnp.broadcast_to(self.scale, (x.shape[0], self.features))

    class Child(Base):
        heads: int = 2

        def setup(self):
            super().setup()
            self.head = nn.Dense(self.heads)

        def __call__(self, x):
            return self.head(super().__call__(x))

    class Helper(nn.Module):
        """setup and a compact method together, plus a nowrap factory for submodules."""

        def setup(self):
            self.pre = nn.Dense(3)

        @nn.nowrap
        def _dense(self, n, name=None):
            return nn.Dense(n, name=name)

        @nn.compact
        def __call__(self, x):
            x = self._dense(4)(self.pre(x))
            x = self._dense(4, name="middle")(nn.relu(x))
            return self._dense(2)(x)

    class Counting(nn.Module):
        """is_initializing / is_mutable_collection driving non-param state."""

        @nn.compact
        def __call__(self, x):
            calls = self.variable("counter", "calls", lambda: jnp.zeros((), jnp.int32))
            if not self.is_initializing():
                calls.value += 1
            mean = self.variable("stats", "mean", jnp.zeros, (1, x.shape[-1]), jnp.float32)
            if self.is_mutable_collection("stats"):
                mean.value = 0.9 * mean.value + 0.1 * jnp.mean(x, axis=0, keepdims=True)
            return nn.Dense(2)(x - jnp.broadcast_to(mean.value, x.shape))

    return dict(CNN=CNN, SharedTwice=SharedTwice, TwoHeads=TwoHeads, Classifier=Classifier,
                Siamese=Siamese, Stack=Stack, Tower=Tower, TwoTower=TwoTower, Child=Child,
                Helper=Helper, Counting=Counting)


def _sharing_parity(build, *inputs, method=None, expect_params=None, mutable=False):
    """``build(nn, program)`` makes the model; checks layout and outputs, returns variables."""
    flax_m = build(flax_nn, _program(sharing_program, flax_nn))
    vj_m = build(vj_nn, _program(sharing_program, vj_nn))
    variables = _init_same_layout(flax_m, vj_m, *inputs)
    if expect_params is not None:
        assert set(variables["params"]) == expect_params
    variables = perturb(variables)
    kw = {} if method is None else {"method": method}
    assert_close(_unfreeze(vj_m.apply(variables, *inputs, mutable=mutable, **kw)),
                 _unfreeze(flax_m.apply(variables, *inputs, mutable=mutable, **kw)), ATOL)
    return variables


def test_submodule_called_twice_shares_params_like_flax():
    variables = _sharing_parity(lambda nn, p: p["SharedTwice"](), _data((2, 3)),
                                expect_params={"Dense_0", "Dense_1"})
    assert variables["params"]["Dense_0"]["kernel"].shape == (3, 3)


def test_setup_submodule_used_in_two_methods_shares_params_like_flax():
    x = _data((2, 5), seed=12)
    _sharing_parity(lambda nn, p: p["TwoHeads"](), x, expect_params={"trunk", "head"})
    _sharing_parity(lambda nn, p: p["TwoHeads"](), x, method="embed")


def test_cnn_backbone_passed_as_dataclass_field_is_named_after_field_like_flax():
    x = _data((2, 8, 8, 1), seed=13)
    variables = _sharing_parity(lambda nn, p: p["Classifier"](backbone=p["CNN"](num_classes=6)), x,
                                expect_params={"backbone", "Dense_0"})
    assert set(variables["params"]["backbone"]) == {"Conv_0", "Conv_1", "Dense_0", "Dense_1"}


def test_bound_setup_submodule_passed_to_sibling_shares_params_like_flax():
    a, b = _data((2, 4), seed=14), _data((2, 4), seed=15)
    variables = _sharing_parity(lambda nn, p: p["Siamese"](), a, b)
    assert set(variables["params"]) == {"encoder", "scorer"}
    assert set(variables["params"]["scorer"]) == {"Dense_0"}


def test_setup_lists_dicts_and_sequential_names_match_flax():
    variables = _sharing_parity(lambda nn, p: p["Stack"](), _data((2, 3), seed=16))
    assert set(variables["params"]) == {"layers_0", "layers_1", "layers_2", "heads_mean",
                                        "heads_logvar", "mlp"}
    assert set(variables["params"]["mlp"]) == {"layers_0", "layers_2"}


def test_setup_inheritance_nested_lists_unused_and_aliased_submodules_match_flax():
    variables = _sharing_parity(lambda nn, p: p["Child"](), _data((2, 3), seed=25))
    assert set(variables["params"]) == {"blocks_0_0", "blocks_0_1", "blocks_1_0", "left", "proj",
                                        "scale", "head"}


def test_setup_plus_compact_with_nowrap_factory_names_match_flax():
    variables = _sharing_parity(lambda nn, p: p["Helper"](), _data((2, 3), seed=26))
    assert set(variables["params"]) == {"pre", "Dense_0", "middle", "Dense_1"}


def test_is_initializing_and_mutable_state_match_flax():
    variables = _sharing_parity(lambda nn, p: p["Counting"](), _data((2, 3), seed=27),
                                mutable=["counter", "stats"])
    assert int(variables["counter"]["calls"]) == 0


def test_one_unbound_encoder_passed_to_two_towers_is_shared_like_flax():
    # Linen adopts a module passed in from outside once per root (cache keyed on the instance)
    # so both towers use the params under the first adopter: query/encoder.
    q, d = _data((2, 3), seed=28), _data((2, 3), seed=29)
    variables = _sharing_parity(
        lambda nn, p: (lambda enc: p["TwoTower"](query=p["Tower"](enc), doc=p["Tower"](enc)))(
            nn.Dense(4)), q, d)
    assert "encoder" not in variables["params"]["doc"]


def test_named_module_passed_as_field_is_named_after_the_field_like_flax():
    # flax_preserve_adopted_names defaults to False: the field name wins.
    variables = _sharing_parity(
        lambda nn, p: p["Classifier"](backbone=nn.Dense(4, name="my_backbone")),
        _data((2, 3), seed=30))
    assert set(variables["params"]) == {"backbone", "Dense_0"}


def test_top_level_sequential_matches_flax():
    def build(nn):
        return nn.Sequential([nn.Dense(4), nn.relu, nn.Dense(4), nn.tanh, nn.Dense(2)])

    flax_m, vj_m = build(flax_nn), build(vj_nn)
    x = _data((3, 5), seed=17)
    variables = _init_same_layout(flax_m, vj_m, x)
    assert set(variables["params"]) == {"layers_0", "layers_2", "layers_4"}
    variables = perturb(variables)
    assert_close(vj_m.apply(variables, x), flax_m.apply(variables, x), ATOL)


# ---------------------------------------------------------------------------------------
# 7. LSTM language model with tied embeddings


def lstm_lm_program(nn):
    class LSTMLanguageModel(nn.Module):
        vocab: int = 11
        width: int = 6

        def setup(self):
            self.embed = nn.Embed(self.vocab, self.width)
            self.rnn = nn.RNN(nn.LSTMCell(self.width))
            self.proj = nn.Dense(self.width)

        def __call__(self, tokens):
            h = self.rnn(self.embed(tokens))
            return self.embed.attend(self.proj(h))

    class StackedLM(nn.Module):
        vocab: int = 11
        width: int = 6

        @nn.compact
        def __call__(self, tokens, seq_lengths):
            embed = nn.Embed(self.vocab, self.width, name="embed")
            x = embed(tokens)
            carry, x = nn.RNN(nn.LSTMCell(self.width), return_carry=True)(
                x, seq_lengths=seq_lengths)
            x = nn.RNN(nn.LSTMCell(self.width), name="upper")(x, seq_lengths=seq_lengths)
            return embed.attend(x), carry

    return dict(LSTMLanguageModel=LSTMLanguageModel, StackedLM=StackedLM)


def test_lstm_language_model_tied_logits_and_grads_match_flax():
    flax_m, vj_m = _both(lstm_lm_program, name="LSTMLanguageModel")
    tokens = _tokens((2, 5), 11, seed=18)
    variables = _init_same_layout(flax_m, vj_m, tokens)
    assert set(variables["params"]) == {"embed", "rnn", "proj"}
    variables = perturb(variables)
    assert_close(vj_m.apply(variables, tokens), flax_m.apply(variables, tokens), ATOL)

    def grads(model):
        def loss(params):
            logits = model.apply({"params": params}, tokens[:, :-1])
            logp = jax.nn.log_softmax(logits)
            target = jax.nn.one_hot(tokens[:, 1:], 11, dtype=jnp.float32)
            return -jnp.mean(jnp.sum(target * logp, axis=-1))
        return jax.jit(jax.value_and_grad(loss))(variables["params"])

    assert_close(grads(vj_m), grads(flax_m), ATOL)


def test_stacked_lstm_with_seq_lengths_and_carry_matches_flax():
    flax_m, vj_m = _both(lstm_lm_program, name="StackedLM")
    tokens = _tokens((2, 5), 11, seed=19)
    lengths = jnp.array([5, 3], jnp.int32)
    variables = _init_same_layout(flax_m, vj_m, tokens, lengths)
    # The cells are constructed in the compact parent, so it adopts them (not the RNNs).
    assert set(variables["params"]) == {"embed", "LSTMCell_0", "LSTMCell_1"}
    variables = perturb(variables)
    assert_close(vj_m.apply(variables, tokens, lengths), flax_m.apply(variables, tokens, lengths),
                 ATOL)


# ---------------------------------------------------------------------------------------
# 8. raw jax.lax control flow over existing parameters


def lax_program(nn):
    class IteratedDense(nn.Module):
        steps: int = 3

        @nn.compact
        def __call__(self, x):
            dense = nn.Dense(x.shape[-1])
            h = dense(x)  # creates the params before the loop

            def body(i, h):
                return nn.tanh(dense(h)) + jnp.asarray(i, jnp.float32) * 0.1

            return jax.lax.fori_loop(0, self.steps, body, h)

    class ScannedCell(nn.Module):
        features: int = 4

        @nn.compact
        def __call__(self, xs):
            cell = nn.Dense(self.features, name="cell")
            inp = nn.Dense(self.features, name="inp")
            h0 = jnp.zeros((xs.shape[1], self.features), jnp.float32)
            cell(h0), inp(xs[0])  # create both param sets before the scan

            def step(h, x):
                h = nn.tanh(cell(h) + inp(x))
                return h, h

            h, hs = jax.lax.scan(step, h0, xs)
            return h, hs

    class Gated(nn.Module):
        @nn.compact
        def __call__(self, x, flag):
            dense = nn.Dense(x.shape[-1])
            other = nn.Dense(x.shape[-1])
            y, z = dense(x), other(x)
            return y + jax.lax.cond(flag, lambda v: dense(v), lambda v: other(v), z)

    return dict(IteratedDense=IteratedDense, ScannedCell=ScannedCell, Gated=Gated)


def _lax_parity(name, *inputs):
    flax_m, vj_m = _both(lax_program, name=name)
    variables = perturb(_init_same_layout(flax_m, vj_m, *inputs))
    assert_close(vj_m.apply(variables, *inputs), flax_m.apply(variables, *inputs), ATOL)

    def grads(model):
        def loss(params):
            out = model.apply({"params": params}, *inputs)
            return sum(jnp.sum(o ** 2) for o in jax.tree.leaves(out))
        return jax.grad(loss)(variables["params"])

    assert_close(grads(vj_m), grads(flax_m), ATOL)
    return variables


def test_fori_loop_over_existing_dense_matches_flax():
    variables = _lax_parity("IteratedDense", _data((2, 3), seed=20))
    assert set(variables["params"]) == {"Dense_0"}


def test_scan_over_existing_dense_matches_flax():
    variables = _lax_parity("ScannedCell", _data((5, 2, 3), seed=21))
    assert set(variables["params"]) == {"cell", "inp"}


@pytest.mark.parametrize("flag", [True, False])
def test_cond_over_existing_denses_matches_flax(flag):
    _lax_parity("Gated", _data((2, 3), seed=22), jnp.asarray(flag))
