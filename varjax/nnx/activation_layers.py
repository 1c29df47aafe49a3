"""``nnx.PReLU``, a declaration over ``varjax.functional.activations.prelu``, and
``nnx.identity``.

PReLU is a layer, not a function: its negative slope is a learned scalar ``Param``, made
from ``negative_slope_init`` with no random draw (so it takes no ``rngs``, as in
flax.nnx).  ``identity`` is ``jax.nn.identity`` itself, the function flax.nnx exports
under that name, for a ``Sequential`` step or an activation argument that does nothing.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

import jax
import jax.numpy as jnp
from jax.nn import identity

from varjax.functional.activations import prelu
from varjax.ir.typing import Dtype, Metadata
from varjax.nnx.linear import promote_dtype as nnx_promote_dtype
from varjax.nnx.module import Module
from varjax.nnx.variablelib import Param

__all__ = ["PReLU", "identity"]


class PReLU(Module):
    """``x`` where ``x >= 0``, else ``negative_slope * x``.

    Declares ``negative_slope``, a scalar ``Param`` of ``param_dtype`` holding
    ``negative_slope_init``, then calls ``prelu``.  With ``dtype`` given, the input and the
    slope are promoted to it first (``promote_dtype`` takes them as one tuple, as NNX's
    does); without it the slope is cast to the input's dtype, so a float32 slope keeps a
    bfloat16 activation bfloat16, as in Linen.
    """

    def __init__(self, negative_slope_init: float = 0.01, *, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32,
                 promote_dtype: Callable[..., tuple] = nnx_promote_dtype,
                 negative_slope_metadata: Metadata = MappingProxyType({})):
        self.negative_slope = Param(jnp.asarray(negative_slope_init, dtype=param_dtype),
                                    **negative_slope_metadata)
        self.dtype, self.param_dtype, self.promote_dtype = dtype, param_dtype, promote_dtype

    def __call__(self, inputs: jax.Array) -> jax.Array:
        negative_slope = self.negative_slope[...]
        if self.dtype is not None:
            inputs, negative_slope = self.promote_dtype((inputs, negative_slope),
                                                        dtype=self.dtype)
        return prelu(inputs, negative_slope)
