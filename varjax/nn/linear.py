"""Linear layers: ``Dense``, ``DenseGeneral``, ``Conv``, ``ConvLocal``, ``ConvTranspose``, ``Embed``.

``Einsum`` lives in ``varjax.nn.einsum`` and is re-exported here, where Linen keeps it.

Each layer matches its ``flax.linen`` namesake field for field: the same
parameter names (``kernel``, ``bias``, ``embedding``), shapes and
initializers, so a Linen checkpoint loads unchanged and, given the same
variables, the outputs agree.

Inputs are channels-last.  The convolutions accept any number of leading
batch dimensions, including none: they are flattened into one batch axis for
``lax`` and restored afterwards, as in Linen.

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
from varjax.nn.unsupported import not_provided

__all__ = ["Dense", "DenseGeneral", "Conv", "ConvLocal", "ConvTranspose", "Einsum", "Embed",
           "canonicalize_padding", "default_kernel_init", "default_embed_init"]

PromoteDtypeFn = Callable[..., list[Any]]

default_kernel_init = initializers.lecun_normal()
default_embed_init = initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


def _as_tuple(x: int | Iterable[int]) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, Iterable) else (x,)


def _nonneg_axes(axes: Iterable[int], ndim: int) -> tuple[int, ...]:
    return tuple(sorted(a % ndim for a in axes))


def _pick(cls: Any, fn: Callable | None, default: Callable) -> Callable:
    """A ``*_cls`` field (instantiated per call) wins over a plain function field."""
    if cls is not None:
        return cls()
    return fn if fn is not None else default


def _add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    """``y + bias`` with ``bias`` aligned to ``y``'s trailing axes (explicit rank, no rank promotion)."""
    if bias is None:
        return y
    # lax, not jnp: the dtypes already agree, and jnp's checks cost trace time per layer.
    return lax.add(y, lax.broadcast_in_dim(bias, y.shape, tuple(range(y.ndim - bias.ndim, y.ndim))))


class Dense(Module):
    """``y = x @ kernel + bias`` over the last axis of ``x``."""

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: PrecisionLike = None
    kernel_init: initializers.Initializer = default_kernel_init
    bias_init: initializers.Initializer = initializers.zeros_init()
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype
    dot_general: Callable | None = None
    dot_general_cls: Any = None

    @compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.param("kernel", self.kernel_init, (np.shape(inputs)[-1], self.features),
                            self.param_dtype)
        bias = _feature_bias(self)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        dot_general = _pick(self.dot_general_cls, self.dot_general, lax.dot_general)
        y = dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision)
        return _add_bias(y, bias)


class DenseGeneral(Module):
    """A linear map contracting several input ``axis`` into several output ``features``.

    ``batch_dims`` (leading, consecutive axes) get a separate kernel per index,
    so the kernel shape is ``batch_shape + contracted_shape + features``.
    The initializers see the kernel flattened to 2-D ``(fan_in, fan_out)``
    (and the bias to 1-D) and the result is reshaped, so fan-based
    initializers scale by the true fan-in rather than by the first axis.
    """

    features: int | Sequence[int]
    axis: int | Sequence[int] = -1
    batch_dims: Sequence[int] = ()
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: initializers.Initializer = default_kernel_init
    bias_init: initializers.Initializer = initializers.zeros_init()
    precision: PrecisionLike = None
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype
    dot_general: Callable | None = None
    dot_general_cls: Any = None

    @compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        features = _as_tuple(self.features)
        batch_dims = _as_tuple(self.batch_dims)
        if batch_dims and set(batch_dims) != set(range(max(batch_dims) + 1)):
            raise ValueError(f"batch_dims {batch_dims} must be consecutive leading dimensions "
                             "starting from 0.")
        axis = _nonneg_axes(_as_tuple(self.axis), inputs.ndim)
        batch_dims = _nonneg_axes(batch_dims, inputs.ndim)
        n_batch, n_axis = len(batch_dims), len(axis)

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
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        dot_general = _pick(self.dot_general_cls, self.dot_general, lax.dot_general)
        kernel_batch = tuple(range(n_batch))
        kernel_contract = tuple(range(n_batch, n_batch + n_axis))
        out = dot_general(inputs, kernel, ((axis, kernel_contract), (batch_dims, kernel_batch)),
                          precision=self.precision)
        if bias is None:
            return out
        # The output is (batch dims, remaining input axes, features); the bias
        # varies only along the batch dims and the features.
        kept = [a for a in range(inputs.ndim) if a not in axis]
        bias_shape = tuple(inputs.shape[a] if a in batch_dims else 1 for a in kept) + features
        return out + jnp.reshape(bias, bias_shape)


