"""``nnx.LoRA`` and ``nnx.LoRALinear``: low-rank adapters, declarations over
``varjax.functional.linear.dense``.

``LoRA`` holds ``lora_a`` ``(in, rank)`` and ``lora_b`` ``(rank, out)``, drawn from
``rngs.params()`` in that order, of ``lora_param_type`` (``LoRAParam`` by default, a
``Param`` subclass with its own collection, so ``nnx.state(m, nnx.LoRAParam)`` selects the
adapters alone and ``nnx.Param`` selects them with the rest).  Its output is
``(x @ lora_a) @ lora_b``, two ``dense`` products through the rank-sized middle, plus an
optional wrapped ``base_module``'s output.  ``LoRALinear`` is an ``nnx.Linear`` (same
kernel and bias, drawn first) with a ``LoRA`` at ``lora`` added to its output, so its state
is a Linear's plus ``lora/lora_a`` and ``lora/lora_b``, as in flax.nnx.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

import jax
import jax.numpy as jnp

from varjax.functional import dtypes, initializers
from varjax.functional.linear import dense
from varjax.ir import errors
from varjax.ir.typing import Dtype, Initializer, Metadata, PyTree, ShardingLike
from varjax.nnx.linear import Linear
from varjax.nnx.linear import promote_dtype as nnx_promote_dtype
from varjax.nnx.module import Module
from varjax.nnx.variablelib import LoRAParam, Variable
from varjax.trace.rngs import Rngs

__all__ = ["LoRA", "LoRALinear", "LoRAParam"]

default_a_initializer = initializers.he_uniform()
default_b_initializer = initializers.zeros
_NO_METADATA: Metadata = MappingProxyType({})


def _sum(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a + b`` in their standard promotion, made explicit (a float16 adapter output plus
    a float32 layer's is float32, as flax.nnx's ``+=`` gives it)."""
    a, b = dtypes.promote_dtype(a, b, inexact=False)
    return a + b


class LoRA(Module):
    """``x @ lora_a @ lora_b`` (``+ base_module(x, **kwargs)`` when one is given).

    ``x`` and the two adapters are promoted together (``promote_dtype`` takes them as one
    tuple, as NNX's does) to ``dtype`` or their common dtype; the base module is called on
    the promoted ``x``, as flax.nnx calls it.
    """

    def __init__(self, in_features: int, lora_rank: int, out_features: int, *,
                 base_module: Module | None = None, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32,
                 a_initializer: Initializer = default_a_initializer,
                 b_initializer: Initializer = default_b_initializer,
                 lora_param_type: type[Variable] = LoRAParam,
                 promote_dtype: Callable[..., tuple] = nnx_promote_dtype, rngs: Rngs,
                 a_metadata: Metadata = _NO_METADATA, b_metadata: Metadata = _NO_METADATA):
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.param_dtype = dtype, param_dtype
        self.lora_param_type, self.base_module = lora_param_type, base_module
        self.promote_dtype = promote_dtype
        self.lora_a = lora_param_type(
            a_initializer(rngs.params(), (in_features, lora_rank), param_dtype), **a_metadata)
        self.lora_b = lora_param_type(
            b_initializer(rngs.params(), (lora_rank, out_features), param_dtype), **b_metadata)

    def __call__(self, x: jax.Array, **kwargs: PyTree) -> jax.Array:
        x, lora_a, lora_b = self.promote_dtype((x, self.lora_a[...], self.lora_b[...]),
                                               dtype=self.dtype)
        out = dense(dense(x, lora_a), lora_b)
        if self.base_module is None:
            return out
        if not callable(self.base_module):
            raise errors.ConfigError(
                f"LoRA: base_module must be callable, got {type(self.base_module).__name__}.",
                path=("base_module",), **errors.where(),
                fix="wrap a layer (a Module with __call__) or leave base_module=None")
        return _sum(out, self.base_module(x, **kwargs))


class LoRALinear(Linear):
    """An ``nnx.Linear`` whose output gets a ``LoRA``'s added: declares the Linear's
    ``kernel``/``bias`` (``kwargs`` are Linear's), then ``lora`` of rank ``lora_rank``, whose
    ``lora_*`` options are LoRA's ``dtype``/``param_dtype``/``promote_dtype``."""

    def __init__(self, in_features: int, out_features: int, *, lora_rank: int,
                 lora_dtype: Dtype | None = None, lora_param_dtype: Dtype = jnp.float32,
                 a_initializer: Initializer = default_a_initializer,
                 b_initializer: Initializer = default_b_initializer,
                 lora_param_type: type[Variable] = LoRAParam,
                 lora_promote_dtype: Callable[..., tuple] = nnx_promote_dtype, rngs: Rngs,
                 a_metadata: Metadata = _NO_METADATA, b_metadata: Metadata = _NO_METADATA,
                 **kwargs: PyTree):
        super().__init__(in_features, out_features, rngs=rngs, **kwargs)
        self.lora = LoRA(in_features, lora_rank, out_features, dtype=lora_dtype,
                         param_dtype=lora_param_dtype, a_initializer=a_initializer,
                         b_initializer=b_initializer, lora_param_type=lora_param_type,
                         promote_dtype=lora_promote_dtype, rngs=rngs, a_metadata=a_metadata,
                         b_metadata=b_metadata)

    def __call__(self, x: jax.Array, out_sharding: ShardingLike = None) -> jax.Array:
        return _sum(super().__call__(x, out_sharding=out_sharding), self.lora(x))
