"""Dot-product attention, as ``flax.linen.attention`` defines it.

The functions are ``varjax.functional.attention``'s, with Linen's ``module=`` argument
(the module the weights are sown into); ``MultiHeadDotProductAttention`` adds the
``query``/``key``/``value``/``out`` projections and, with ``decode=True``, an
autoregressive key/value cache in the ``cache`` collection.  Names, defaults,
parameter layout and outputs match Linen, so a Linen checkpoint loads as is.

Sharp edges:
  * Attention dropout draws from the ``dropout`` stream through varjax's RNG,
    so its masks differ from Flax's for the same key; with
    ``deterministic=True`` (or ``dropout_rate=0``) outputs match Flax exactly.
  * A decode step writes the cache: apply with ``mutable=['cache']``.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp

from varjax.functional import attention as F
from varjax.functional.attention import combine_masks as combine_masks
from varjax.functional.attention import make_attention_mask as make_attention_mask
from varjax.functional.attention import make_causal_mask as make_causal_mask
from varjax.ir import errors
from varjax.nn import initializers
from varjax.nn.dtypes import merge_param
from varjax.nn.linear import DenseGeneral, default_kernel_init
from varjax.nn.module import Module, compact, nowrap
from varjax.nn.normalization import LayerNorm
from varjax.nn.typing import DotGeneralT as DotGeneralT
from varjax.nn.typing import Dtype as Dtype
from varjax.nn.typing import Initializer as Initializer
from varjax.nn.typing import PrecisionLike as PrecisionLike
from varjax.nn.typing import PRNGKey as PRNGKey
from varjax.nn.typing import Shape as Shape
from varjax.trace.context import site

__all__ = [
    "dot_product_attention_weights", "dot_product_attention", "make_attention_mask",
    "make_causal_mask", "combine_masks", "MultiHeadDotProductAttention", "MultiHeadAttention",
    "SelfAttention",
]

Array = jax.Array


def _sower(module: Module | None) -> Callable[[Array], Any] | None:
    """The ``record`` callback sowing the weights into ``module``'s ``intermediates``."""
    return None if module is None else functools.partial(module.sow, "intermediates", "attention_weights")


def dot_product_attention_weights(
    query: Array, key: Array, bias: Array | None = None, mask: Array | None = None,
    broadcast_dropout: bool = True, dropout_rng: Array | None = None, dropout_rate: float = 0.0,
    deterministic: bool = False, dtype: Dtype | None = None, precision: PrecisionLike = None,
    module: Module | None = None, force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Array] | None = None,
    einsum: Callable[..., Array] | None = None,
) -> Array:
    """Softmax attention weights ``[batch..., heads, q_length, kv_length]``.

    ``query``/``key`` are ``[batch..., length, heads, depth]``.  ``mask`` is
    ``False`` where a weight is excluded; it and ``bias`` must broadcast to the
    weights' shape.  With ``module`` given, the weights are sown into its
    ``intermediates`` collection as ``attention_weights`` (before dropout), so
    they can be inspected without a second function.
    """
    return F.dot_product_attention_weights(
        query, key, bias, mask, broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
        dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype, precision=precision,
        force_fp32_for_softmax=force_fp32_for_softmax, einsum_dot_general=einsum_dot_general, einsum=einsum,
        record=_sower(module))


def dot_product_attention(
    query: Array, key: Array, value: Array, bias: Array | None = None, mask: Array | None = None,
    broadcast_dropout: bool = True, dropout_rng: Array | None = None, dropout_rate: float = 0.0,
    deterministic: bool = False, dtype: Dtype | None = None, precision: PrecisionLike = None,
    module: Module | None = None, force_fp32_for_softmax: bool = False,
    einsum_dot_general: Callable[..., Array] | None = None,
    qk_attn_weights_einsum: Callable[..., Array] | None = None,
    attn_weights_value_einsum: Callable[..., Array] | None = None,
) -> Array:
    """Attention output ``[batch..., q_length, heads, v_depth]`` (Vaswani et al., 2017).

    ``value`` is ``[batch..., kv_length, heads, v_depth]``; the other arguments
    are those of ``dot_product_attention_weights``.  The two ``*_einsum``
    overrides (given together) replace ``jnp.einsum``, e.g. for quantization.
    """
    return F.dot_product_attention(
        query, key, value, bias, mask, broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
        dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype, precision=precision,
        force_fp32_for_softmax=force_fp32_for_softmax, einsum_dot_general=einsum_dot_general,
        qk_attn_weights_einsum=qk_attn_weights_einsum, attn_weights_value_einsum=attn_weights_value_einsum,
        record=_sower(module))