def canonicalize_padding(padding: PaddingLike, rank: int) -> str | list[tuple[int, int]]:
    """Linen's padding spellings as ``lax`` takes them: a string, or ``rank`` ``(low, high)`` pairs.

    An int pads every spatial axis by that much on both sides; in a sequence an
    int pads that one axis on both sides.
    """
    if isinstance(padding, str):
        return padding
    if isinstance(padding, int):
        return [(padding, padding)] * rank
    if isinstance(padding, Sequence) and len(padding) == rank:
        pairs = [(p, p) if isinstance(p, int) else tuple(p) for p in padding]
        if all(len(p) == 2 for p in pairs):
            return pairs
    raise ValueError(f"Invalid padding {padding!r}: expected a string, an int, or a sequence of {rank} "
                     "ints or (low, high) pairs.")


def _conv_dimension_numbers(ndim: int) -> lax.ConvDimensionNumbers:
    """Channels-last input and output (``N...C``), kernel ``...IO``."""
    io = (0, ndim - 1) + tuple(range(1, ndim - 1))
    return lax.ConvDimensionNumbers(io, (ndim - 1, ndim - 2) + tuple(range(ndim - 2)), io)


def _per_axis(x: int | Sequence[int] | None, rank: int) -> tuple[int, ...]:
    """Strides/dilations: ``None`` means 1, an int applies to every spatial axis."""
    if x is None:
        x = 1
    return (x,) * rank if isinstance(x, int) else tuple(x)


def _flatten_batch(inputs: jax.Array, rank: int) -> tuple[jax.Array, tuple[int, ...] | None]:
    """Folds all leading batch axes (possibly none) into one; returns how to undo it."""
    n_batch = inputs.ndim - rank - 1
    if n_batch == 1:
        return inputs, None
    return jnp.reshape(inputs, (-1,) + inputs.shape[n_batch:]), inputs.shape[:n_batch]


def _restore_batch(y: jax.Array, batch_shape: tuple[int, ...] | None) -> jax.Array:
    return y if batch_shape is None else jnp.reshape(y, batch_shape + y.shape[1:])


def _feature_bias(mdl: Module) -> jax.Array | None:
    """The per-output-feature ``bias`` parameter, or None without ``use_bias``."""
    return mdl.param("bias", mdl.bias_init, (mdl.features,), mdl.param_dtype) if mdl.use_bias else None


def _masked_kernel(mdl: Module, kernel_shape: tuple[int, ...]) -> jax.Array:
    mask = mdl.mask
    if mask is not None and tuple(mask.shape) != kernel_shape:
        raise ValueError(f"Mask needs to have the same shape as weights. Shapes are: {tuple(mask.shape)}, "
                         f"{kernel_shape}")
    kernel = mdl.param("kernel", mdl.kernel_init, kernel_shape, mdl.param_dtype)
    return kernel if mask is None else kernel * mask


