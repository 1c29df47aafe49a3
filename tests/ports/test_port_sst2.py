"""Port of Flax's SST-2 example: a text classifier built from an embedder with word dropout
and dropout (``nn.module.merge_param`` for ``deterministic``), a bidirectional LSTM whose
two directions are ``nn.transforms.scan`` over ``nn.OptimizedLSTMCell`` (params broadcast,
time on axis 1, carry made by a detached cell's ``initialize_carry``), sequences flipped
within their lengths, and a keys-only MLP attention (sowing its scores) feeding an MLP.

Small config: vocabulary 10, embeddings 6, hidden size 5, 2 classes, 2 sentences of 4.
"""
import functools

import jax
import jax.numpy as jnp
import optax
from port_checks import DROPOUT, KEY, Port, check_apply, check_init, check_train, perturb, tokens


def build(nn):
    @jax.vmap
    def flip_sequences(inputs, lengths):
        return jnp.flip(jnp.roll(inputs, inputs.shape[0] - lengths, axis=0), axis=0)

    class WordDropout(nn.Module):
        rate: float
        unk_idx: int
        deterministic: bool | None = None

        @nn.compact
        def __call__(self, inputs, deterministic=None):
            deterministic = nn.module.merge_param("deterministic", self.deterministic,
                                                  deterministic)
            if deterministic or self.rate == 0.0:
                return inputs
            mask = jax.random.bernoulli(self.make_rng("dropout"), self.rate, inputs.shape)
            return jnp.where(mask, jnp.array([self.unk_idx]), inputs)

    class Embedder(nn.Module):
        vocab_size: int
        embedding_size: int
        rate: float
        word_rate: float
        unk_idx: int

        def setup(self):
            self.embedding = self.param("embedding", nn.initializers.normal(stddev=0.1),
                                        (self.vocab_size, self.embedding_size), jnp.float32)
            self.dropout_layer = nn.Dropout(rate=self.rate)
            self.word_dropout_layer = WordDropout(self.word_rate, self.unk_idx)

        def __call__(self, inputs, deterministic=None):
            inputs = self.word_dropout_layer(inputs, deterministic=deterministic)
            return self.dropout_layer(self.embedding[inputs], deterministic=deterministic)

    class SimpleLSTM(nn.Module):
        hidden_size: int

        @functools.partial(nn.transforms.scan, variable_broadcast="params", in_axes=1,
                           out_axes=1, split_rngs={"params": False})
        @nn.compact
        def __call__(self, carry, x):
            return nn.OptimizedLSTMCell(self.hidden_size)(carry, x)

        def initialize_carry(self, input_shape):
            cell = nn.OptimizedLSTMCell(self.hidden_size, parent=None)
            return cell.initialize_carry(jax.random.key(0), input_shape)

    class SimpleBiLSTM(nn.Module):
        hidden_size: int

        def setup(self):
            self.forward_lstm = SimpleLSTM(self.hidden_size)
            self.backward_lstm = SimpleLSTM(self.hidden_size)

        def __call__(self, embedded, lengths):
            carry = self.forward_lstm.initialize_carry(embedded[:, 0].shape)
            _, forward = self.forward_lstm(carry, embedded)
            reversed_inputs = flip_sequences(embedded, lengths)
            carry = self.backward_lstm.initialize_carry(reversed_inputs[:, 0].shape)
            _, backward = self.backward_lstm(carry, reversed_inputs)
            return jnp.concatenate([forward, flip_sequences(backward, lengths)], -1)

    class MLP(nn.Module):
        hidden_size: int
        output_size: int
        rate: float

        def setup(self):
            self.intermediate_layer = nn.Dense(self.hidden_size)
            self.output_layer = nn.Dense(self.output_size, use_bias=False)
            self.dropout_layer = nn.Dropout(rate=self.rate)

        def __call__(self, inputs, deterministic=None):
            hidden = nn.tanh(self.intermediate_layer(inputs))
            return self.output_layer(self.dropout_layer(hidden, deterministic=deterministic))

    class KeysOnlyMlpAttention(nn.Module):
        hidden_size: int

        @nn.compact
        def __call__(self, keys, mask):
            hidden = nn.Dense(self.hidden_size, name="keys", use_bias=False)(keys)
            scores = nn.Dense(1, name="energy", use_bias=False)(nn.tanh(hidden)).squeeze(-1)
            scores = nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
            self.sow("intermediates", "attention", scores)
            return scores

    class AttentionClassifier(nn.Module):
        hidden_size: int
        output_size: int
        rate: float

        def setup(self):
            self.dropout_layer = nn.Dropout(rate=self.rate)
            self.keys_only_mlp_attention = KeysOnlyMlpAttention(self.hidden_size)
            self.mlp = MLP(self.hidden_size, self.output_size, self.rate)

        def __call__(self, encoded, lengths, deterministic=None):
            encoded = self.dropout_layer(encoded, deterministic=deterministic)
            mask = jnp.arange(encoded.shape[1])[None] < lengths[:, None]
            attention = self.keys_only_mlp_attention(encoded, mask)
            context = (jnp.expand_dims(attention, 1) @ encoded).squeeze(1)
            context = self.dropout_layer(context, deterministic=deterministic)
            return self.mlp(context, deterministic=deterministic)

    class TextClassifier(nn.Module):
        embedding_size: int = 6
        hidden_size: int = 5
        vocab_size: int = 10
        output_size: int = 2
        rate: float = 0.5
        word_rate: float = 0.3
        unk_idx: int = 1
        deterministic: bool | None = None

        def setup(self):
            self.embedder = Embedder(self.vocab_size, self.embedding_size, self.rate,
                                     self.word_rate, self.unk_idx)
            self.encoder = SimpleBiLSTM(self.hidden_size)
            self.classifier = AttentionClassifier(self.hidden_size, self.output_size,
                                                  self.rate)

        def __call__(self, token_ids, lengths, deterministic=None):
            deterministic = nn.module.merge_param("deterministic", self.deterministic,
                                                  deterministic)
            embedded = self.embedder(token_ids, deterministic=deterministic)
            encoded = self.encoder(embedded, lengths)
            return self.classifier(encoded, lengths, deterministic=deterministic)

    return TextClassifier


TOKENS = tokens((2, 4), 10, low=2)
LENGTHS = jnp.asarray([4, 2], jnp.int32)
LABELS = jnp.asarray([0, 1], jnp.int32)


def _loss(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()


def test_sst2_init_eval_attention_train_and_grads_equal_linen():
    port = Port(build)
    variables = perturb(check_init(port, KEY, TOKENS, LENGTHS, deterministic=True))
    check_apply(port, variables, TOKENS, LENGTHS, deterministic=True, mutable=["intermediates"])
    check_train(port, variables, _loss, TOKENS, LENGTHS, deterministic=False, rngs=DROPOUT)
