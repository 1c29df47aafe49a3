"""Linear layers: ``Dense``, ``DenseGeneral``, ``Conv``, ``ConvLocal``, ``ConvTranspose``, ``Embed``.

``Einsum`` lives in ``varjax.nn.einsum`` and is re-exported here, where Linen keeps it.

Each layer matches its ``flax.linen`` namesake field for field: the same
parameter names (``kernel``, ``bias``, ``embedding``), shapes and
initializers, so a Linen checkpoint loads unchanged and, given the same
variables, the outputs agree.

Inputs are channels-last.  The convolutions accept any number of leading
batch dimensions, including none: they are flattened into one batch axis for
``lax`` and restored afterwards, as in Linen.

Each layer declares its parameters and calls ``varjax.functional`` (``dense``,
``dense_general``, ``conv``, ``conv_local``, ``conv_transpose``, ``embed``, ``attend``) for
the arithmetic, which ``varjax.nnx`` shares.

Sharp edges:
  * Parameters are created in ``param_dtype``; the computation runs in
    ``dtype`` or, if that is ``None``, in the standard promotion of the input
    and parameter dtypes (see ``varjax.nn.dtypes``).
  * ``Embed`` returns NaN rows for indices ``>= num_embeddings`` (``jnp.take``'s
    fill mode), and negative indices count from the end, as in Linen.
  * ``DenseGeneral`` initializes its kernel and bias flat (2-D and 1-D, as Linen does, so
    the values match Linen's) and reshapes them; a boxed initializer's result
    (``nn.with_partitioning``) is reshaped inside its box, which keeps its names.  Linen
    unboxes it with a sharding constraint there, on the flat value; varjax does not
    constrain that intermediate.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from varjax import functional as F
from varjax.functional.convolution import canonicalize_padding as canonicalize_padding
from varjax.ir import axis_metadata
from varjax.nn import dtypes, initializers
from varjax.nn.dtypes import promote_dtype as promote_dtype
from varjax.nn.einsum import Einsum as Einsum
from varjax.nn.module import Module, compact, nowrap
from varjax.nn.typing import Array as Array
from varjax.nn.typing import ConvGeneralDilatedT as ConvGeneralDilatedT
from varjax.nn.typing import DotGeneralT as DotGeneralT
from varjax.nn.typing import Dtype as Dtype
from varjax.nn.typing import Initializer as Initializer
from varjax.nn.typing import LaxPadding as LaxPadding
from varjax.nn.typing import PaddingLike as PaddingLike
from varjax.nn.typing import PrecisionLike as PrecisionLike
from varjax.nn.typing import PRNGKey as PRNGKey
from varjax.nn.typing import Shape as Shape
from varjax.trace.unprovided import not_provided

__all__ = ["Dense", "DenseGeneral", "Conv", "ConvLocal", "ConvTranspose", "Einsum", "Embed",
           "canonicalize_padding", "default_kernel_init", "default_embed_init"]

PromoteDtypeFn = Callable[..., list[Any]]

default_kernel_init = initializers.lecun_normal()
default_embed_init = initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


def _as_tuple(x: int | Iterable[int]) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Iterable) else (x,)


def _pick(cls: Any, fn: Callable | None, default: Callable) -> Callable:
    """A ``*_cls`` field (instantiated per call) wins over a plain function field."""
    if cls is not None:
        return cls()
    return fn if fn is not None else default


class Dense(Module):
    """A fully connected layer, Linen's ``nn.Dense``: ``y = x @ kernel + bias`` over the last
    axis of ``x``.

    Creates ``params/kernel`` of shape ``(x.shape[-1], features)`` (``kernel_init``) and,
    with ``use_bias``, ``params/bias`` of shape ``(features,)`` (``bias_init``), in
    ``param_dtype``; the same values as Flax's from the same key.  The result has ``x``'s
    shape with the last axis replaced by ``features``::

        layer = nn.Dense(features=3)
        variables = layer.init(jax.random.key(0), jnp.ones((4, 2)))   # kernel (2, 3), bias (3,)
        y = layer.apply(variables, jnp.ones((4, 2)))                  # (4, 3)

    ``DenseGeneral`` contracts several axes or produces several; ``Einsum`` takes any
    equation."""

    features: int
    """Number of output features (the last axis of the result)."""
    use_bias: bool = True
    """Whether to add a learned bias."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    precision: PrecisionLike = None
    """``jax.lax.Precision`` of the matmul or convolution (``None``: the default)."""
    kernel_init: initializers.Initializer = default_kernel_init
    """Initializer of the kernel."""
    bias_init: initializers.Initializer = initializers.zeros_init()
    """Initializer of the bias."""
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype
    """Casts the inputs and parameters to one dtype before the computation (``dtype`` given to
    it)."""
    dot_general: DotGeneralT | None = None
    """Replaces ``jax.lax.dot_general`` for the matmul."""
    dot_general_cls: Callable[..., DotGeneralT] | None = None
    """A class whose instance replaces ``jax.lax.dot_general`` (made once per call, as in
    Linen)."""

    @compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.param("kernel", self.kernel_init, (np.shape(inputs)[-1], self.features),
                            self.param_dtype)
        bias = _feature_bias(self)
        dot_general = _pick(self.dot_general_cls, self.dot_general, lax.dot_general)
        return F.dense(inputs, kernel, bias, dtype=self.dtype, precision=self.precision,
                       dot_general=dot_general, promote_dtype=self.promote_dtype)


