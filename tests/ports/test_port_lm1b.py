"""Port of Flax's LM1B example: a decoder-only transformer language model (embedding,
sinusoidal positions, pre-layer-norm self-attention blocks under a padding-and-causal mask,
a dense vocabulary head), decoding one token at a time against a ``cache`` collection.

The example annotates every initializer with ``nn.with_logical_partitioning`` for its
sharded training; those annotations belong to the scale-out issue, so this port writes the
model without them (plain initializers; the values are the same).

Small config (``transformer_parts.Config``): vocabulary 11, width 8, 2 heads, 1 layer,
length 8.
"""
import dataclasses

import jax.numpy as jnp
import optax
from port_checks import DROPOUT, KEY, Port, check_apply, check_init, check_train, perturb, tokens
from transformer_parts import Config, build_parts, shift_right


def build(nn):
    parts = build_parts(nn)

    class DecoderBlock(nn.Module):
        config: Config

        @nn.compact
        def __call__(self, inputs, mask):
            c = self.config
            x = parts.attention(c, decode=c.decode)(nn.LayerNorm()(inputs), mask=mask)
            x = nn.Dropout(c.dropout_rate)(x, deterministic=c.deterministic) + inputs
            return x + parts.MlpBlock(c)(nn.LayerNorm()(x))

    class Decoder(nn.Module):
        config: Config

        @nn.compact
        def __call__(self, inputs, mask):
            c = self.config
            y = inputs.astype("int32")
            if not c.decode:
                y = shift_right(y)
            y = nn.Embed(c.output_vocab_size, c.emb_dim,
                         embedding_init=nn.initializers.normal(stddev=1.0))(y)
            y = parts.AddPositionEmbs(c, decode=c.decode, name="posembed_output")(y)
            y = nn.Dropout(c.dropout_rate)(y, deterministic=c.deterministic)
            for layer in range(c.num_layers):
                y = DecoderBlock(c, name=f"encoderdecoderblock_{layer}")(y, mask)
            y = nn.LayerNorm(name="encoderdecoder_norm")(y)
            return nn.Dense(c.output_vocab_size, kernel_init=c.kernel_init,
                            bias_init=c.bias_init, name="logitdense")(y)

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
