"""``nnx.Conv``: a declaration over ``varjax.functional.convolution.conv``.

The kernel ``(*kernel_size, in_features // feature_group_count, out_features)`` and the
bias are ``Param``s drawn from ``rngs.params()`` in NNX's order (kernel, then bias), so the
same seed gives flax.nnx's values; the padding modes, the batch folding and the mask are
the shared function's, the one Linen's ``Conv`` calls too.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from varjax.functional import initializers
from varjax.functional.convolution import PaddingLike, conv, conv_kernel_shape, conv_transpose
from varjax.ir.typing import Dtype, Initializer, Metadata, PrecisionLike, ShardingLike
from varjax.nnx.call_options import no_out_sharding
from varjax.nnx.linear import NO_METADATA, default_kernel_init, functional_promote
from varjax.nnx.linear import promote_dtype as default_promote_dtype
from varjax.nnx.module import Module
from varjax.nnx.pytree import data
from varjax.nnx.variablelib import Param
from varjax.trace.rngs import Rngs

__all__ = ["Conv", "ConvTranspose"]

PerAxis = None | int | Sequence[int]


class Conv(Module):
    """An N-d convolution over channels-last inputs (``(*batch, *spatial, in_features)``),
    one kernel shared by every position."""

    def __init__(self, in_features: int, out_features: int, kernel_size: int | Sequence[int],
                 strides: PerAxis = 1, *, padding: PaddingLike = "SAME",
                 input_dilation: PerAxis = 1, kernel_dilation: PerAxis = 1,
                 feature_group_count: int = 1, use_bias: bool = True,
                 mask: jax.Array | None = None, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = initializers.zeros_init(),
                 conv_general_dilated: Callable[..., jax.Array] = lax.conv_general_dilated,
                 promote_dtype: Callable[..., Any] = default_promote_dtype,
                 preferred_element_type: Dtype | None = None, rngs: Rngs,
                 kernel_metadata: Metadata = NO_METADATA,
                 bias_metadata: Metadata = NO_METADATA):
        kernel_size = (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)
        self.kernel_shape = conv_kernel_shape(kernel_size, in_features, out_features,
                                              feature_group_count)
        self.kernel = Param(kernel_init(rngs.params(), self.kernel_shape, param_dtype),
                            **kernel_metadata)
        self.bias = Param(bias_init(rngs.params(), (out_features,), param_dtype),
                          **bias_metadata) if use_bias else data(None)
        self.in_features, self.out_features, self.kernel_size = \
            in_features, out_features, kernel_size
        self.strides, self.padding = strides, padding
        self.input_dilation, self.kernel_dilation = input_dilation, kernel_dilation
        self.feature_group_count, self.use_bias, self.mask = feature_group_count, use_bias, mask
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.conv_general_dilated, self.promote_dtype = conv_general_dilated, promote_dtype
        self.preferred_element_type = preferred_element_type

    def __call__(self, inputs: jax.Array, out_sharding: ShardingLike = None) -> jax.Array:
        no_out_sharding("Conv", out_sharding)
        convolve = self.conv_general_dilated
        if self.preferred_element_type is not None:
            convolve = functools.partial(convolve,
                                         preferred_element_type=self.preferred_element_type)
        bias = self.bias[...] if self.bias is not None else None
        return conv(inputs, self.kernel[...], bias, strides=self.strides, padding=self.padding,
                    input_dilation=self.input_dilation, kernel_dilation=self.kernel_dilation,
                    feature_group_count=self.feature_group_count, mask=self.mask,
                    dtype=self.dtype, precision=self.precision, conv_general_dilated=convolve,
                    promote_dtype=functional_promote(self.promote_dtype))


class ConvTranspose(Module):
    """A transposed N-d convolution over channels-last inputs: upsamples by ``strides``.

    Declares ``kernel`` ``(*kernel_size, in_features, out_features)`` (``(..., out, in)``
    with ``transpose_kernel=True``, the kernel of the ``Conv`` whose gradient this is) and
    ``bias`` ``(out_features,)``; calls ``conv_transpose`` (``'CIRCULAR'`` padding folds the
    output onto a periodic grid there).
    """

    def __init__(self, in_features: int, out_features: int, kernel_size: int | Sequence[int],
                 strides: PerAxis = None, *, padding: PaddingLike = "SAME",
                 kernel_dilation: PerAxis = None, use_bias: bool = True,
                 mask: jax.Array | None = None, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, precision: PrecisionLike = None,
                 kernel_init: Initializer = default_kernel_init,
                 bias_init: Initializer = initializers.zeros_init(),
                 transpose_kernel: bool = False,
                 promote_dtype: Callable[..., Any] = default_promote_dtype,
                 preferred_element_type: Dtype | None = None, rngs: Rngs,
                 kernel_metadata: Metadata = NO_METADATA,
                 bias_metadata: Metadata = NO_METADATA):
        kernel_size = (kernel_size,) if isinstance(kernel_size, int) else tuple(kernel_size)
        features = (out_features, in_features) if transpose_kernel else (in_features, out_features)
        self.kernel_shape = kernel_size + features
        self.kernel = Param(kernel_init(rngs.params(), self.kernel_shape, param_dtype),
                            **kernel_metadata)
        self.bias = Param(bias_init(rngs.params(), (out_features,), param_dtype),
                          **bias_metadata) if use_bias else data(None)
        self.in_features, self.out_features, self.kernel_size = \
            in_features, out_features, kernel_size
        self.strides, self.padding, self.kernel_dilation = strides, padding, kernel_dilation
        self.use_bias, self.mask, self.transpose_kernel = use_bias, mask, transpose_kernel
        self.dtype, self.param_dtype, self.precision = dtype, param_dtype, precision
        self.promote_dtype, self.preferred_element_type = promote_dtype, preferred_element_type

    def __call__(self, inputs: jax.Array) -> jax.Array:
        bias = self.bias[...] if self.bias is not None else None
        return conv_transpose(inputs, self.kernel[...], bias, strides=self.strides,
                              padding=self.padding, kernel_dilation=self.kernel_dilation,
                              transpose_kernel=self.transpose_kernel, mask=self.mask,
                              dtype=self.dtype, precision=self.precision,
                              preferred_element_type=self.preferred_element_type,
                              promote_dtype=functional_promote(self.promote_dtype))
