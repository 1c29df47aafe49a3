"""Port of Flax's WMT example: a transformer encoder-decoder with pre-layer-norm blocks,
an embedding shared by encoder and decoder (made in ``setup`` and passed to both as a
field) that also gives the logits (``Embed.attend``), padding and causal masks, and
``encode``/``decode`` methods; decoding runs one token at a time against a ``cache``
collection (attention keys and values, position index).

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

    class Encoder1DBlock(nn.Module):
        config: Config

        @nn.compact
        def __call__(self, inputs, mask):
            c = self.config
            x = parts.attention(c)(nn.LayerNorm()(inputs), mask=mask)
            x = nn.Dropout(c.dropout_rate)(x, deterministic=c.deterministic) + inputs
            return x + parts.MlpBlock(c)(nn.LayerNorm()(x))

    class EncoderDecoder1DBlock(nn.Module):
        config: Config

        @nn.compact
        def __call__(self, targets, encoded, decoder_mask, encoder_decoder_mask):
            c = self.config
            x = parts.attention(c, decode=c.decode)(nn.LayerNorm()(targets), mask=decoder_mask)
            x = nn.Dropout(c.dropout_rate)(x, deterministic=c.deterministic) + targets
            y = parts.attention(c)(nn.LayerNorm()(x), encoded, mask=encoder_decoder_mask)
            y = nn.Dropout(c.dropout_rate)(y, deterministic=c.deterministic) + x
            return y + parts.MlpBlock(c)(nn.LayerNorm()(y))

    class Encoder(nn.Module):
        config: Config
        shared_embedding: nn.Module

        @nn.compact
        def __call__(self, inputs, mask):
            c = self.config
            x = self.shared_embedding(inputs.astype("int32"))
            x = parts.AddPositionEmbs(c, name="posembed_input")(x)
            x = nn.Dropout(c.dropout_rate)(x, deterministic=c.deterministic)
            for layer in range(c.num_layers):
                x = Encoder1DBlock(c, name=f"encoderblock_{layer}")(x, mask)
            return nn.LayerNorm(name="encoder_norm")(x)

    class Decoder(nn.Module):
        config: Config
        shared_embedding: nn.Module

        @nn.compact
        def __call__(self, encoded, targets, decoder_mask, encoder_decoder_mask):
            c = self.config
            y = targets.astype("int32")
            if not c.decode:
                y = shift_right(y)
            y = self.shared_embedding(y)
            y = parts.AddPositionEmbs(c, decode=c.decode, name="posembed_output")(y)
            y = nn.Dropout(c.dropout_rate)(y, deterministic=c.deterministic)
            for layer in range(c.num_layers):
                y = EncoderDecoder1DBlock(c, name=f"encoderdecoderblock_{layer}")(
                    y, encoded, decoder_mask, encoder_decoder_mask)
            y = nn.LayerNorm(name="encoderdecoder_norm")(y)
            return self.shared_embedding.attend(y) / jnp.sqrt(jnp.float32(y.shape[-1]))

    class Transformer(nn.Module):
        config: Config

        def setup(self):
            c = self.config
            self.shared_embedding = nn.Embed(c.vocab_size, c.emb_dim,
                                             embedding_init=nn.initializers.normal(1.0))
            self.encoder = Encoder(c, self.shared_embedding)
            self.decoder = Decoder(c, self.shared_embedding)

        def encode(self, inputs):
            mask = nn.make_attention_mask(inputs > 0, inputs > 0, dtype=jnp.float32)
            return self.encoder(inputs, mask)

        def decode(self, encoded, inputs, targets):
            if self.config.decode:
                decoder_mask = None
                encoder_decoder_mask = nn.make_attention_mask(
                    jnp.ones_like(targets) > 0, inputs > 0, dtype=jnp.float32)
            else:
                decoder_mask = nn.combine_masks(
                    nn.make_attention_mask(targets > 0, targets > 0, dtype=jnp.float32),
                    nn.make_causal_mask(targets, dtype=jnp.float32))
                encoder_decoder_mask = nn.make_attention_mask(targets > 0, inputs > 0,
                                                              dtype=jnp.float32)
            return self.decoder(encoded, targets, decoder_mask, encoder_decoder_mask)

        def __call__(self, inputs, targets):
            return self.decode(self.encode(inputs), inputs, targets)

    return Transformer


CONFIG = Config(share_embeddings=True, logits_via_embedding=True)
INPUTS = tokens((2, 6), 11).at[1, 4:].set(0)
TARGETS = tokens((2, 8), 11, seed=1).at[0, 6:].set(0)


def _loss(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, TARGETS).mean()


def test_wmt_init_train_grads_and_decode_cache_equal_linen():
    # Init in decode mode makes the params (as without it) and the empty cache.
    decoder = Port(build, dataclasses.replace(CONFIG, decode=True))
    variables = perturb(check_init(decoder, KEY, INPUTS, TARGETS))
    params, cache = variables["params"], variables["cache"]
    train = Port(build, dataclasses.replace(CONFIG, deterministic=False))
    check_train(train, {"params": params}, _loss, INPUTS, TARGETS, rngs=DROPOUT)
    encoded = check_apply(decoder, {"params": params}, INPUTS, method="encode")
    token = jnp.zeros((2, 1), jnp.int32)
    for _ in range(3):
        logits, mutated = check_apply(decoder, {"params": params, "cache": cache}, encoded,
                                      INPUTS, token, method="decode", mutable=["cache"])
        cache = mutated["cache"]
        token = jnp.argmax(logits, -1).astype(jnp.int32)
    assert int(cache["decoder"]["posembed_output"]["cache_index"]) == 3
