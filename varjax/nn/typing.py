"""The type aliases Linen's layer signatures use, so annotations port with the code.

``from flax.typing import Array, Dtype`` becomes ``from varjax.nn.typing import ...``;
the layer modules re-export the aliases their signatures name (``nn.linear.PrecisionLike``),
as Linen's modules do.  Those that mean what a ``vj.typing`` alias means ARE that alias
(``Dtype``, ``PrecisionLike``, ...), so a layer's ``dtype: Dtype | None`` reads ``Dtype`` in
``help()`` and the reference, the same name the object core's signatures use; the rest are
Linen's own, named the same way.  They are annotations only: nothing checks them at run time.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import jax
from typing_extensions import TypeAliasType

from varjax.ir.typing import Axes, DotGeneralT, Dtype, Initializer, PrecisionLike, PRNGKey, PyTree, Shape

__all__ = ["Array", "Axes", "CaptureIntermediates", "Carry", "ConvGeneralDilatedT", "DotGeneralT",
           "Dtype", "Initializer", "LaxPadding", "LogicalPartitionSpecPytree", "PRNGKey", "PaddingLike",
           "PrecisionLike", "Shape"]

Array = TypeAliasType("Array", Union[jax.Array, Any])
"""An array (Linen's ``Array``: a ``jax.Array``, or what stands for one under a transform)."""

ConvGeneralDilatedT = TypeAliasType("ConvGeneralDilatedT", Callable[..., jax.Array])
"""A function with ``jax.lax.conv_general_dilated``'s signature, used in its place."""

PaddingLike = TypeAliasType("PaddingLike", Union[str, int, Sequence[Union[int, tuple[int, int]]]])
"""A convolution's padding: ``"SAME"``/``"VALID"``/``"CIRCULAR"``/..., one int for every side,
or per spatial dimension an int or a ``(low, high)`` pair."""

LaxPadding = TypeAliasType("LaxPadding", Union[str, Sequence[tuple[int, int]]])
"""Padding as ``jax.lax`` takes it: a name or a ``(low, high)`` pair per spatial dimension."""

Carry = TypeAliasType("Carry", PyTree)
"""A recurrent cell's state between steps: an array (``GRUCell``, ``SimpleCell``), a tuple of
them (``LSTMCell``'s ``(c, h)``), or any pytree a custom cell keeps."""

CaptureIntermediates = TypeAliasType("CaptureIntermediates", Union[bool, Callable[[Any, str], bool]])
"""Which calls ``apply``/``init`` sow into ``intermediates``: True (every ``__call__``'s
output), False (none), or a filter ``f(module, method_name) -> bool``."""

LogicalPartitionSpecPytree = TypeAliasType("LogicalPartitionSpecPytree", PyTree)
"""Logical axis names for a tree of arrays (Linen's name): a ``PartitionSpec`` of logical names
(``P("batch", "embed")``), or a tuple of them, per array, or a pytree prefix of the arrays with
those (or None, unconstrained) at its leaves; ``nn.logical_axis_rules`` maps the names to mesh
axes."""
