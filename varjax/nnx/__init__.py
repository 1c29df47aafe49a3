"""``varjax.nnx``: Flax NNX by one import, on varjax's IR (SPEC §6; ``notes/nnx.md``).

``from varjax import nnx`` in place of ``from flax import nnx``.  Built so far: modules
(``Module``, ``Pytree``/``Object``, ``List``/``Dict``, ``data``/``static``), the Variable
types, ``Rngs`` (varjax's, which derives NNX's keys bit for bit), ``Linear``, the
activations and initializers.  An NNX module is a pytree of Variables, so varjax's
object-mode transforms (``vj.jit``, ``vj.grad``, ``vj.vmap``...) take it now; the ``nnx``
transforms, graph and state functions and the other layers are not built yet, and using
one of their names raises ``NotProvidedError`` saying so (``unbuilt.py``).
"""
from __future__ import annotations

import typing

from varjax.functional import initializers as initializers
from varjax.functional.activations import (
    celu,
    elu,
    gelu,
    glu,
    hard_sigmoid,
    hard_silu,
    hard_swish,
    hard_tanh,
    leaky_relu,
    log_sigmoid,
    log_softmax,
    logsumexp,
    one_hot,
    relu,
    relu6,
    selu,
    sigmoid,
    silu,
    soft_sign,
    softmax,
    softplus,
    standardize,
    swish,
    tanh,
)
from varjax.nnx import filterlib, graph, statelib
from varjax.nnx import unbuilt as _unbuilt
from varjax.nnx.filterlib import All, Any, Everything, Not, Nothing, OfType, PathContains, WithTag
from varjax.nnx.graph import (
    GraphDef,
    clone,
    graphdef,
    merge,
    replace_by_pure_dict,
    split,
    state,
    to_pure_dict,
    update,
)
from varjax.nnx.linear import Linear
from varjax.nnx.module import Module, iter_children, iter_modules
from varjax.nnx.pytree import Dict, List, Object, Pytree, data, static
from varjax.nnx.statelib import State
from varjax.nnx.variables import (
    BatchStat,
    Cache,
    Intermediate,
    LoRAParam,
    OptState,
    Param,
    Perturbation,
    RngCount,
    RngKey,
    RngState,
    Variable,
    variable_name_from_type,
    variable_type_from_name,
)
from varjax.trace.rngs import Rngs, RngStream

__all__ = [
    "graph", "statelib", "filterlib", "split", "merge", "state", "update", "clone", "graphdef",
    "GraphDef", "State", "to_pure_dict", "replace_by_pure_dict", "All", "Any", "Not", "Nothing",
    "Everything", "OfType", "PathContains", "WithTag",
    "Module", "Pytree", "Object", "List", "Dict", "data", "static", "iter_modules",
    "iter_children", "Variable", "Param", "BatchStat", "Cache", "Intermediate", "Perturbation",
    "OptState", "LoRAParam", "RngState", "RngKey", "RngCount", "variable_name_from_type",
    "variable_type_from_name", "Rngs", "RngStream", "Linear", "initializers",
    "celu", "elu", "gelu", "glu", "hard_sigmoid", "hard_silu", "hard_swish", "hard_tanh",
    "leaky_relu", "log_sigmoid", "log_softmax", "logsumexp", "one_hot", "relu", "relu6", "selu",
    "sigmoid", "silu", "soft_sign", "softmax", "softplus", "standardize", "swish", "tanh",
]


def __getattr__(name: str) -> typing.NoReturn:
    return _unbuilt.missing(name, __name__)


def __dir__() -> list[str]:
    return sorted({*__all__, *_unbuilt.NOT_YET})
