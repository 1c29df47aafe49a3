"""The names varjax.nnx's signatures use for NNX's own kinds of value, beside ``vj.typing``'s
(``Node``, ``Filter``, ``PyTree``): a path, a state given as a mapping, a transform's prefix.

flax.nnx names these in ``flax.typing`` (``Key``, ``PathParts``) or leaves them ``Any``; here
each is a ``TypeAliasType``, so ``help()`` and the API reference show the name and its
docstring says what to pass.  They are annotations only: nothing checks them at run time.
This module imports nothing of varjax.nnx, so every NNX module (``filterlib`` included) can
use it.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from typing_extensions import TypeAliasType

__all__ = ["Key", "PathParts", "Prefix", "PureDict", "StateLike"]

Key = TypeAliasType("Key", Hashable)
"""One step of a path in an NNX object: an attribute name, a list index, a dict key, or an
RNG stream's name (``"rngs"``, ``"default"``, ``"count"``)."""

PathParts = TypeAliasType("PathParts", tuple[Key, ...])
"""The path of a leaf or node in an NNX object, from its root: ``("layers", 0, "kernel")``,
as ``nnx.state`` names it and filters see it."""

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
