"""``nnx.nn``: flax.nnx's layer namespace, ``flax.nnx.nn`` and its submodules by the same
names (``activations``, ``attention``, ``dtypes``, ``initializers``, ``linear``, ``lora``,
``normalization``, ``recurrent``, ``stochastic``).

Ported code that imports a layer from its flax.nnx submodule (``from flax.nnx.nn.linear
import Linear``) runs with ``varjax.nnx.nn``: each name is ``varjax.nnx``'s own object,
imported from where it is defined, so ``nnx.nn.linear.Linear is nnx.Linear``.  ``initializers`` is
``nnx.initializers`` itself, as in flax.nnx.
"""
from __future__ import annotations

from varjax.functional import initializers
from varjax.nnx.nn import (
    activations,
    attention,
    dtypes,
    linear,
    lora,
    normalization,
    recurrent,
    stochastic,
)

__all__ = ["activations", "attention", "dtypes", "initializers", "linear", "lora",
           "normalization", "recurrent", "stochastic"]
