"""``nnx.StateAxes``: an ``in_axes`` entry giving a module's state an axis per filter.

flax.nnx's graph mode lets ``vmap`` map part of a module and broadcast the rest:
``in_axes=(nnx.StateAxes({nnx.Param: 0, ...: None}), 0)``.  It is the Tree Mode note's
"Prefix filters" rewrite, done for the user: the module is ``split`` into one state per
filter, each state is passed with its axis, and inside the function ``merge`` makes the
module again from the states (their Variables, so their updates come back to the caller's).
``split_by`` and ``merged`` are those two halves; the transform keeps one traced function per
``GraphDef``s (``split`` gives equal ones for an unchanged structure).
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

from varjax.nnx.graph import merge, split

__all__ = ["StateAxes"]


class StateAxes(Mapping):
    """Per filter of a module's state, the axis its Variables are mapped along (``None``:
    broadcast): ``StateAxes({nnx.Param: 0, ...: None})``; the first filter that matches a
    Variable gives its axis, and every Variable must match one."""

    def __init__(self, filter_axes: Mapping[Any, Any] | Iterable[tuple[Any, Any]], /):
        pairs = tuple(filter_axes.items() if isinstance(filter_axes, Mapping) else filter_axes)
        self._filters = tuple(f for f, _ in pairs)
        self._axes = tuple(a for _, a in pairs)

    @property
    def filters(self) -> tuple[Any, ...]:
        return self._filters

    @property
    def axes(self) -> tuple[Any, ...]:
        return self._axes

    def items(self) -> Any:
        return zip(self._filters, self._axes)

    def __getitem__(self, key: Any) -> Any:
        return self._axes[self._filters.index(key)]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._filters)

    def __len__(self) -> int:
        return len(self._filters)

    def __repr__(self) -> str:
        return f"StateAxes({dict(self.items())})"


def split_by(args: tuple, in_axes: tuple) -> tuple[tuple, tuple, dict[int, Any]]:
    """``args`` with each argument at a ``StateAxes`` entry split into its states (a tuple,
    one per filter), the ``in_axes`` for them (the axes, a tuple), and the ``GraphDef`` of
    each split argument by position."""
    given, axes, defs = list(args), list(in_axes), {}
    for i, entry in enumerate(in_axes):
        if isinstance(entry, StateAxes):
            defs[i], *states = split(args[i], *entry.filters)
            given[i], axes[i] = tuple(states), entry.axes
    return tuple(given), tuple(axes), defs


def merged(defs: Mapping[int, Any], args: tuple) -> tuple:
    """``args`` with each split argument made a module again from its states."""
    return tuple(merge(defs[i], *a) if i in defs else a for i, a in enumerate(args))