class DenseGeneral(Module):
    """A linear map contracting several input ``axis`` into several output ``features``.

    ``batch_dims`` (leading, consecutive axes) get a separate kernel per index,
    so the kernel shape is ``batch_shape + contracted_shape + features``.
    The initializers see the kernel flattened to 2-D ``(fan_in, fan_out)``
    (and the bias to 1-D) and the result is reshaped, so fan-based
    initializers scale by the true fan-in rather than by the first axis.
    """

    features: int | Sequence[int]
    """The output features: an int or a tuple of the output axes' sizes."""
    axis: int | Sequence[int] = -1
    """The input axes contracted with the kernel."""
    batch_dims: Sequence[int] = ()
    """Leading axes that get a separate kernel per index (not contracted)."""
    use_bias: bool = True
    """Whether to add a learned bias."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    kernel_init: initializers.Initializer = default_kernel_init
    """Initializer of the kernel."""
    bias_init: initializers.Initializer = initializers.zeros_init()
    """Initializer of the bias."""
    precision: PrecisionLike = None
    """``jax.lax.Precision`` of the matmul or convolution (``None``: the default)."""
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype
    """Casts the inputs and parameters to one dtype before the computation (``dtype`` given to
    it)."""
    dot_general: DotGeneralT | None = None
    """Replaces ``jax.lax.dot_general`` for the matmul."""
    dot_general_cls: Callable[..., DotGeneralT] | None = None
    """A class whose instance replaces ``jax.lax.dot_general`` (made once per call, as in
    Linen)."""

    @compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        features = _as_tuple(self.features)
        axis, batch_dims = F.dense_general_axes(inputs.ndim, self.axis, self.batch_dims)

        def flat_init(init: Callable, flat_shape: tuple[int, ...]) -> Callable:
            def wrapped(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Any:
                flat = init(key, flat_shape, dtype)
                return axis_metadata.replace_boxed(
                    flat, jnp.reshape(axis_metadata.unbox(flat, apply_constraint=False), shape))
            return wrapped

        batch_shape = tuple(inputs.shape[a] for a in batch_dims)
        contract_shape = tuple(inputs.shape[a] for a in axis)
        n_b, n_c, n_f = map(math.prod, (batch_shape, contract_shape, features))
        kernel = self.param("kernel", flat_init(self.kernel_init, (n_b * n_c, n_f)),
                            batch_shape + contract_shape + features, self.param_dtype)
        bias = None
        if self.use_bias:
            bias = self.param("bias", flat_init(self.bias_init, (n_b * n_f,)), batch_shape + features,
                              self.param_dtype)
        dot_general = _pick(self.dot_general_cls, self.dot_general, lax.dot_general)
        return F.dense_general(inputs, kernel, bias, axis=axis, batch_dims=batch_dims, dtype=self.dtype,
                               precision=self.precision, dot_general=dot_general,
                               promote_dtype=self.promote_dtype)


def _feature_bias(mdl: Module) -> jax.Array | None:
    """The per-output-feature ``bias`` parameter, or None without ``use_bias``."""
    return mdl.param("bias", mdl.bias_init, (mdl.features,), mdl.param_dtype) if mdl.use_bias else None


class _Conv(Module):
    """An N-d convolution over channels-last inputs; ``shared_weights`` picks the kind.

    ``padding`` is ``'SAME'``, ``'VALID'``, ``'CIRCULAR'`` (periodic: the input
    is wrap-padded, then convolved ``'VALID'``), ``'REFLECT'``, ``'CAUSAL'``
    (1-D only: left padding so output ``t`` sees inputs ``<= t``), an int, or
    one int / ``(low, high)`` pair per spatial axis.
    """

    features: int
    """Number of output features (the last axis of the result)."""
    kernel_size: int | Sequence[int]
    """The kernel's size in each spatial dimension (an int for 1-D)."""
    strides: None | int | Sequence[int] = 1
    """The stride of each spatial dimension (an int is used for every one)."""
    padding: PaddingLike = "SAME"
    """``'SAME'``, ``'VALID'``, ``'CIRCULAR'`` (``Conv`` family), or ``(low, high)`` pairs per
    spatial dimension."""
    input_dilation: None | int | Sequence[int] = 1
    """The input's dilation in each spatial dimension (a transposed convolution's stride)."""
    kernel_dilation: None | int | Sequence[int] = 1
    """The kernel's dilation in each spatial dimension (atrous convolution)."""
    feature_group_count: int = 1
    """Splits the input features into this many groups, each convolved with its own kernel
    (depthwise convolution when it equals the input features)."""
    use_bias: bool = True
    """Whether to add a learned bias."""
    mask: jax.Array | None = None
    """A mask multiplied into the kernel (zeros cut connections), of the kernel's shape."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    precision: PrecisionLike = None
    """``jax.lax.Precision`` of the matmul or convolution (``None``: the default)."""
    kernel_init: initializers.Initializer = default_kernel_init
    """Initializer of the kernel."""
    bias_init: initializers.Initializer = initializers.zeros_init()
    """Initializer of the bias."""
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype
    """Casts the inputs and parameters to one dtype before the computation (``dtype`` given to
    it)."""
    conv_general_dilated: ConvGeneralDilatedT | None = None
    """Replaces ``jax.lax.conv_general_dilated`` for the convolution."""
    conv_general_dilated_cls: Callable[..., ConvGeneralDilatedT] | None = None
    """A class whose instance replaces ``jax.lax.conv_general_dilated`` (made once per call)."""

    @compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel_size = _as_tuple(self.kernel_size)
        conv = _pick(self.conv_general_dilated_cls, self.conv_general_dilated, lax.conv_general_dilated)
        geometry = dict(strides=self.strides, padding=self.padding, input_dilation=self.input_dilation,
                        kernel_dilation=self.kernel_dilation)
        if not self.shared_weights:
            return self._local(inputs, conv, kernel_size, geometry)
        kernel_shape = F.conv_kernel_shape(kernel_size, np.shape(inputs)[-1], self.features,
                                           self.feature_group_count)
        kernel = self.param("kernel", self.kernel_init, kernel_shape, self.param_dtype)
        bias = _feature_bias(self)
        return F.conv(inputs, kernel, bias, **geometry, feature_group_count=self.feature_group_count,
                      mask=self.mask, dtype=self.dtype, precision=self.precision, conv_general_dilated=conv,
                      promote_dtype=self.promote_dtype)

    @property
    def shared_weights(self) -> bool:
        """True: one kernel slides over the input (``Conv``); False: a kernel per output position."""
        raise NotImplementedError

    @nowrap
    def _local(self, inputs: jax.Array, conv: Callable, kernel_size: tuple[int, ...],
               geometry: dict[str, Any]) -> jax.Array:
        """The unshared convolution: each output position has its own ``(window, features)`` kernel.

        The output's spatial shape is the one the shared convolution (``conv``) would
        give; kernel and bias carry it as leading axes.
        """
        if self.feature_group_count != 1:
            not_provided("ConvLocal with feature_group_count != 1",
                         "lax.conv_general_dilated_local has no feature groups (nor has Linen's ConvLocal).",
                         f"use feature_group_count=1 (got {self.feature_group_count}).", by="varjax.nn")
        kernel_shape, bias_shape = F.conv_local_shapes(inputs, kernel_size, self.features, **geometry,
                                                       conv_general_dilated=conv)
        kernel = self.param("kernel", self.kernel_init, kernel_shape, self.param_dtype)
        bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype) if self.use_bias else None
        return F.conv_local(inputs, kernel, bias, kernel_size=kernel_size, **geometry, mask=self.mask,
                            dtype=self.dtype, precision=self.precision, promote_dtype=self.promote_dtype)


class Conv(_Conv):
    """An N-d convolution (``lax.conv_general_dilated``): one kernel shared by every position."""

    @property
    def shared_weights(self) -> bool:
        return True


class ConvLocal(_Conv):
    """A locally connected layer (``lax.conv_general_dilated_local``): a kernel per output position.

    Linen's parameter layout: ``kernel`` is ``out_spatial + (prod(kernel_size) *
    in_features, features)`` and ``bias`` is ``out_spatial + (features,)``.
    """

    @property
    def shared_weights(self) -> bool:
        return False


class ConvTranspose(Module):
    """A transposed convolution (``lax.conv_transpose``): upsamples by ``strides``.

    With ``transpose_kernel=True`` the kernel is stored ``(..., features,
    in_features)`` and flipped spatially, i.e. it is the gradient of a ``Conv``
    with that kernel.  ``'CIRCULAR'`` padding folds the full ``'VALID'``
    output back onto a periodic grid of ``input_size * stride``.
    """

    features: int
    """Number of output features (the last axis of the result)."""
    kernel_size: int | Sequence[int]
    """The kernel's size in each spatial dimension (an int for 1-D)."""
    strides: Sequence[int] | None = None
    """The stride of each spatial dimension: how much larger the output is (``None``: 1)."""
    padding: PaddingLike = "SAME"
    """``'SAME'``, ``'VALID'``, ``'CIRCULAR'``, or ``(low, high)`` pairs per spatial dimension."""
    kernel_dilation: Sequence[int] | None = None
    """The kernel's dilation in each spatial dimension (atrous convolution)."""
    use_bias: bool = True
    """Whether to add a learned bias."""
    mask: jax.Array | None = None
    """A mask multiplied into the kernel (zeros cut connections), of the kernel's shape."""
    dtype: Dtype | None = None
    """The dtype of the computation and the result (``None``: promoted from the inputs and
    parameters)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the parameters are created in."""
    precision: PrecisionLike = None
    """``jax.lax.Precision`` of the matmul or convolution (``None``: the default)."""
    kernel_init: initializers.Initializer = default_kernel_init
    """Initializer of the kernel."""
    bias_init: initializers.Initializer = initializers.zeros_init()
    """Initializer of the bias."""
    transpose_kernel: bool = False
    """If true, the kernel is flipped and its in/out axes swapped, making this the gradient of a
    ``Conv`` (as in TensorFlow)."""
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype
    """Casts the inputs and parameters to one dtype before the computation (``dtype`` given to
    it)."""
    preferred_element_type: Dtype | None = None
    """The dtype JAX accumulates in (``preferred_element_type`` of the ``lax`` call)."""

    @compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        in_features = np.shape(inputs)[-1]
        io = (self.features, in_features) if self.transpose_kernel else (in_features, self.features)
        kernel = self.param("kernel", self.kernel_init, _as_tuple(self.kernel_size) + io, self.param_dtype)
        bias = _feature_bias(self)
        return F.conv_transpose(inputs, kernel, bias, strides=self.strides, padding=self.padding,
                                kernel_dilation=self.kernel_dilation, transpose_kernel=self.transpose_kernel,
                                mask=self.mask, dtype=self.dtype, precision=self.precision,
                                preferred_element_type=self.preferred_element_type,
                                promote_dtype=self.promote_dtype)


