"""Collection filters, with Flax Linen's meaning.

A filter is a collection name, a list/tuple of filters (any matches), ``True``
(every collection), ``False`` (none) or ``DenyList(filter)`` (everything the
inner filter does not match).  ``mutable=``, lifted-transform
``variable_axes`` keys and ``split_rngs`` keys are all filters.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Union

from varjax.ir.typing import CollectionFilter


@dataclasses.dataclass(frozen=True)
class DenyList:
    """Matches every collection that ``deny`` does not match."""

    deny: CollectionFilter

    def __post_init__(self):
        object.__setattr__(self, "deny", freeze(self.deny))


# After DenyList, so that the alias holds the class, not a name to resolve later.
Filter = Union[bool, str, DenyList, tuple, list]


def freeze(f: Filter) -> Any:
    """A hashable, canonical form of ``f`` (used in cache keys)."""
    if isinstance(f, (list, tuple, set, frozenset)):
        return tuple(freeze(x) for x in f)
    if isinstance(f, (bool, str, DenyList)):
        return f
    raise TypeError(f"invalid collection filter {f!r}: use a name, a list of names, "
                    "True, False or vj.DenyList(...)")


def matches(f: Filter, collection: str) -> bool:
    if f is True:
        return True
    if f is False or f is None:
        return False
    if isinstance(f, str):
        return f == collection
    if isinstance(f, DenyList):
        return not matches(f.deny, collection)
    if isinstance(f, (tuple, list, set, frozenset)):
        return any(matches(x, collection) for x in f)
    raise TypeError(f"invalid collection filter {f!r}")
