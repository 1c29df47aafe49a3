"""The type aliases Linen's layer signatures use, so annotations port with the code.

``from flax.typing import Array, Dtype`` becomes ``from varjax.nn.typing import ...``;
the layer modules re-export the aliases their signatures name (``nn.linear.PrecisionLike``),
as Linen's modules do.  They are annotations only: nothing checks them at run time.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import jax
import numpy as np
from jax import lax

__all__ = ["Array", "Axes", "ConvGeneralDilatedT", "DotGeneralT", "Dtype", "Initializer",
           "LaxPadding", "PRNGKey", "PaddingLike", "PrecisionLike", "Shape"]

Array = Union[jax.Array, Any]
PRNGKey = jax.Array
Dtype = Union[str, type, np.dtype, Any]
Shape = Sequence[int]
Axes = Union[int, Sequence[int]]
Initializer = Union[jax.nn.initializers.Initializer, Callable[..., Any]]
PrecisionLike = Union[None, str, lax.Precision, tuple[str, str], tuple[lax.Precision, lax.Precision]]
DotGeneralT = Callable[..., Array]
ConvGeneralDilatedT = Callable[..., Array]
PaddingLike = Union[str, int, Sequence[Union[int, tuple[int, int]]]]
LaxPadding = Union[str, Sequence[tuple[int, int]]]