class MultiHeadDotProductAttention(Module):
    """Multi-head dot-product attention with Linen's fields and parameter layout.

    ``inputs_q`` is projected to queries and ``inputs_k``/``inputs_v``
    (default: ``inputs_q``, self-attention) to keys and values by
    ``DenseGeneral`` layers named ``query``, ``key``, ``value``, each producing
    ``(num_heads, qkv_features // num_heads)`` features; the heads are merged
    back by ``out``.  ``deterministic`` may be given here or at call time
    (exactly one, and only needed when ``dropout_rate > 0``).

    ``decode=True`` keeps ``cached_key``, ``cached_value`` and ``cache_index``
    in the ``cache`` collection: ``init`` on a full-length input sizes the
    cache, then each call with one token (``mutable=['cache']``) appends its
    key/value and attends to the positions written so far.
    """

    num_heads: int
    """Number of attention heads; ``qkv_features`` must be divisible by it."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    qkv_features: int | None = None
    """Dimension of the query, key and value projections, all heads together (``None``: the
    query's features)."""
    out_features: int | None = None
    """Dimension of the output projection (``None``: the query's features)."""
    broadcast_dropout: bool = True
    """Whether the attention-weight dropout mask is shared along the batch axes."""
    dropout_rate: float = 0.0
    """Dropout rate of the attention weights."""
    deterministic: bool | None = None
    """If true, no dropout of the attention weights; may be given to the call instead."""
    precision: PrecisionLike = None
    """``jax.lax.Precision`` of the projections and the attention matmuls."""
    kernel_init: initializers.Initializer = default_kernel_init
    """Initializer of the query, key, value and (unless ``out_kernel_init``) output kernels."""
    out_kernel_init: initializers.Initializer | None = None
    """Initializer of the output projection's kernel (``None``: ``kernel_init``)."""
    bias_init: initializers.Initializer = initializers.zeros_init()
    """Initializer of the projections' biases."""
    out_bias_init: initializers.Initializer | None = None
    """Initializer of the output projection's bias (``None``: ``bias_init``)."""
    use_bias: bool = True
    """Whether to add a learned bias."""
    attention_fn: Callable[..., Array] = dot_product_attention
    """Computes the attention from ``(query, key, value, ...)`` (``dot_product_attention`` by
    default)."""
    decode: bool = False
    """Autoregressive decoding: keys and values are appended to a ``cache`` collection one step
    at a time."""
    normalize_qk: bool = False
    """Whether to apply ``LayerNorm`` to the queries and keys (QK-normalization)."""
    force_fp32_for_softmax: bool = False
    """Computes the softmax in float32 whatever ``dtype`` is."""
    qkv_dot_general: DotGeneralT | None = None
    """Replaces ``jax.lax.dot_general`` in the query, key and value projections."""
    out_dot_general: DotGeneralT | None = None
    """Replaces ``jax.lax.dot_general`` in the output projection."""
    qkv_dot_general_cls: Callable[..., DotGeneralT] | None = None
    """A class whose instance replaces the projections' ``dot_general``."""
    out_dot_general_cls: Callable[..., DotGeneralT] | None = None
    """A class whose instance replaces the output projection's ``dot_general``."""
    qk_attn_weights_einsum_cls: Callable[..., Callable[..., Array]] | None = None
    """A factory of the einsum computing the attention weights from queries and keys."""
    attn_weights_value_einsum_cls: Callable[..., Callable[..., Array]] | None = None
    """A factory of the einsum applying the attention weights to the values."""

    @compact
    def __call__(self, inputs_q: Array, inputs_k: Array | None = None, inputs_v: Array | None = None, *,
                 inputs_kv: Array | None = None, mask: Array | None = None,
                 deterministic: bool | None = None, dropout_rng: Array | None = None,
                 sow_weights: bool = False) -> Array:
        """Attends ``inputs_q`` (``[batch..., q_length, features]``) to the keys/values.

        ``mask`` (``[batch..., heads, q_length, kv_length]``, ``False`` = excluded)
        broadcasts over heads; ``dropout_rng`` overrides the ``dropout`` stream;
        ``sow_weights`` sows the attention weights into ``intermediates``.
        """
        if inputs_kv is not None:
            if inputs_k is not None or inputs_v is not None:
                raise ValueError("give either inputs_kv or inputs_k/inputs_v, not both")
            inputs_k = inputs_v = inputs_kv
        elif inputs_k is None:
            if inputs_v is not None:
                raise ValueError("inputs_v needs inputs_k; to use one array for both, pass only inputs_k")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k

        features = self.out_features or inputs_q.shape[-1]
        qkv_features = self.qkv_features or inputs_q.shape[-1]
        if qkv_features % self.num_heads:
            raise ValueError(f"qkv_features ({qkv_features}) must be divisible by num_heads "
                             f"({self.num_heads})")
        dense = functools.partial(
            DenseGeneral, axis=-1, features=(self.num_heads, qkv_features // self.num_heads),
            dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
            bias_init=self.bias_init, use_bias=self.use_bias, precision=self.precision,
            dot_general=self.qkv_dot_general, dot_general_cls=self.qkv_dot_general_cls)
        query = dense(name="query")(inputs_q)
        key = dense(name="key")(inputs_k)
        value = dense(name="value")(inputs_v)

        if self.normalize_qk:
            # QK normalization keeps attention logits bounded at high learning
            # rates (Dehghani et al., 2023, arXiv:2302.05442).
            norm = functools.partial(LayerNorm, use_bias=False, dtype=self.dtype,
                                     param_dtype=self.param_dtype)
            query = norm(name="query_ln")(query)
            key = norm(name="key_ln")(key)

        if self.decode:
            key, value, mask = self._decode_step(query, key, value, mask)

        if self.dropout_rate > 0.0:
            deterministic = merge_param("deterministic", self.deterministic, deterministic)
            if not deterministic and dropout_rng is None:
                dropout_rng = self.make_rng("dropout")
        else:
            deterministic = True

        qk_einsum = self.qk_attn_weights_einsum_cls() if self.qk_attn_weights_einsum_cls else None
        wv_einsum = self.attn_weights_value_einsum_cls() if self.attn_weights_value_einsum_cls else None
        attn_kwargs = dict(
            mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
            broadcast_dropout=self.broadcast_dropout, deterministic=deterministic, dtype=self.dtype,
            precision=self.precision, force_fp32_for_softmax=self.force_fp32_for_softmax,
            qk_attn_weights_einsum=qk_einsum, attn_weights_value_einsum=wv_einsum)
        # A custom attention_fn receives only the keywords it declares.
        accepted = inspect.signature(self.attention_fn).parameters
        attn_kwargs = {k: v for k, v in attn_kwargs.items() if k in accepted}
        if sow_weights:
            attn_kwargs["module"] = self
        x = self.attention_fn(query, key, value, **attn_kwargs)

        return DenseGeneral(
            features=features, axis=(-2, -1), kernel_init=self.out_kernel_init or self.kernel_init,
            bias_init=self.out_bias_init or self.bias_init, use_bias=self.use_bias, dtype=self.dtype,
            param_dtype=self.param_dtype, precision=self.precision, dot_general=self.out_dot_general,
            dot_general_cls=self.out_dot_general_cls, name="out")(x)

    @nowrap
    def _decode_step(self, query: Array, key: Array, value: Array,
                     mask: Array | None) -> tuple[Array, Array, Array | None]:
        """Writes this step's key/value into the cache; returns the whole cache and
        a mask hiding the positions not written yet.

        The first call (cache absent, ``cache`` mutable) only creates the cache,
        sized by the full-length input, and attends normally.
        """
        initialized = self.has_variable("cache", "cached_key")
        if not initialized and not self.is_mutable_collection("cache"):
            raise errors.MissingVariableError(
                "decode=True needs the autoregressive cache, which is missing", collection="cache",
                path=(*self.path, "cached_key"), **site(about=self),
                fix="initialize with decode=True on a full-length input (init(...)['cache']) and pass "
                    "that cache in the variables")
        if initialized and not self.is_mutable_collection("cache"):
            raise errors.ImmutableCollectionError(
                "a decode step updates the autoregressive cache, but 'cache' is not mutable",
                collection="cache", path=(*self.path, "cached_key"), **site(about=self),
                fix="apply with mutable=['cache'] so the decode step can update the cache")
        cached_key = self.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, dtype=jnp.int32))
        if not initialized:
            return key, value, mask

        *batch_dims, _, num_heads, depth = cached_key.value.shape
        expected = (*batch_dims, 1, num_heads, depth)
        if query.shape != expected:
            raise errors.VariableShapeError(
                f"a decode step takes one position: query projection {query.shape} does not fit the "
                f"cache, which expects {expected}", collection="cache",
                path=(*self.path, "cached_key"), **site(about=self),
                fix="feed one token per call ([batch..., 1, features]) with the batch shape used at init")
        index = cache_index.value
        key, value, written = F.decode_cache_update(cached_key.value, cached_value.value, index, key, value)
        cached_key.value = key
        cached_value.value = value
        cache_index.value = index + 1
        return key, value, combine_masks(mask, written)


class MultiHeadAttention(MultiHeadDotProductAttention):
    """``MultiHeadDotProductAttention`` under Linen's shorter name.

    Only the class name differs, and with it the auto-name
    (``MultiHeadAttention_0``), which is what checkpoints key on.
    """


class SelfAttention(MultiHeadDotProductAttention):
    """Self-attention: ``MultiHeadDotProductAttention`` with keys and values taken
    from ``inputs_q``.  Kept for Linen code that still uses it; Linen deprecates
    it in favour of calling ``MultiHeadDotProductAttention`` with one input."""

    @compact
    def __call__(self, inputs_q: Array, mask: Array | None = None,  # type: ignore[override]
                 deterministic: bool | None = None, dropout_rng: Array | None = None,
                 sow_weights: bool = False) -> Array:
        return super().__call__(inputs_q, mask=mask, deterministic=deterministic, dropout_rng=dropout_rng,
                                sow_weights=sow_weights)
