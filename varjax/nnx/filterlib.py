"""NNX's filter language: which leaves of an object ``state``/``split`` select.

A filter is turned into a predicate ``(path, value) -> bool`` (``to_predicate``), ``path``
being the leaf's path in the object (attribute names, list indices, stream names):

* a type: the leaf is an instance (``nnx.Param``; ``nnx.Variable`` for every Variable);
* a string: the leaf's collection is that name (SPEC §6: a type and its collection name
  select the same Variables, ``'params'`` as ``nnx.Param``), or its ``tag`` metadata is
  (an ``RngStream``'s tag, its stream name, for the functions choosing streams);
* ``...`` or ``True``: everything; ``None`` or ``False``: nothing;
* a list or tuple: any of them; a callable: itself;
* ``Not``, ``All``, ``Any``, ``OfType``, ``PathContains``, ``WithTag``, ``Everything``,
  ``Nothing``: the combinators by name.
"""
from __future__ import annotations

import dataclasses
import typing as tp

from varjax.ir import errors
from varjax.ir.typing import Filter, Key
from varjax.trace.rngs import RngStream
from varjax.trace.variable import Variable

__all__ = ["to_predicate", "Not", "All", "Any", "OfType", "PathContains", "WithTag",
           "Everything", "Nothing"]

Predicate = tp.Callable[[tuple, tp.Any], bool]


@dataclasses.dataclass(frozen=True)
class OfType:
    """Selects the leaves that are instances of ``type``."""

    type: type

    def __call__(self, path: tuple, value: tp.Any) -> bool:
        return isinstance(value, self.type)


def _tag_of(value: tp.Any) -> str | None:
    """A Variable's ``tag`` metadata, or an ``RngStream``'s tag (its stream name): what a
    tag filter compares, so ``'dropout'`` chooses the dropout streams (``nnx.with_rngs``)."""
    if isinstance(value, Variable):
        return value.get_metadata().get("tag")
    return value.tag if isinstance(value, RngStream) else None


@dataclasses.dataclass(frozen=True)
class WithTag:
    """Selects the Variables whose ``tag`` metadata is ``tag``, and the RNG streams named
    ``tag``."""

    tag: str

    def __call__(self, path: tuple, value: tp.Any) -> bool:
        return _tag_of(value) == self.tag


@dataclasses.dataclass(frozen=True)
class _Collection:
    name: str

    def __call__(self, path: tuple, value: tp.Any) -> bool:
        return (isinstance(value, Variable) and value.collection == self.name
                or _tag_of(value) == self.name)


@dataclasses.dataclass(frozen=True)
class PathContains:
    """Selects the leaves whose path contains ``key`` (an attribute name, index or stream
    name)."""

    key: Key

    def __call__(self, path: tuple, value: tp.Any) -> bool:
        return self.key in path


class Any:  # noqa: A001  (NNX's name)
    """Selects a leaf that any of ``filters`` selects."""

    def __init__(self, *filters: Filter):
        self.predicates = tuple(to_predicate(f) for f in filters)

    def __call__(self, path: tuple, value: tp.Any) -> bool:
        return any(p(path, value) for p in self.predicates)


class All:
    """Selects a leaf that every one of ``filters`` selects."""

    def __init__(self, *filters: Filter):
        self.predicates = tuple(to_predicate(f) for f in filters)

    def __call__(self, path: tuple, value: tp.Any) -> bool:
        return all(p(path, value) for p in self.predicates)


class Not:
    """Selects a leaf that ``filter`` does not."""

    def __init__(self, filter: Filter):  # noqa: A002  (NNX's name)
        self.predicate = to_predicate(filter)

    def __call__(self, path: tuple, value: tp.Any) -> bool:
        return not self.predicate(path, value)


class Everything:
    """Selects every leaf (the filter ``...`` or ``True``)."""

    def __call__(self, path: tuple, value: tp.Any) -> bool:
        return True


class Nothing:
    """Selects no leaf (the filter ``None`` or ``False``)."""

    def __call__(self, path: tuple, value: tp.Any) -> bool:
        return False


def to_predicate(f: Filter) -> Predicate:
    """The predicate of filter ``f`` (module docstring)."""
    if f is Ellipsis or f is True:
        return Everything()
    if f is None or f is False:
        return Nothing()
    if isinstance(f, type):
        return OfType(f)
    if isinstance(f, str):
        return _Collection(f)
    if isinstance(f, (list, tuple)):
        return Any(*f)
    if callable(f):
        return f
    raise errors.InvalidVariablesError(
        f"{f!r} is not an nnx filter.", **errors.where(),
        fix="use a Variable type, a collection name, ..., a list of filters, or a "
            "predicate (path, value) -> bool")
