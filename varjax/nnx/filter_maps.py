"""Filter maps: a transform's prefix entry that gives each filter of a module's state its own
value.  ``StateAxes`` (``state_axes.py``) gives axes, ``StateSharding`` partition specs.

Both are what flax.nnx 0.12.8 makes them: an ordered mapping of filters to values, built from
a mapping, ``(filter, value)`` pairs, or a ``State`` of values (each value's paths one filter,
as flax.nnx's ``create_path_filters`` makes them); the first filter that matches a Variable
gives its value (``map_prefix``), and every Variable must match one.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

from varjax.ir.typing import Filter, PathParts, Prefix, PyTree, ShardingLike
from varjax.nnx.filterlib import to_predicate
from varjax.nnx.state_ops import to_flat_state
from varjax.nnx.statelib import State
from varjax.trace.variable import Variable

__all__ = ["FilterMap", "StateSharding"]


class _PathIn:
    """The filter of a ``State``'s paths holding one value."""

    def __init__(self, *paths: tuple):
        self.paths = frozenset(paths)

    def __call__(self, path: tuple, value: Any) -> bool:
        return tuple(path) in self.paths

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _PathIn) and self.paths == other.paths

    def __hash__(self) -> int:
        return hash(self.paths)

    def __repr__(self) -> str:
        return f"PathIn({', '.join(map(repr, sorted(self.paths, key=repr)))})"


def _pairs(given: Any) -> tuple[tuple[Any, Any], ...]:
    if isinstance(given, State):
        by_value: dict[Any, list[tuple]] = {}
        for path, value in to_flat_state(given):
            by_value.setdefault(getattr(value, "value", value), []).append(tuple(path))
        return tuple((_PathIn(*paths), value) for value, paths in by_value.items())
    return tuple(given.items() if isinstance(given, Mapping) else given)


class FilterMap(Mapping):
    """Filters of a module's state, in order, each with its value."""

    _name = "FilterMap"

    def __init__(self, filter_values: State | Mapping[Filter, Prefix]
                 | Iterable[tuple[Filter, Prefix]], /):
        pairs = _pairs(filter_values)
        self._filters = tuple(f for f, _ in pairs)
        self._values = tuple(v for _, v in pairs)

    @property
    def filters(self) -> tuple[Filter, ...]:
        return self._filters

    def items(self) -> Iterator[tuple[Filter, Prefix]]:
        return zip(self._filters, self._values)

    def map_prefix(self, path: PathParts, leaf: Variable | PyTree) -> Prefix:
        """The value of the first filter ``leaf`` at ``path`` matches."""
        for f, value in self.items():
            if to_predicate(f)(path, leaf):
                return value
        raise ValueError(f"No axis found for path={path!r}, variable={leaf!r}")

    def __getitem__(self, key: Any) -> Any:
        return self._values[self._filters.index(key)]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._filters)

    def __len__(self) -> int:
        return len(self._filters)

    def __repr__(self) -> str:
        return f"{self._name}({dict(self.items())})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and (self._filters, self._values) == (
            other._filters, other._values)

    def __hash__(self) -> int:
        return hash((self._filters, self._values))


class StateSharding(FilterMap):
    """Per filter of a module's state, the ``PartitionSpec`` its Variables are split by in
    ``nnx.shard_map``'s ``in_specs``: ``StateSharding({nnx.Param: P('model'), ...: P()})``."""

    _name = "StateSharding"

    @property
    def shardings(self) -> tuple[ShardingLike, ...]:
        return self._values
