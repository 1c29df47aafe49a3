"""flax.nnx.nn.dtypes: the shared dtype promotion in NNX's forms.

``canonicalize_dtype`` is ``varjax.functional.dtypes``'s (flax.nnx's has its signature);
``promote_dtype`` takes the arrays as one tuple and returns a tuple, as NNX's layers call
their ``promote_dtype`` argument (``varjax.nnx.linear``'s, the layers' default).
"""
from __future__ import annotations

from varjax.functional.dtypes import canonicalize_dtype
from varjax.nnx.linear import promote_dtype

__all__ = ["canonicalize_dtype", "promote_dtype"]
