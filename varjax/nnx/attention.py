"""``nnx.MultiHeadAttention`` and NNX's attention functions, over ``varjax.functional.attention``.

The layer declares four ``LinearGeneral`` projections (query, key, value, then out; each
kernel then bias from ``rngs.params()``), so the same seed gives flax.nnx's parameters bit
for bit; between them it calls the shared attention math Linen's layer calls too.  NNX's
attention differs from Linen's in three ways the functions below carry: key/value heads may
be fewer than query heads (grouped-query attention), ``is_causal`` overlays a causal mask,
and without dropout or sown weights the output is ``jax.nn.dot_product_attention``'s
(``fused_dot_product_attention``), as flax.nnx computes it.

Autoregressive decoding keeps ``cached_key``, ``cached_value`` and ``cache_index`` as
``nnx.Cache`` Variables, made by ``init_cache``; each ``decode=True`` call writes one
position (``functional.attention.decode_cache_update``) and attends to those written so far.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from varjax.functional import attention as F
from varjax.functional import initializers
from varjax.functional.attention import combine_masks, make_attention_mask, make_causal_mask
from varjax.ir import errors
from varjax.ir.typing import DotGeneralT, Dtype, Initializer, Metadata, PrecisionLike, Shape, ShardingLike
from varjax.nnx.call_options import first_from, no_out_sharding
from varjax.nnx.linear import NO_METADATA, LinearGeneral, default_kernel_init, functional_promote
from varjax.nnx.linear import promote_dtype as default_promote_dtype
from varjax.nnx.module import Module
from varjax.nnx.normalization import LayerNorm
from varjax.nnx.pytree import data
from varjax.nnx.variablelib import Cache, Intermediate
from varjax.trace.rngs import Rngs, RngStream

__all__ = ["MultiHeadAttention", "dot_product_attention", "dot_product_attention_weights",
           "make_attention_mask", "make_causal_mask", "combine_masks"]

Array = jax.Array
PromoteDtypeFn = Callable[..., tuple[Any, ...]]


def _sower(module: Module | None) -> Callable[[Array], Any] | None:
    """The ``record`` callback sowing the weights into ``module`` as NNX does (an
    ``Intermediate`` named ``attention_weights``)."""
    return None if module is None else functools.partial(module.sow, Intermediate,
                                                         "attention_weights")


def dot_product_attention_weights(
    query: Array, key: Array, bias: Array | None = None, mask: Array | None = None,
    broadcast_dropout: bool = True, dropout_rng: Array | None = None, dropout_rate: float = 0.0,
    deterministic: bool = False, dtype: Dtype | None = None, precision: PrecisionLike = None,
    module: Module | None = None, promote_dtype: PromoteDtypeFn = default_promote_dtype,
    is_causal: bool = False,
) -> Array:
    """Softmax attention weights ``[batch..., heads, q_length, kv_length]`` of ``query``
    and ``key`` (``[batch..., length, heads, depth]``; the key may have fewer heads, a
    divisor of the query's).  ``mask`` is False where a weight is excluded; ``is_causal``
    also excludes later keys.  With ``module``, the weights (before dropout) are sown into
    it as the ``Intermediate`` ``attention_weights``."""
    return F.dot_product_attention_weights(
        query, key, bias, mask, broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
        dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype, precision=precision,
        record=_sower(module), is_causal=is_causal, grouped=True,
        promote_dtype=functional_promote(promote_dtype))


def dot_product_attention(
    query: Array, key: Array, value: Array, bias: Array | None = None, mask: Array | None = None,
    broadcast_dropout: bool = True, dropout_rng: Array | None = None, dropout_rate: float = 0.0,
    deterministic: bool = False, dtype: Dtype | None = None, precision: PrecisionLike = None,
    module: Module | None = None, promote_dtype: PromoteDtypeFn = default_promote_dtype,
    is_causal: bool = False,
) -> Array:
    """Attention output ``[batch..., q_length, heads, v_depth]``; the arguments are
    ``dot_product_attention_weights``'s and ``value`` (``[batch..., kv_length, kv_heads,
    v_depth]``).  Without dropout (``dropout_rate == 0``) or a ``module`` to sow into, the
    output is XLA's fused attention's, as flax.nnx's; otherwise the weights are computed and
    mixed with the values explicitly."""
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    if dropout_rate == 0.0 and module is None:
        return F.fused_dot_product_attention(query, key, value, bias, mask, is_causal=is_causal)
    return F.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
        dtype=query.dtype, precision=precision, record=_sower(module), is_causal=is_causal,
        grouped=True, promote_dtype=functional_promote(promote_dtype))


def _bad_input(what: str, name: str, fix: str) -> errors.ConfigError:
    return errors.ConfigError(f"MultiHeadAttention: {what}", path=(name,), **errors.where(),
                              fix=fix)


class MultiHeadAttention(Module):
    """Multi-head attention: ``inputs_q`` projected to ``num_heads`` query heads and
    ``inputs_k``/``inputs_v`` (default: the query's input, self-attention) to
    ``num_kv_heads`` key and value heads of ``qkv_features // num_heads`` features by the
    ``LinearGeneral``s ``query``, ``key``, ``value``; ``attention_fn`` (this module's
    ``dot_product_attention``) mixes them and ``out`` merges the heads.  ``normalize_qk``
    adds ``LayerNorm``s ``query_ln``/``key_ln`` over each head's features.  With dropout,
    the layer forks ``rngs.dropout`` at construction (``keep_rngs``) and draws each mask's
    key from it."""

    def __init__(
        self, num_heads: int, in_features: int, qkv_features: int | None = None,
        out_features: int | None = None, num_kv_heads: int | None = None,
        in_kv_features: int | None = None, *, dtype: Dtype | None = None,
        param_dtype: Dtype = jnp.float32, broadcast_dropout: bool = True,
        dropout_rate: float = 0.0, deterministic: bool | None = None,
        precision: PrecisionLike = None, kernel_init: Initializer = default_kernel_init,
        out_kernel_init: Initializer | None = None,
        bias_init: Initializer = initializers.zeros_init(),
        out_bias_init: Initializer | None = None, use_bias: bool = True,
        attention_fn: Callable[..., Array] = dot_product_attention, decode: bool | None = None,
        normalize_qk: bool = False, qkv_promote_dtype: PromoteDtypeFn = default_promote_dtype,
        out_promote_dtype: PromoteDtypeFn = default_promote_dtype,
        ln_promote_dtype: PromoteDtypeFn = default_promote_dtype,
        qkv_dot_general: DotGeneralT | None = None, out_dot_general: DotGeneralT | None = None,
        qkv_dot_general_cls: Callable[[], DotGeneralT] | None = None,
        out_dot_general_cls: Callable[[], DotGeneralT] | None = None,
        rngs: Rngs, keep_rngs: bool = True,
        kernel_metadata: Metadata = NO_METADATA, out_kernel_metadata: Metadata = NO_METADATA,
        bias_metadata: Metadata = NO_METADATA, out_bias_metadata: Metadata = NO_METADATA,
        query_ln_scale_metadata: Metadata = NO_METADATA,
        key_ln_scale_metadata: Metadata = NO_METADATA,
    ):
        self.num_heads, self.in_features = num_heads, in_features
        self.qkv_features = in_features if qkv_features is None else qkv_features
        self.out_features = in_features if out_features is None else out_features
        self.in_kv_features = in_features if in_kv_features is None else in_kv_features
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % self.num_kv_heads:
            raise _bad_input(f"num_heads ({num_heads}) must be divisible by num_kv_heads "
                             f"({self.num_kv_heads}).", "num_kv_heads",
                             "give num_kv_heads a divisor of num_heads")
        if self.qkv_features % num_heads:
            raise _bad_input(f"qkv_features ({self.qkv_features}) must be divisible by "
                             f"num_heads ({num_heads}).", "qkv_features",
                             "give qkv_features a multiple of num_heads")
        self.dtype, self.param_dtype = dtype, param_dtype
        self.broadcast_dropout, self.dropout_rate = broadcast_dropout, dropout_rate
        self.deterministic, self.precision, self.use_bias = deterministic, precision, use_bias
        self.attention_fn, self.decode, self.normalize_qk = attention_fn, decode, normalize_qk
        self.qkv_promote_dtype, self.out_promote_dtype = qkv_promote_dtype, out_promote_dtype
        self.ln_promote_dtype = ln_promote_dtype
        self.qkv_dot_general, self.out_dot_general = qkv_dot_general, out_dot_general
        self.qkv_dot_general_cls, self.out_dot_general_cls = qkv_dot_general_cls, out_dot_general_cls
        self.head_dim = self.qkv_features // num_heads

        projection = functools.partial(
            LinearGeneral, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
            bias_init=bias_init, use_bias=use_bias, precision=precision,
            promote_dtype=qkv_promote_dtype, dot_general=qkv_dot_general,
            dot_general_cls=qkv_dot_general_cls, kernel_metadata=kernel_metadata,
            bias_metadata=bias_metadata, rngs=rngs)
        self.query = projection(in_features, out_features=(num_heads, self.head_dim))
        self.key = projection(self.in_kv_features, out_features=(self.num_kv_heads, self.head_dim))
        self.value = projection(self.in_kv_features,
                                out_features=(self.num_kv_heads, self.head_dim))
        if normalize_qk:   # ViT-22B's QK normalization (arxiv.org/abs/2302.05442)
            norm = functools.partial(LayerNorm, self.head_dim, use_bias=False, dtype=dtype,
                                     param_dtype=param_dtype, promote_dtype=ln_promote_dtype,
                                     rngs=rngs)
            self.query_ln = norm(scale_metadata=query_ln_scale_metadata)
            self.key_ln = norm(scale_metadata=key_ln_scale_metadata)
        else:
            self.query_ln, self.key_ln = data(None), data(None)
        self.out = LinearGeneral(
            in_features=(num_heads, self.head_dim), out_features=self.out_features,
            axis=(-2, -1), kernel_init=out_kernel_init or kernel_init,
            bias_init=out_bias_init or bias_init, use_bias=use_bias, dtype=dtype,
            param_dtype=param_dtype, precision=precision, promote_dtype=out_promote_dtype,
            dot_general=out_dot_general, dot_general_cls=out_dot_general_cls, rngs=rngs,
            kernel_metadata=out_kernel_metadata or kernel_metadata,
            bias_metadata=out_bias_metadata or bias_metadata)
        self.rngs = rngs.dropout.fork() if keep_rngs and dropout_rate > 0 else data(None)
        self.cached_key, self.cached_value, self.cache_index = data(None), data(None), data(None)

    def __call__(
        self, inputs_q: Array, inputs_k: Array | None = None, inputs_v: Array | None = None, *,
        mask: Array | None = None, deterministic: bool | None = None,
        rngs: Rngs | RngStream | None = None, sow_weights: bool = False,
        decode: bool | None = None, is_causal: bool = False, out_sharding: ShardingLike | None = None,
        qkv_sharding: ShardingLike | None = None,
    ) -> Array:
        """``[batch..., length, out_features]``.  ``mask`` (``[batch..., heads, q_length,
        kv_length]``, False to exclude) and ``is_causal`` restrict what each query sees;
        ``deterministic``, ``rngs`` and ``decode`` override the module's; ``sow_weights``
        keeps the attention weights as the ``Intermediate`` ``attention_weights``."""
        no_out_sharding("MultiHeadAttention", out_sharding)
        no_out_sharding("MultiHeadAttention", qkv_sharding, name="qkv_sharding")
        if inputs_k is None:
            if inputs_v is not None:
                raise _bad_input("inputs_k cannot be None when inputs_v is given.", "inputs_k",
                                 "pass the key input as inputs_k (inputs_v defaults to it)")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        if inputs_q.shape[-1] != self.in_features:
            raise _bad_input(f"inputs_q has {inputs_q.shape[-1]} features but the module "
                             f"expects in_features={self.in_features}.", "inputs_q",
                             "pass inputs whose last axis is in_features")
        query, key = self.query(inputs_q), self.key(inputs_k)
        value = self.value(inputs_v)
        if self.normalize_qk:
            query, key = self.query_ln(query), self.key_ln(key)
        if first_from(decode, self.decode, name="decode",
                      fix="pass decode= to MultiHeadAttention or its call"):
            key, value, mask = self._decode_step(key, value, mask)
        deterministic, dropout_rng = self._dropout(deterministic, rngs)
        x = self.attention_fn(
            query, key, value, mask=mask, dropout_rng=dropout_rng,
            dropout_rate=self.dropout_rate, broadcast_dropout=self.broadcast_dropout,
            deterministic=deterministic, dtype=self.dtype, precision=self.precision,
            module=self if sow_weights else None, is_causal=is_causal)
        return self.out(x)

    def _decode_step(self, key: Array, value: Array, mask: Array | None
                     ) -> tuple[Array, Array, Array | None]:
        """Writes this position's key and value into the caches and advances the index;
        returns the caches and ``mask`` narrowed to the positions written so far."""
        if self.cached_key is None or self.cached_value is None or self.cache_index is None:
            raise _bad_input("the autoregressive cache is not initialized.", "cached_key",
                             "call init_cache(input_shape) before calling with decode=True")
        *batch_dims, _, num_kv_heads, depth = self.cached_key.shape
        expected = (*batch_dims, 1, num_kv_heads, depth)
        if key.shape != expected:
            raise errors.ConfigError(
                f"MultiHeadAttention: a decode step takes one position: its key is "
                f"{key.shape}, the cache expects {expected}.", collection="cache",
                path=("cached_key",), **errors.where(),
                fix="pass one token per call ([batch..., 1, features]) with the batch "
                    "shape given to init_cache")
        index = self.cache_index[...]
        key, value, written = F.decode_cache_update(self.cached_key[...], self.cached_value[...],
                                                    index, key, value)
        self.cached_key[...], self.cached_value[...] = key, value
        self.cache_index[...] = index + 1
        return key, value, combine_masks(mask, written)

    def _dropout(self, deterministic: bool | None, rngs: Rngs | RngStream | None
                 ) -> tuple[bool, Array | None]:
        """``(deterministic, key)`` for the weights' dropout: a mode is needed only with a
        ``dropout_rate``, a key only when not deterministic (the call's ``rngs``, else the
        stream forked at construction)."""
        if self.dropout_rate <= 0.0:
            return True, None
        deterministic = first_from(
            deterministic, self.deterministic, name="deterministic",
            fix="pass deterministic= to MultiHeadAttention or its call, or call "
                "model.train()/eval()")
        if deterministic:
            return True, None
        stream = rngs.dropout if isinstance(rngs, Rngs) else rngs
        stream = stream if stream is not None else self.rngs
        if stream is None:
            raise _bad_input("dropout needs rngs: none was given at the call and the module "
                             "keeps none (keep_rngs=False).", "rngs",
                             "pass rngs= to the call, or construct with keep_rngs=True")
        return False, stream()

    def init_cache(self, input_shape: Shape, dtype: Dtype = jnp.float32) -> None:
        """Makes the decode cache for inputs of ``input_shape`` (``[batch..., max_length,
        features]``): ``cached_key``/``cached_value`` of zeros ``[batch..., max_length,
        num_kv_heads, head_dim]`` and ``cache_index`` 0, each an ``nnx.Cache``."""
        shape = (*input_shape[:-1], self.num_kv_heads, self.head_dim)
        self.cached_key = Cache(jnp.zeros(shape, dtype))
        self.cached_value = Cache(jnp.zeros(shape, dtype))
        self.cache_index = Cache(jnp.array(0, dtype=jnp.int32))

    def set_view(self, deterministic: bool | None = None, decode: bool | None = None,
                 batch_size: int | Shape | None = None, max_length: int | None = None) -> None:
        """What ``nnx.view`` sets on this layer of the copy.  ``batch_size`` and
        ``max_length`` are flax.nnx's: in 0.12.8 its cache attributes exist from
        construction, so they make no cache there, and none here (``init_cache`` does).

        Args:
          deterministic: if True, the module is set to deterministic mode.
          decode: if True, the module is set to decode mode.
          batch_size: the batch size to use for the cache.
          max_length: the max length to use for the cache.
        """
        if deterministic is not None:
            self.deterministic = deterministic
        if decode is not None:
            self.decode = decode
