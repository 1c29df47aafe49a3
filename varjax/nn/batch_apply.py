"""``BatchApply``: call a function with several leading axes merged into one, as in Linen.

Useful to run a layer written for ``[batch, features]`` over ``[time, batch,
features]`` without ``vmap``: the leading ``num_dims`` axes of every input array
that has that many are merged, ``f`` runs once, and the leading axis of every
output is split back.  It is a plain callable, not a ``Module``: a module called
inside it keeps its own name and variables.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np

from varjax.ir import errors
from varjax.trace.context import site

__all__ = ["BatchApply"]


class BatchApply:
    """``BatchApply(f, num_dims=2)(*args, **kwargs)``: ``f`` over merged leading axes.

    Arrays with fewer than ``num_dims`` axes are passed unchanged.  The leading
    shape the outputs are split into is the one of the first array (in
    ``args``, then ``kwargs``) that has ``num_dims`` axes.
    """

    def __init__(self, f: Callable[..., Any], num_dims: int = 2):
        self._f = f
        self.num_dims = num_dims

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        n = self.num_dims
        example = next((x for x in jax.tree.leaves((args, kwargs)) if np.ndim(x) >= n), None)
        if example is None:
            raise errors.ConfigError(f"BatchApply needs at least one input with {n} or more axes to merge.",
                                     **site(), fix=f"pass an array with >= {n} axes, or lower num_dims.")
        leading = tuple(np.shape(example)[:n])

        def merge(x: Any) -> Any:
            if np.ndim(x) < n:
                return x
            shape = np.shape(x)
            return x.reshape((math.prod(shape[:n]),) + tuple(shape[n:]))

        args, kwargs = jax.tree.map(merge, (args, kwargs))
        return jax.tree.map(lambda y: y.reshape(leading + tuple(np.shape(y)[1:])), self._f(*args, **kwargs))
