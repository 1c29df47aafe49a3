"""Port of Flax's nlp_seq example (part-of-speech tagging): a transformer encoder over token
embeddings with interleaved sinusoidal positions, pre-layer-norm blocks (self-attention,
an ELU MLP), dropout switched by the ``train`` argument, and a dense tag head per token.

Small config: vocabulary 11, 5 tags, width 8, 2 heads, 1 layer, sentences of 6.
"""
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from port_checks import DROPOUT, KEY, Port, check_apply, check_init, check_train, perturb, tokens


@dataclasses.dataclass(frozen=True)
class TaggerConfig:
    vocab_size: int = 11
    output_vocab_size: int = 5
    emb_dim: int = 8
    num_heads: int = 2
    num_layers: int = 1
    qkv_dim: int = 8
    mlp_dim: int = 12
    max_len: int = 6
    dropout_rate: float = 0.3
    attention_dropout_rate: float = 0.3
    kernel_init: Callable = jax.nn.initializers.xavier_uniform()
    bias_init: Callable = jax.nn.initializers.normal(stddev=1e-6)


def _interleaved_sinusoids(max_len, d_feature):
    """``(1, max_len, d_feature)``: sines on even features, cosines on odd ones."""
    position = np.arange(max_len)[:, None]
    rate = np.exp(np.arange(0, d_feature, 2) * -(np.log(1e4) / d_feature))
    table = np.zeros((max_len, d_feature), np.float32)
    table[:, 0::2] = np.sin(position * rate)
    table[:, 1::2] = np.cos(position * rate)
    return jnp.asarray(table[None])


def build(nn):
    class MlpBlock(nn.Module):
        config: TaggerConfig

        @nn.compact
        def __call__(self, inputs, deterministic):
            c = self.config
            x = nn.Dense(c.mlp_dim, kernel_init=c.kernel_init, bias_init=c.bias_init)(inputs)
            x = nn.Dropout(c.dropout_rate)(nn.elu(x), deterministic=deterministic)
            x = nn.Dense(inputs.shape[-1], kernel_init=c.kernel_init,
                         bias_init=c.bias_init)(x)
            return nn.Dropout(c.dropout_rate)(x, deterministic=deterministic)

    class Encoder1DBlock(nn.Module):
        config: TaggerConfig

        @nn.compact
        def __call__(self, inputs, deterministic):
            c = self.config
            x = nn.MultiHeadDotProductAttention(
                num_heads=c.num_heads, qkv_features=c.qkv_dim, kernel_init=c.kernel_init,
                bias_init=c.bias_init, use_bias=False, broadcast_dropout=False,
                dropout_rate=c.attention_dropout_rate, deterministic=deterministic,
            )(nn.LayerNorm()(inputs))
            x = nn.Dropout(c.dropout_rate)(x, deterministic=deterministic) + inputs
            return x + MlpBlock(c)(nn.LayerNorm()(x), deterministic=deterministic)

    class Transformer(nn.Module):
        config: TaggerConfig

        @nn.compact
        def __call__(self, *, inputs, train):
            c = self.config
            x = nn.Embed(c.vocab_size, c.emb_dim, name="embed")(inputs.astype("int32"))
            x = nn.Dropout(c.dropout_rate)(x, deterministic=not train)
            x = x + _interleaved_sinusoids(c.max_len, x.shape[-1])[:, :x.shape[1]]
            for _ in range(c.num_layers):
                x = Encoder1DBlock(c)(x, deterministic=not train)
            x = nn.LayerNorm()(x)
            return nn.Dense(c.output_vocab_size, kernel_init=c.kernel_init,
                            bias_init=c.bias_init)(x)

    return Transformer


SENTENCES = tokens((2, 6), 11)
TAGS = tokens((2, 6), 5, seed=1, low=0)


def _loss(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, TAGS).mean()


def test_nlp_seq_tagger_init_eval_train_and_grads_equal_linen():
    port = Port(build, TaggerConfig())
    variables = perturb(check_init(port, KEY, inputs=SENTENCES, train=False))
    check_apply(port, variables, inputs=SENTENCES, train=False)
    check_train(port, variables, _loss, inputs=SENTENCES, train=True, rngs=DROPOUT)
