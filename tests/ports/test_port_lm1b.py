"""Port of Flax's LM1B example: a decoder-only transformer language model (embedding,
sinusoidal positions, pre-layer-norm self-attention blocks under a padding-and-causal mask,
a dense vocabulary head), decoding one token at a time against a ``cache`` collection.

As in the example, every initializer is annotated with logical axis names
(``nn.with_logical_partitioning``): ``('vocab', 'embed')`` on the embedding,
``('embed',)`` on the layer norms' scales and biases, ``('embed', 'kv')`` on every
attention kernel (the out projection's ``(heads, head_dim, embed)`` kernel too: the example
gives one initializer to all four), ``('embed', 'mlp')``/``('mlp', 'embed')`` on the MLP
kernels, ``('embed', 'vocab')`` on the logit head.  The example has no activation
constraints (``nn.with_logical_constraint``) in its model, so neither has the port.  Its
self-attention is ``nn.SelfAttention`` (deprecated by Linen, which warns), hence the
auto-name ``SelfAttention_0``.

Small config (``transformer_parts.Config``): vocabulary 11, width 8, 2 heads, 1 layer,
length 8.  The sharded test runs the example's recipe (``utils.setup_initial_state``, the
jitted ``train_step``) on a ``(1, 2)`` mesh ``('data', 'model')`` of the 2 host CPU
devices, under the example's logical axis rules with its ``tensor`` axis named ``model``
and its ``fsdp`` axis folded into ``data``, with a vocabulary of 12: ``jax.jit`` rejects
``out_shardings`` that split 11 rows over 2 devices.  Its training step takes the boxed
variables (the example unboxes them first), so their reads are constrained to the rules'
shardings in both libraries.
"""
import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from port_checks import (
    DROPOUT,
    KEY,
    Port,
    check_apply,
    check_init,
    check_sharded_init,
    check_sharded_train,
    check_train,
    perturb,
    tokens,
)
from transformer_parts import Config, build_parts, shift_right

pytestmark = pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")


def build(nn):
    parts = build_parts(nn, logical_partitioning=True)

    def layer_norm(**kwargs):
        return nn.LayerNorm(
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            **kwargs)

    class DecoderBlock(nn.Module):
        config: Config

        @nn.compact
        def __call__(self, inputs, mask):
            c = self.config
            x = nn.SelfAttention(
                num_heads=c.num_heads, qkv_features=c.qkv_dim,
                kernel_init=nn.with_logical_partitioning(c.kernel_init, ("embed", "kv")),
                bias_init=nn.with_logical_partitioning(c.bias_init, ("embed",)),
                use_bias=False, broadcast_dropout=False,
                dropout_rate=c.attention_dropout_rate, deterministic=c.deterministic,
                decode=c.decode)(layer_norm()(inputs), mask)
            x = nn.Dropout(c.dropout_rate)(x, deterministic=c.deterministic) + inputs
            return x + parts.MlpBlock(c)(layer_norm()(x))

    class Decoder(nn.Module):
        config: Config

        @nn.compact
        def __call__(self, inputs, mask):
            c = self.config
            y = inputs.astype("int32")
            if not c.decode:
                y = shift_right(y)
            y = nn.Embed(c.output_vocab_size, c.emb_dim,
                         embedding_init=nn.with_logical_partitioning(
                             nn.initializers.normal(stddev=1.0), ("vocab", "embed")))(y)
            y = parts.AddPositionEmbs(c, decode=c.decode, name="posembed_output")(y)
            y = nn.Dropout(c.dropout_rate)(y, deterministic=c.deterministic)
            for layer in range(c.num_layers):
                y = DecoderBlock(c, name=f"encoderdecoderblock_{layer}")(y, mask)
            y = layer_norm(name="encoderdecoder_norm")(y)
            return nn.Dense(c.output_vocab_size,
                            kernel_init=nn.with_logical_partitioning(c.kernel_init,
                                                                     ("embed", "vocab")),
                            bias_init=nn.with_logical_partitioning(c.bias_init, ("vocab",)),
                            name="logitdense")(y)

    class TransformerLM(nn.Module):
        config: Config

        @nn.compact
        def __call__(self, inputs):
            mask = None
            if not self.config.decode:
                mask = nn.combine_masks(
                    nn.make_attention_mask(inputs > 0, inputs > 0, dtype=jnp.float32),
                    nn.make_causal_mask(inputs, dtype=jnp.float32))
            return Decoder(self.config, name="decoder")(inputs, mask)

    return TransformerLM


TEXT = tokens((2, 8), 11).at[1, 5:].set(0)
# The example's rules (configs/default.py), its 'tensor' axis named 'model' and its
# 'fsdp' axis folded into 'data'.
RULES = (("mlp", "model"), ("vocab", "model"), ("embed", "data"), ("heads", "model"))


def _loss(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, TEXT).mean()


def test_lm1b_init_train_grads_and_decode_cache_equal_linen():
    # Init in decode mode makes the params (as without it) and the empty cache.
    decoder = Port(build, dataclasses.replace(Config(), decode=True))
    variables = perturb(check_init(decoder, KEY, TEXT))
    params, cache = variables["params"], variables["cache"]
    train = Port(build, Config(deterministic=False))
    check_train(train, {"params": params}, _loss, TEXT, rngs=DROPOUT)
    token = jnp.zeros((2, 1), jnp.int32)
    for _ in range(3):
        logits, mutated = check_apply(decoder, {"params": params, "cache": cache}, token,
                                      mutable=["cache"])
        cache = mutated["cache"]
        token = jnp.argmax(logits, -1).astype(jnp.int32)
    assert int(cache["decoder"]["posembed_output"]["cache_index"]) == 3


def test_lm1b_sharded_init_and_train_step_equal_linen():
    mesh = jax.make_mesh((1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    # The example inits with its eval config (no cache) and trains with dropout.
    config = Config(vocab_size=12, output_vocab_size=12)
    (got, want), placed = check_sharded_init(Port(build, config), mesh, RULES, KEY, TEXT)
    kernel = want["params"]["decoder"]["encoderdecoderblock_0"]["MlpBlock_0"]["Dense_0"]["kernel"]
    assert kernel.value.sharding.spec == PartitionSpec("data", "model")
    check_sharded_train(Port(build, dataclasses.replace(config, deterministic=False)), mesh, RULES,
                        (perturb(got), perturb(want)), placed, _loss, TEXT,
                        arg_shardings=NamedSharding(mesh, PartitionSpec("data")), rngs=DROPOUT)