class Embed(Module):
    """A lookup table from integers in ``[0, num_embeddings)`` to ``features``-vectors.

    ``attend`` reuses the same table as an output projection (weight tying):
    it returns the inner product of a query with every embedding.
    """

    num_embeddings: int
    """Number of embeddings (the vocabulary size)."""
    features: int
    """Size of each embedding vector."""
    dtype: Dtype | None = None
    """The dtype of the looked-up embeddings (``None``: the table's)."""
    param_dtype: Dtype = jnp.float32
    """The dtype the embedding table is created in."""
    embedding_init: initializers.Initializer = default_embed_init
    """Initializer of the embedding table."""
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype
    """Casts the inputs and parameters to one dtype before the computation (``dtype`` given to
    it)."""

    def setup(self) -> None:
        # Created in setup, not compact, so that both __call__ and attend see the same table.
        self.embedding = self.param("embedding", self.embedding_init, (self.num_embeddings, self.features),
                                    self.param_dtype)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        return F.embed(inputs, self.embedding, dtype=self.dtype, promote_dtype=self.promote_dtype)

    def attend(self, query: jax.Array) -> jax.Array:
        """``query @ embedding.T``: logits over the vocabulary."""
        return F.attend(query, self.embedding, dtype=self.dtype, promote_dtype=self.promote_dtype)
