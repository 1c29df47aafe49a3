"""``nnx.Linear``: a declaration over ``varjax.functional.linear.dense``.

The layer holds its kernel and bias as ``Param``s made from ``rngs.params()`` draws in
NNX's order (kernel, then bias), so the same seed gives flax.nnx's values bit for bit; the
math is the shared function Linen's ``Dense`` calls too.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from jax import lax

from varjax.functional import dtypes, initializers
from varjax.functional.linear import dense
from varjax.ir.typing import DotGeneralT, Dtype, Initializer, PrecisionLike
from varjax.nnx.module import Module
from varjax.nnx.pytree import data
from varjax.nnx.variablelib import Param
from varjax.trace.rngs import Rngs

__all__ = ["Linear"]

default_kernel_init = initializers.lecun_normal()
default_bias_init = initializers.zeros


def promote_dtype(args: tuple, /, *, dtype: Dtype | None = None, inexact: bool = True) -> tuple:
    """NNX's form of the shared promotion: the arrays come as one tuple."""
    return tuple(dtypes.promote_dtype(*args, dtype=dtype, inexact=inexact))


class Linear(Module):
    """``y = x @ kernel + bias`` over the last axis of ``x``."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 dtype: Dtype | None = None, param_dtype: Dtype = jax.numpy.float32,
                 precision: PrecisionLike = None,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = default_bias_init,
                 dot_general: DotGeneralT = lax.dot_general,
                 promote_dtype: Callable[..., Any] = promote_dtype, rngs: Rngs):
        self.kernel = Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias \
            else data(None)
        self.in_features, self.out_features, self.use_bias = in_features, out_features, use_bias
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.kernel_init, self.bias_init = kernel_init, bias_init
        self.dot_general, self.promote_dtype = dot_general, promote_dtype

    def __call__(self, inputs: jax.Array) -> jax.Array:
        bias = self.bias[...] if self.bias is not None else None
        return dense(inputs, self.kernel[...], bias, dtype=self.dtype, precision=self.precision,
                     dot_general=self.dot_general,
                     promote_dtype=lambda *a, dtype: self.promote_dtype(a, dtype=dtype))
