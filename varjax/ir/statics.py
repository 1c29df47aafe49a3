"""Static values as cache keys: equal only when type and value are equal, recursively.

Python says ``1 == 1.0 == True`` and gives the three the same hash, so a cache keyed on
the bare values serves the ``int`` trace to a ``float`` or ``bool`` call (``jnp.full((2,),
c)`` then has the wrong dtype).  ``jax.jit(static_argnums=...)`` keeps them apart, and so
must every varjax cache: the static leaves of ``functionalize`` calls, the fields of
modules that share their trace, and the lifted-call keys built on both.  ``typed`` is the
one place that turns a static value into such a key.
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

# Types whose ``==`` is exact once the type is fixed: keyed as ``(type, value)``.
_ATOMS = (int, float, complex, bool, str, bytes, type(None), type(Ellipsis))
# Types keyed by their own ``==`` with no container or dataclass check to make: dtypes and
# classes (captured by initializers), functions.
_OPAQUE = (type, np.dtype, types.FunctionType, types.BuiltinFunctionType)


def typed(value: Any) -> Any:
    """A hashable key for ``value`` that tells ``1``, ``1.0`` and ``True`` apart, also
    inside tuples, lists, dicts, sets and dataclass fields (modules, configs).

    Anything else keys by its own ``==``/``hash`` next to its type; an unhashable value
    raises ``TypeError`` when the key is hashed, as the bare value would."""
    t = type(value)
    if t in _ATOMS:
        return (t, value)
    if t is tuple:          # shapes, closure cells: the common containers, without the ABCs
        return (t, tuple(typed(v) for v in value))
    if isinstance(value, _OPAQUE):
        return (t, value)
    if isinstance(value, (tuple, list)):
        return (t, tuple(typed(v) for v in value))
    # Before the Mapping test: a module is a dataclass of a class made per model, and the
    # first isinstance of a new class against an ABC walks every registered subclass.
    if dataclasses.is_dataclass(value) and t.__dataclass_params__.eq:
        # field-wise equality, as ``==`` compares
        return (t, tuple((f.name, typed(getattr(value, f.name)))
                         for f in dataclasses.fields(value) if f.compare))
    if isinstance(value, Mapping):
        return (t, frozenset((typed(k), typed(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (t, frozenset(typed(v) for v in value))
    return (t, value)


class Exact:
    """``value`` compared and hashed by ``typed``: the static half of a pytree node (its
    aux data), which JAX compares with ``==`` to key ``jax.jit``'s cache, so that an
    object-mode transform traces ``1``, ``1.0`` and ``True`` (in a module field or in
    ``Variable`` metadata) apart, as ``functionalize`` does for static arguments.

    The key is made once per instance; an unhashable value raises ``TypeError`` when it is
    hashed, as the bare value would."""

    __slots__ = ("value", "_key")

    def __init__(self, value: Any):
        self.value, self._key = value, typed(value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Exact) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"Exact({self.value!r})"