class _Conv(Module):
    """An N-d convolution over channels-last inputs; ``shared_weights`` picks the kind.

    ``padding`` is ``'SAME'``, ``'VALID'``, ``'CIRCULAR'`` (periodic: the input
    is wrap-padded, then convolved ``'VALID'``), ``'REFLECT'``, ``'CAUSAL'``
    (1-D only: left padding so output ``t`` sees inputs ``<= t``), an int, or
    one int / ``(low, high)`` pair per spatial axis.
    """

    features: int
    kernel_size: int | Sequence[int]
    strides: None | int | Sequence[int] = 1
    padding: PaddingLike = "SAME"
    input_dilation: None | int | Sequence[int] = 1
    kernel_dilation: None | int | Sequence[int] = 1
    feature_group_count: int = 1
    use_bias: bool = True
    mask: jax.Array | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: PrecisionLike = None
    kernel_init: initializers.Initializer = default_kernel_init
    bias_init: initializers.Initializer = initializers.zeros_init()
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype
    conv_general_dilated: Callable | None = None
    conv_general_dilated_cls: Any = None

    @compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel_size = _as_tuple(self.kernel_size)
        rank = len(kernel_size)
        inputs, batch_shape = _flatten_batch(inputs, rank)
        strides = _per_axis(self.strides, rank)
        input_dilation = _per_axis(self.input_dilation, rank)
        kernel_dilation = _per_axis(self.kernel_dilation, rank)

        padding = canonicalize_padding(self.padding, rank)
        if padding in ("CIRCULAR", "REFLECT"):
            # Pad by the dilated kernel's reach so a 'VALID' convolution keeps the size 'SAME' would.
            reach = [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation)]
            pads = [(0, 0)] + [((r - 1) // 2, r // 2) for r in reach] + [(0, 0)]
            inputs = jnp.pad(inputs, pads, mode="wrap" if padding == "CIRCULAR" else "reflect")
            padding = "VALID"
        elif padding == "CAUSAL":
            if rank != 1:
                raise ValueError("Causal padding is only implemented for 1D convolutions.")
            inputs = jnp.pad(inputs, [(0, 0), (kernel_dilation[0] * (kernel_size[0] - 1), 0), (0, 0)])
            padding = "VALID"

        in_features = np.shape(inputs)[-1]
        conv = _pick(self.conv_general_dilated_cls, self.conv_general_dilated, lax.conv_general_dilated)
        numbers = _conv_dimension_numbers(inputs.ndim)
        if not self.shared_weights:
            return _restore_batch(self._local(inputs, conv, numbers, kernel_size, strides, padding,
                                              input_dilation, kernel_dilation), batch_shape)
        if in_features % self.feature_group_count:
            raise ValueError(f"feature_group_count={self.feature_group_count} does not divide the "
                             f"{in_features} input features.")
        kernel = _masked_kernel(self, kernel_size + (in_features // self.feature_group_count, self.features))
        bias = _feature_bias(self)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = conv(inputs, kernel, strides, padding, lhs_dilation=input_dilation, rhs_dilation=kernel_dilation,
                 dimension_numbers=numbers, feature_group_count=self.feature_group_count,
                 precision=self.precision)
        return _restore_batch(_add_bias(y, bias), batch_shape)

    @property
    def shared_weights(self) -> bool:
        """True: one kernel slides over the input (``Conv``); False: a kernel per output position."""
        raise NotImplementedError

    @nowrap
    def _local(self, inputs: jax.Array, conv: Callable, numbers: lax.ConvDimensionNumbers,
               kernel_size: tuple[int, ...], strides: tuple[int, ...], padding: Any,
               input_dilation: tuple[int, ...], kernel_dilation: tuple[int, ...]) -> jax.Array:
        """The unshared convolution: each output position has its own ``(window, features)`` kernel.

        The output's spatial shape is the one the shared convolution would
        give; kernel and bias carry it as leading axes.
        """
        if self.feature_group_count != 1:
            not_provided("ConvLocal with feature_group_count != 1",
                         "lax.conv_general_dilated_local has no feature groups (nor has Linen's ConvLocal).",
                         f"use feature_group_count=1 (got {self.feature_group_count}).")
        in_features = np.shape(inputs)[-1]
        out_shape = jax.eval_shape(
            lambda lhs, rhs: conv(lhs, rhs, strides, padding, lhs_dilation=input_dilation,
                                  rhs_dilation=kernel_dilation, dimension_numbers=numbers),
            inputs, jax.ShapeDtypeStruct(kernel_size + (in_features, self.features), inputs.dtype)).shape
        kernel = _masked_kernel(self, out_shape[1:-1] + (math.prod(kernel_size) * in_features, self.features))
        bias = (self.param("bias", self.bias_init, out_shape[1:], self.param_dtype) if self.use_bias
                else None)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = lax.conv_general_dilated_local(inputs, kernel, strides, padding, kernel_size,
                                           lhs_dilation=input_dilation, rhs_dilation=kernel_dilation,
                                           dimension_numbers=numbers, precision=self.precision)
        return _add_bias(y, bias)


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
    kernel_size: int | Sequence[int]
    strides: Sequence[int] | None = None
    padding: PaddingLike = "SAME"
    kernel_dilation: Sequence[int] | None = None
    use_bias: bool = True
    mask: jax.Array | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: PrecisionLike = None
    kernel_init: initializers.Initializer = default_kernel_init
    bias_init: initializers.Initializer = initializers.zeros_init()
    transpose_kernel: bool = False
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype
    preferred_element_type: Any = None

    @compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel_size = _as_tuple(self.kernel_size)
        rank = len(kernel_size)
        inputs, batch_shape = _flatten_batch(inputs, rank)
        strides = _per_axis(self.strides, rank)
        kernel_dilation = _per_axis(self.kernel_dilation, rank)

        in_features = np.shape(inputs)[-1]
        io = (self.features, in_features) if self.transpose_kernel else (in_features, self.features)
        kernel = _masked_kernel(self, kernel_size + io)
        padding = canonicalize_padding(self.padding, rank)
        circular = padding == "CIRCULAR"
        bias = _feature_bias(self)
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        y = lax.conv_transpose(inputs, kernel, strides, "VALID" if circular else padding,
                               rhs_dilation=kernel_dilation, transpose_kernel=self.transpose_kernel,
                               precision=self.precision, preferred_element_type=self.preferred_element_type)
        if circular:
            y = self._wrap_onto_period(y, [n * s for n, s in zip(inputs.shape[1:-1], strides)])
        return _restore_batch(_add_bias(y, bias), batch_shape)

    @nowrap
    def _wrap_onto_period(self, y: jax.Array, periods: list[int]) -> jax.Array:
        """Sums every spatial axis of ``y`` modulo its period (periodic boundary conditions).

        Each axis is zero-padded to an odd multiple of its period, centred the
        way the kernel orientation requires, then folded and summed.
        """
        for i, period in enumerate(periods, start=1):
            extra = (period - y.shape[i]) % (2 * period)
            small, large = extra // 2, (extra + 1) // 2
            pads = [(0, 0)] * y.ndim
            pads[i] = (small, large) if self.transpose_kernel else (large, small)
            y = jnp.pad(y, pads)
            y = jnp.reshape(y, y.shape[:i] + (-1, period) + y.shape[i + 1:]).sum(axis=i)
        return y


class Embed(Module):
    """A lookup table from integers in ``[0, num_embeddings)`` to ``features``-vectors.

    ``attend`` reuses the same table as an output projection (weight tying):
    it returns the inner product of a query with every embedding.
    """

    num_embeddings: int
    features: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    embedding_init: initializers.Initializer = default_embed_init
    promote_dtype: PromoteDtypeFn = dtypes.promote_dtype

    def setup(self) -> None:
        # Created in setup, not compact, so that both __call__ and attend see the same table.
        self.embedding = self.param("embedding", self.embedding_init, (self.num_embeddings, self.features),
                                    self.param_dtype)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"Embed input must have an integer dtype, got {inputs.dtype}.")
        (embedding,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
        if self.num_embeddings == 1:
            return jnp.broadcast_to(embedding, inputs.shape + (self.features,))
        return jnp.take(embedding, inputs, axis=0)

    def attend(self, query: jax.Array) -> jax.Array:
        """``query @ embedding.T``: logits over the vocabulary."""
        query, embedding = self.promote_dtype(query, self.embedding, dtype=self.dtype)
        return jnp.dot(query, embedding.T)
