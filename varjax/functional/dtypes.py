"""The dtype a layer computes in, and the explicit casts that get its operands there.

A layer mixes its inputs with parameters of ``param_dtype``.  ``dtype=None`` means
"whatever JAX's standard promotion of the arguments gives"; a given ``dtype`` overrides
inference.  Either way every argument is then cast *explicitly*, so the arithmetic that
follows never promotes implicitly.

The inference always uses JAX's *standard* promotion lattice, even when the user runs with
``jax_numpy_dtype_promotion='strict'``: the cast is the layer's deliberate choice, which is
what strict mode asks code to make, so it must not be rejected as an accidental promotion.

Python scalars are weakly typed, so ``promote_dtype(x_bf16, 1.0)`` stays ``bfloat16``,
exactly as ``x_bf16 + 1.0`` would.  Both frontends compute through these three functions,
so a Linen layer and its NNX twin agree on every result dtype.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from varjax.ir.typing import Dtype

__all__ = ["canonicalize_dtype", "promote_dtype", "cast"]


def canonicalize_dtype(*args: Any, dtype: Dtype | None = None, inexact: bool = True) -> Dtype:
    """The dtype ``args`` (``None`` entries ignored) should be cast to.

    With ``inexact=True`` an inferred integer/bool dtype is widened to a
    floating one (layers that take means cannot compute in ``int32``), and a
    given ``dtype`` must already be inexact.
    """
    if dtype is None:
        dtypes = {x.dtype for x in args if isinstance(x, jax.Array) and not x.weak_type}
        if len(dtypes) == 1 and all(x is None or isinstance(x, jax.Array) for x in args):
            (only,) = dtypes                    # the common case: nothing to promote
            if not inexact or jnp.issubdtype(only, jnp.inexact):
                return only
        with jax.numpy_dtype_promotion("standard"):
            # A nested list (the model input) counts as jnp.asarray sees it, as in Linen.
            dtype = jnp.result_type(*(jnp.asarray(x) if isinstance(x, (list, tuple)) else x
                                      for x in args if x is not None))
            if inexact and not jnp.issubdtype(dtype, jnp.inexact):
                dtype = jnp.promote_types(jnp.float32, dtype)
    if inexact and not jnp.issubdtype(dtype, jnp.inexact):
        raise ValueError(f"dtype must be inexact (floating or complex) here, got {jnp.dtype(dtype)}")
    return dtype


def promote_dtype(*args: Any, dtype: Dtype | None = None, inexact: bool = True) -> list[Any]:
    """``args`` cast to one common dtype (see ``canonicalize_dtype``); ``None`` stays ``None``."""
    dtype = canonicalize_dtype(*args, dtype=dtype, inexact=inexact)
    return [cast(x, dtype) for x in args]


def cast(x: Any, dtype: Dtype) -> jax.Array | None:
    """``x`` as an array of ``dtype``; an array that already is one is returned as is
    (layers promote on every call, and ``jnp.asarray`` costs trace time even then)."""
    if x is None:
        return None
    if isinstance(x, jax.Array) and x.dtype == dtype and not getattr(x, "weak_type", False):
        return x
    return jnp.asarray(x, dtype)
