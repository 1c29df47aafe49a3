"""The names varjax's public signatures use for what they accept (``vj.typing``).

A parameter that takes "anything of a kind" (a pytree, a dtype, a filter of collections, a
``passes=`` list) is annotated with one of these aliases instead of a bare ``Any``, so that
``help()`` and the API reference say what to pass.  Each is a ``TypeAliasType``: its name is
what a signature shows, its value the type a checker sees, and nothing checks it at run time.
The frontends' own aliases (``varjax.nn.typing``, Linen's ``Dtype``/``PrecisionLike``) are
these, re-exported.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Union

import jax
import numpy as np
from typing_extensions import TypeAliasType

__all__ = ["ArrayLike", "Axes", "AxesPrefix", "AxisName", "CollectionFilter", "DotGeneralT",
           "Dtype", "Filter", "Initializer", "Key", "Metadata", "Node", "PRNGKey", "Passes",
           "PathParts", "PrecisionLike", "Prefix", "PureDict", "PyTree", "RngSeed", "RngSplit",
           "RngsLike", "Shape", "ShardingLike", "StateLike", "StreamFilter", "Target",
           "VariableDict"]

PyTree = TypeAliasType("PyTree", Any)
"""A JAX pytree: nested tuples, lists, dicts and registered nodes, with arrays (or any other
value) at the leaves."""

ArrayLike = TypeAliasType("ArrayLike", Union[jax.Array, np.ndarray, np.generic, bool, int,
                                             float, complex])
"""An array or a value ``jnp.asarray`` takes (a NumPy array, a Python number)."""

PRNGKey = TypeAliasType("PRNGKey", jax.Array)
"""A JAX PRNG key: ``jax.random.key(seed)`` (typed) or ``jax.random.PRNGKey(seed)`` (raw)."""

Dtype = TypeAliasType("Dtype", Union[str, type, np.dtype, Any])
"""A dtype or what names one: ``jnp.float32``, ``np.dtype("bfloat16")``, ``"float16"``."""

RngsLike = TypeAliasType("RngsLike", Union[jax.Array, Mapping[str, jax.Array], Any])
"""Where a call draws its randomness (``rngs=``): a PRNG key (the ``params`` stream), a dict
of stream name to key (typed or raw), or a ``vj.Rngs`` (whose streams the call advances)."""

RngSeed = TypeAliasType("RngSeed", Union[int, jax.Array])
"""What an RNG stream starts from: an int seed, or a PRNG key, typed (``jax.random.key(0)``)
or raw (``jax.random.PRNGKey(0)``)."""

Shape = TypeAliasType("Shape", Sequence[int])
"""An array shape."""

Axes = TypeAliasType("Axes", Union[int, Sequence[int]])
"""One axis or several."""

AxisName = TypeAliasType("AxisName", Hashable)
"""The name of a mapped axis (``vmap``'s ``axis_name``, a mesh axis)."""

PrecisionLike = TypeAliasType(
    "PrecisionLike", Union[None, str, jax.lax.Precision, tuple[str, str],
                           tuple[jax.lax.Precision, jax.lax.Precision]])
"""A ``jax.lax.Precision``, its name, or a pair of them (one per operand)."""

Initializer = TypeAliasType("Initializer", Callable[..., Any])
"""``init(key, shape, dtype) -> array``, as ``jax.nn.initializers`` builds them."""

DotGeneralT = TypeAliasType("DotGeneralT", Callable[..., jax.Array])
"""A function with ``jax.lax.dot_general``'s signature, used in its place."""

ShardingLike = TypeAliasType("ShardingLike", Any)
"""A ``jax.sharding.Sharding`` or ``PartitionSpec``, or a pytree prefix of the arguments with
those (or None, unconstrained) at its leaves, as ``jax.jit``'s ``in_shardings`` takes."""

Metadata = TypeAliasType("Metadata", Mapping[str, Any])
"""A variable's metadata: names to values (``sharding_names``, ``out_sharding``, ...)."""

CollectionFilter = TypeAliasType(
    "CollectionFilter", Union[bool, str, Sequence[str], Any])
"""Which variable collections: a name (``"params"``), several, ``True`` (every one),
``False`` (none) or a ``vj.DenyList`` (every one but those)."""

StreamFilter = TypeAliasType("StreamFilter", Union[bool, str, Sequence[str], Any])
"""Which RNG streams a lifted transform hands its body: a stream name, several, ``True``
(every one), ``False`` (none) or a ``vj.DenyList`` (every one but those)."""

VariableDict = TypeAliasType("VariableDict", Mapping[str, Mapping[str, Any]])
"""Variables by collection, then by path: ``{"params": {"Dense_0": {"kernel": ...}}}``, what
``init`` returns and ``apply`` takes."""

Target = TypeAliasType("Target", Union[type, Callable[..., Any]])
"""What a transform applies to: a module class (lifted over its methods), a module method,
or a function."""

Passes = TypeAliasType("Passes", Union[str, Sequence[Any]])
"""Passes to run on a program: ``varjax.passes`` instances, pipeline strings
(``"cast-params{dtype=bfloat16}"``), or a list mixing them."""

AxesPrefix = TypeAliasType("AxesPrefix", Union[int, None, Sequence[Any], Mapping[Any, Any]])
"""Where each argument (or output) is mapped: an axis, None (not mapped), or a pytree prefix
of the arguments with those at its leaves, as ``jax.vmap``'s ``in_axes``."""

Filter = TypeAliasType("Filter", Any)
"""Which Variables of an object: a Variable type (``nnx.Param``), a collection name, a
predicate ``f(path, variable) -> bool``, a tuple of filters (any of them), ``...`` or True
(every one), None or False (none), or a filter object (``nnx.Not``, ``nnx.PathContains``)."""

RngSplit = TypeAliasType(
    "RngSplit", Union[int, Sequence[int], Mapping[Filter, Union[int, Sequence[int], None]]])
"""How to split RNG streams along new leading axes: a count or a shape for every stream, or
``{stream filter: count, shape or None}``, each stream taking its first matching filter's
(None, or no match: not split)."""

Node = TypeAliasType("Node", Any)
"""An object of a graph: a module, a Variable, an ``Rngs``, or a list, tuple or dict holding
them (and plain values)."""

Key = TypeAliasType("Key", Hashable)
"""One step of a path in an object (an NNX module, a container of Variables): an attribute
name, a list index, a dict key, or an RNG stream's name (``"rngs"``, ``"default"``)."""

PathParts = TypeAliasType("PathParts", tuple[Key, ...])
"""The path of a leaf or node in an object, from its root: ``("layers", 0, "kernel")``, as
``nnx.state`` names it and filters see it."""

StateLike = TypeAliasType("StateLike", Mapping[Key, Any])
"""A state: an ``nnx.State`` (``nnx.state``'s, ``split``'s), a ``GraphState``, or a nested
mapping of path keys to Variables and values that ``nnx.State(...)`` takes."""

PureDict = TypeAliasType("PureDict", Mapping[Key, Any])
"""A state's nested dict of plain values, Variables replaced by their values, as
``nnx.to_pure_dict`` gives it and a checkpoint stores it."""

Prefix = TypeAliasType("Prefix", Any)
"""A transform's value for each part of a pytree, as a JAX prefix of it: an axis
(``in_axes``), a sharding, None, an ``nnx.StateAxes``, or a pytree of those, each standing for
the whole subtree under it."""
