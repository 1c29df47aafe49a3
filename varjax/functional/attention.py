"""Dot-product attention: the weights, the output, the masks and one decode step's cache update.

The projections around attention are parameters, so they stay in each frontend; what is
left is arrays in, arrays out.  Linen's functions may sow the weights into a module
(``module=``); here a ``record`` callback receives them instead (before dropout), so each
frontend sows them its own way without this layer knowing a module.  Dropout on the weights
takes an explicit key (``dropout_rng``).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from varjax.functional import dtypes
from varjax.ir import errors
from varjax.ir.typing import Dtype, PrecisionLike

__all__ = ["dot_product_attention_weights", "dot_product_attention", "fused_dot_product_attention",
           "make_attention_mask", "make_causal_mask", "combine_masks", "decode_cache_update"]

Array = jax.Array
PromoteDtype = Callable[..., list[Any]]


def _einsum(precision: PrecisionLike, dot_general: Callable[..., Array] | None) -> Callable[..., Array]:
    """``jnp.einsum`` with a fixed precision and, when given, a custom ``dot_general``
    (how quantization libraries hook into attention)."""
    if dot_general is None:
        return functools.partial(jnp.einsum, precision=precision)
    return functools.partial(jnp.einsum, precision=precision, _dot_general=dot_general)


def dot_product_attention_weights(
    query: Array, key: Array, bias: Array | None = None, mask: Array | None = None, *,
    broadcast_dropout: bool = True, dropout_rng: Array | None = None, dropout_rate: float = 0.0,
    deterministic: bool = False, dtype: Dtype | None = None, precision: PrecisionLike = None,
    force_fp32_for_softmax: bool = False, einsum_dot_general: Callable[..., Array] | None = None,
    einsum: Callable[..., Array] | None = None, record: Callable[[Array], Any] | None = None,
    is_causal: bool = False, grouped: bool = False, promote_dtype: PromoteDtype = dtypes.promote_dtype,
) -> Array:
    """Softmax attention weights ``[batch..., heads, q_length, kv_length]``.

    ``query``/``key`` are ``[batch..., length, heads, depth]``.  ``mask`` is
    ``False`` where a weight is excluded; it and ``bias`` must broadcast to the
    weights' shape.  ``is_causal`` also excludes every key after the query's position.
    ``record`` is called with the weights before dropout.  ``grouped`` allows fewer key
    heads than query heads (grouped-query attention: each key head serves a group of
    query heads), which NNX's attention accepts and Linen's refuses.
    """
    if (precision is not None or einsum_dot_general is not None) and einsum is not None:
        raise ValueError("precision/einsum_dot_general and einsum are mutually exclusive; give one.")
    if einsum is None:
        einsum = _einsum(precision, einsum_dot_general)
    query, key = promote_dtype(query, key, dtype=dtype)
    dtype = query.dtype
    _check_query_key(query, key, grouped)

    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    weights = _scores(einsum, query, key)
    if bias is not None:
        weights = weights + bias
    if is_causal:
        causal = jnp.tril(jnp.ones(weights.shape[-2:], dtype))
        mask = combine_masks(mask, jnp.broadcast_to(causal, weights.shape if mask is None else mask.shape),
                             dtype=dtype)
    if mask is not None:
        weights = jnp.where(mask, weights, jnp.finfo(dtype).min)
    if force_fp32_for_softmax and dtype != jnp.float32:
        weights = jax.nn.softmax(weights.astype(jnp.float32))
    else:
        weights = jax.nn.softmax(weights).astype(dtype)

    if record is not None:
        record(weights)

    if not deterministic and dropout_rate > 0.0:
        keep_prob = 1.0 - dropout_rate
        # A broadcast mask is shared by every batch element and head.
        shape = (1,) * (key.ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype))
    return weights


def dot_product_attention(
    query: Array, key: Array, value: Array, bias: Array | None = None, mask: Array | None = None, *,
    broadcast_dropout: bool = True, dropout_rng: Array | None = None, dropout_rate: float = 0.0,
    deterministic: bool = False, dtype: Dtype | None = None, precision: PrecisionLike = None,
    force_fp32_for_softmax: bool = False, einsum_dot_general: Callable[..., Array] | None = None,
    qk_attn_weights_einsum: Callable[..., Array] | None = None,
    attn_weights_value_einsum: Callable[..., Array] | None = None,
    record: Callable[[Array], Any] | None = None, is_causal: bool = False, grouped: bool = False,
    promote_dtype: PromoteDtype = dtypes.promote_dtype,
) -> Array:
    """Attention output ``[batch..., q_length, heads, v_depth]`` (Vaswani et al., 2017).

    ``value`` is ``[batch..., kv_length, heads, v_depth]``; the other arguments
    are those of ``dot_product_attention_weights``.  The two ``*_einsum``
    overrides (given together) replace ``jnp.einsum``, e.g. for quantization.
    """
    if (qk_attn_weights_einsum is None) != (attn_weights_value_einsum is None):
        raise ValueError("qk_attn_weights_einsum and attn_weights_value_einsum must be given together.")
    if (precision is not None or einsum_dot_general is not None) and qk_attn_weights_einsum is not None:
        raise ValueError("precision/einsum_dot_general and the *_einsum overrides are mutually exclusive.")
    query, key, value = promote_dtype(query, key, value, dtype=dtype)
    _check_key_value(key, value)
    weights = dot_product_attention_weights(
        query, key, bias, mask, broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
        dropout_rate=dropout_rate, deterministic=deterministic, dtype=query.dtype, precision=precision,
        force_fp32_for_softmax=force_fp32_for_softmax, einsum_dot_general=einsum_dot_general,
        einsum=qk_attn_weights_einsum, record=record, is_causal=is_causal, grouped=grouped,
        promote_dtype=promote_dtype)
    # force_fp32_for_softmax leaves the weights in float32: mix them with the
    # values by an explicit cast, which strict dtype promotion accepts.
    weights, value = dtypes.promote_dtype(weights, value)
    einsum = attn_weights_value_einsum or _einsum(precision, einsum_dot_general)
    heads, value_heads = weights.shape[-3], value.shape[-2]
    if heads == value_heads:
        return einsum("...hqk,...khd->...qhd", weights, value)
    # Grouped-query attention: each value head serves heads // value_heads query heads.
    weights = weights.reshape(weights.shape[:-3] + (value_heads, heads // value_heads) + weights.shape[-2:])
    out = einsum("...hgqk,...kh1d->...qhgd", weights, jnp.expand_dims(value, -2))
    return out.reshape(out.shape[:-3] + (heads, out.shape[-1]))


def fused_dot_product_attention(query: Array, key: Array, value: Array, bias: Array | None = None,
                                mask: Array | None = None, *, is_causal: bool = False) -> Array:
    """``dot_product_attention`` without dropout as ``jax.nn.dot_product_attention``
    (XLA's fused attention, which scales the scores rather than the query), for any number
    of batch axes: NNX's attention takes this path whenever there is no dropout and no
    weights to sow, so its outputs round as that function's do.  Key heads may be fewer
    than query heads (grouped-query attention)."""
    _check_query_key(query, key, grouped=True)
    _check_key_value(key, value)
    shape = query.shape
    if len(shape) > 4:   # jax.nn.dot_product_attention takes one batch axis at most
        query, key, value, bias, mask = (
            None if x is None else x.reshape((math.prod(x.shape[:-3]), *x.shape[-3:]))
            for x in (query, key, value, bias, mask))
    if mask is not None:
        mask = mask.astype(jnp.bool_)
    # JAX's function promotes a half-precision query to float32 logits implicitly
    # (jnp.promote_types(query.dtype, float32)): its own mixing, allowed under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        out = jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=is_causal)
    return out.reshape(shape[:-1] + out.shape[-1:]) if len(shape) > 4 else out


def _check_query_key(query: Array, key: Array, grouped: bool) -> None:
    """``ConfigError`` (a ``ValueError``, as flax raises) at the user's line unless ``query``
    and ``key`` agree on rank, batch axes, heads and
    depth; ``grouped``, the key's heads need only divide the query's.  The reason in
    parentheses is worded as flax's, so a ported test's match still finds it."""
    heads, key_heads = query.shape[-2], key.shape[-2]
    if query.ndim != key.ndim:
        reason = "q, k must have the same rank"
    elif query.shape[:-3] != key.shape[:-3]:
        reason = "q, k batch dims must match"
    elif query.shape[-1] != key.shape[-1]:
        reason = "q, k depths must match"
    elif grouped and heads % key_heads:
        reason = "query heads must be multiple of key heads: grouped-query attention"
    elif not grouped and heads != key_heads:
        reason = "q, k num_heads must match"
    else:
        return
    raise errors.ConfigError(
        f"query {query.shape} and key {key.shape} must agree on batch dims, heads and depth "
        f"({reason})", **errors.where(), fix="give query and key of matching shapes")


def _check_key_value(key: Array, value: Array) -> None:
    if key.ndim != value.ndim or key.shape[:-1] != value.shape[:-1]:
        reason = "k, v lengths must match" if key.ndim == value.ndim and \
            key.shape[-3] != value.shape[-3] else "k, v rank, batch dims and heads must match"
        raise errors.ConfigError(
            f"key {key.shape} and value {value.shape} must agree on all but the depth axis "
            f"({reason})", **errors.where(), fix="give key and value of matching shapes")


def _scores(einsum: Callable[..., Array], query: Array, key: Array) -> Array:
    """``query . key`` per head, ``[batch..., heads, q_length, kv_length]``; with fewer key
    heads, each serves a contiguous group of query heads."""
    heads, key_heads = query.shape[-2], key.shape[-2]
    if heads == key_heads:
        return einsum("...qhd,...khd->...hqk", query, key)
    query = query.reshape(query.shape[:-2] + (key_heads, heads // key_heads, query.shape[-1]))
    scores = einsum("...qhgd,...kh1d->...hgqk", query, jnp.expand_dims(key, -2))
    return scores.reshape(scores.shape[:-4] + (heads,) + scores.shape[-2:])


def make_attention_mask(query_input: Array, key_input: Array,
                        pairwise_fn: Callable[..., Any] = jnp.multiply, extra_batch_dims: int = 0,
                        dtype: Dtype = jnp.float32) -> Array:
    """``pairwise_fn(query_input[..., :, None], key_input[..., None, :])`` with a
    singleton heads axis, ``[batch..., 1, q_length, kv_length]``: the mask shape
    attention broadcasts over heads.  ``extra_batch_dims`` prepends singleton axes."""
    mask = pairwise_fn(jnp.expand_dims(query_input, -1), jnp.expand_dims(key_input, -2))
    mask = jnp.expand_dims(mask, -3)
    mask = jnp.expand_dims(mask, tuple(range(extra_batch_dims)))
    return mask.astype(dtype)


def make_causal_mask(x: Array, extra_batch_dims: int = 0, dtype: Dtype = jnp.float32) -> Array:
    """``[batch..., 1, length, length]`` mask letting position ``i`` see positions
    ``<= i``; only ``x``'s shape ``[batch..., length]`` is used."""
    positions = jnp.broadcast_to(jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape)
    return make_attention_mask(positions, positions, jnp.greater_equal, extra_batch_dims=extra_batch_dims,
                               dtype=dtype)


def combine_masks(*masks: Array | None, dtype: Dtype = jnp.float32) -> Array | None:
    """Logical AND of the masks that are not ``None`` (all of one rank), as ``dtype``;
    ``None`` when none are given, so optional masks can be passed straight through."""
    given = [m for m in masks if m is not None]
    if not given:
        return None
    if len({m.ndim for m in given}) != 1:
        raise ValueError(f"masks must have the same rank, got ranks {[m.ndim for m in given]}")
    mask = given[0]
    for other in given[1:]:
        mask = jnp.logical_and(mask, other)
    return mask.astype(dtype)


def decode_cache_update(cached_key: Array, cached_value: Array, index: Array, key: Array, value: Array
                        ) -> tuple[Array, Array, Array]:
    """One autoregressive step: ``key``/``value`` (one position) written into the caches at ``index``.

    Returns the new caches and the mask ``[batch..., 1, 1, max_length]`` that lets the
    step's query see only the positions written so far.
    """
    *batch_dims, max_length, _, _ = cached_key.shape
    zero = jnp.zeros((), index.dtype)
    start = (zero,) * len(batch_dims) + (index, zero, zero)
    key = lax.dynamic_update_slice(cached_key, key, start)
    value = lax.dynamic_update_slice(cached_value, value, start)
    written = jnp.broadcast_to(jnp.arange(max_length) <= index, (*batch_dims, 1, 1, max_length))
    return key, value, written
