"""Pieces shared by the WMT and LM1B transformer ports (Flax's LM1B example reuses its WMT
decoder the same way): the config, right shift, the sinusoidal position table, position
embeddings with a decode-time ``cache_index``, and the MLP block.  ``build_parts(nn)``
defines the modules over one ``nn`` namespace.

The LM1B example annotates its initializers with logical axis names
(``nn.with_logical_partitioning``) and the WMT example does not, so
``build_parts(nn, logical_partitioning=True)`` gives the LM1B port's MLP block the
annotations its example has, and the default gives the WMT port plain initializers.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True)
class Config:
    """The examples' hyperparameters, at test size."""
    vocab_size: int = 11
    output_vocab_size: int = 11
    share_embeddings: bool = False
    logits_via_embedding: bool = False
    emb_dim: int = 8
    num_heads: int = 2
    num_layers: int = 1
    qkv_dim: int = 8
    mlp_dim: int = 12
    max_len: int = 8
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = True
    decode: bool = False
    kernel_init: Callable = jax.nn.initializers.xavier_uniform()
    bias_init: Callable = jax.nn.initializers.normal(stddev=1e-6)


def shift_right(x: jax.Array, axis: int = 1) -> jax.Array:
    """``x`` moved one step along ``axis``, a zero entering first (teacher-forcing input)."""
    pads = [(0, 0)] * x.ndim
    pads[axis] = (1, 0)
    padded = jnp.pad(x, pads, constant_values=x.dtype.type(0))
    return lax.dynamic_slice_in_dim(padded, 0, padded.shape[axis] - 1, axis)


def sinusoidal_table(max_len: int, d_feature: int) -> jax.Array:
    """``(1, max_len, d_feature)``: sines in the first half of the features, cosines in
    the second, with geometrically spaced frequencies (min scale 1, max scale 1e4)."""
    half = d_feature // 2
    position = np.arange(max_len)[:, None]
    rate = np.exp(np.arange(half) * -np.log(1e4) / (half - 1))
    table = np.zeros((max_len, d_feature), np.float32)
    table[:, :half] = np.sin(position * rate)
    table[:, half:2 * half] = np.cos(position * rate)
    return jnp.asarray(table[None])


def build_parts(nn: Any, logical_partitioning: bool = False) -> SimpleNamespace:
    def annotated(init: Callable, names: tuple) -> Callable:
        """``init`` boxed with the logical axis ``names`` (as Flax's LM1B example does) when
        ``logical_partitioning``; otherwise as it is (the WMT example)."""
        return nn.with_logical_partitioning(init, names) if logical_partitioning else init

    class AddPositionEmbs(nn.Module):
        """Adds the sinusoidal table; in decode mode, the row of the step being decoded."""
        config: Config
        decode: bool = False

        @nn.compact
        def __call__(self, inputs):
            table = sinusoidal_table(self.config.max_len, inputs.shape[-1])
            pe = table[:, :inputs.shape[1], :]
            if self.decode:
                initialized = self.has_variable("cache", "cache_index")
                index = self.variable("cache", "cache_index",
                                      lambda: jnp.array(0, dtype=jnp.uint32))
                if initialized:
                    i = index.value
                    index.value = i + 1
                    pe = lax.dynamic_slice(table, jnp.array((0, i, 0)),
                                           (1, 1, table.shape[-1]))
            return inputs + pe

    class MlpBlock(nn.Module):
        config: Config

        @nn.compact
        def __call__(self, inputs):
            c = self.config
            x = nn.Dense(c.mlp_dim, kernel_init=annotated(c.kernel_init, ("embed", "mlp")),
                         bias_init=annotated(c.bias_init, ("mlp",)))(inputs)
            x = nn.Dropout(c.dropout_rate)(nn.relu(x), deterministic=c.deterministic)
            x = nn.Dense(inputs.shape[-1],
                         kernel_init=annotated(c.kernel_init, ("mlp", "embed")),
                         bias_init=annotated(c.bias_init, ("embed",)))(x)
            return nn.Dropout(c.dropout_rate)(x, deterministic=c.deterministic)

    def attention(config: Config, decode: bool = False):
        return nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads, qkv_features=config.qkv_dim,
            kernel_init=config.kernel_init, bias_init=config.bias_init, use_bias=False,
            broadcast_dropout=False, dropout_rate=config.attention_dropout_rate,
            deterministic=config.deterministic, decode=decode)

    return SimpleNamespace(AddPositionEmbs=AddPositionEmbs, MlpBlock=MlpBlock,
                           attention=attention)
