"""``nnx.State``: the leaves of an NNX object, nested by path.

A ``State`` maps each path component (attribute name, list index, stream name) to a
nested ``State`` or a leaf: a Variable (the object's own, as NNX's ``state`` gives it; an
RNG stream's key or count is an ``RngKey``/``RngCount``), or an array.  It is a pytree, so
``jax.tree.map`` over it maps the Variables' values and keeps their types, and a state is
what ``jax.jit`` takes where NNX code passes one.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence

import jax

from varjax.ir import errors
from varjax.ir.typing import Filter, Key, PathParts, PureDict, StateLike
from varjax.nnx.filterlib import to_predicate
from varjax.nnx.traversals import flatten_to_sequence
from varjax.objects.graph import structure_changed
from varjax.trace.variable import Variable

__all__ = ["State", "FlatState"]


class State(MutableMapping):
    """A nested mapping of an object's leaves (module docstring)."""

    def __init__(self, mapping: StateLike | Iterable[tuple[Key, Any]] = (), /):
        self.__dict__["_mapping"] = {k: State(v) if _nested(v) else v
                                     for k, v in dict(mapping).items()}

    @classmethod
    def from_flat(cls, flat: dict[tuple, Any]) -> "State":
        """The state of ``{path: leaf}``."""
        root: dict = {}
        for path, leaf in flat.items():
            node = root
            for k in path[:-1]:
                node = node.setdefault(k, {})
            node[path[-1]] = leaf
        return cls(root)

    def flat(self) -> dict[tuple, Any]:
        """``{path: leaf}``."""
        out: dict[tuple, Any] = {}
        for k, v in self._mapping.items():
            if isinstance(v, State):
                out.update({(k, *p): leaf for p, leaf in v.flat().items()})
            else:
                out[(k,)] = v
        return out

    def to_pure_dict(self) -> dict:
        """Nested plain dicts of values: each Variable replaced by its value."""
        return {k: v.to_pure_dict() if isinstance(v, State) else
                (v.value if isinstance(v, Variable) else v) for k, v in self._mapping.items()}

    def replace_by_pure_dict(self, pure: PureDict) -> None:
        """Puts the values of ``pure`` (``to_pure_dict``'s layout) in this state: into its
        Variables, in place (the object the state was split from sees them, where flax.nnx
        puts new Variables in the state), else as the leaves.  A key that reads as an
        integer matches a list index, as a checkpoint stores indices as strings.  A path of
        ``pure`` the state does not have is a ``ConfigError`` (a ``ValueError``, as
        flax.nnx raises), before anything is written."""
        mine = self.flat()
        found = []
        for path, value in flatten_to_sequence(pure):
            here = path if path in mine else tuple(int_or_key(k) for k in path)
            if here not in mine:
                names = tuple(map(str, path))
                raise errors.ConfigError(
                    f"replace_by_pure_dict: the state has no leaf at {'/'.join(names)}.",
                    path=names, **errors.where(),
                    fix="give values only at the paths of nnx.to_pure_dict(state), e.g. "
                        "restore the checkpoint into the model it was saved from")
            found.append((here, value))
        for here, value in found:
            if isinstance(mine[here], Variable):
                mine[here].value = value
            else:
                node = self
                for k in here[:-1]:
                    node = node[k]
                node[here[-1]] = value

    def flat_state(self) -> "FlatState":
        """The leaves as a ``FlatState``, sorted by path (``nnx.to_flat_state``)."""
        return FlatState(self.flat().items(), sort=True)

    @classmethod
    def from_flat_path(cls, flat: Mapping[PathParts, Any] | Iterable[tuple[PathParts, Any]],
                       /) -> "State":
        """The state of ``{path: leaf}`` or of ``(path, leaf)`` pairs (``nnx.from_flat_state``)."""
        return cls.from_flat(dict(flat))

    def map(self, f: Callable[[tuple, Any], Any]) -> "State":
        """A new state of ``f(path, leaf)`` for each leaf (``nnx.map_state``)."""
        return State.from_flat({p: f(p, v) for p, v in self.flat_state()})

    def split(self, first: Filter, /, *filters: Filter) -> "State | tuple[State, ...]":
        """One state per filter, a leaf in the first that matches; a leaf none matches is
        an error (``nnx.split_state``)."""
        parts = self.flat_state().split(first, *filters)
        return parts.to_nested_state() if isinstance(parts, FlatState) else tuple(
            p.to_nested_state() for p in parts)

    def filter(self, first: Filter, /, *filters: Filter) -> "State | tuple[State, ...]":
        """As ``split``, leaving out the leaves no filter matches (``nnx.filter_state``)."""
        parts = self.flat_state().filter(first, *filters)
        return parts.to_nested_state() if isinstance(parts, FlatState) else tuple(
            p.to_nested_state() for p in parts)

    @classmethod
    def merge(cls, state: StateLike, /, *states: StateLike) -> "State":
        """One state of the leaves of all, a later state's leaf replacing an earlier one's
        at the same path (``nnx.merge_state``).  One state alone is returned as it is."""
        if not states:
            return state if isinstance(state, cls) else cls(state)
        flat: dict[tuple, Any] = {}
        for s in (state, *states):
            flat.update((s if isinstance(s, State) else State(s)).flat())
        return cls.from_flat(flat)

    def __or__(self, other: Any) -> "State":
        return self.merge(self, other) if other else self

    def __sub__(self, other: Any) -> "State":
        """The leaves at paths ``other`` does not have."""
        if not other:
            return self
        theirs = (other if isinstance(other, State) else State(other)).flat()
        return State.from_flat({p: v for p, v in self.flat_state() if p not in theirs})

    def __getitem__(self, k: Any) -> Any:
        return self._mapping[k]

    def __setitem__(self, k: Any, v: Any) -> None:
        self._mapping[k] = State(v) if _nested(v) else v
        structure_changed()

    def __delitem__(self, k: Any) -> None:
        del self._mapping[k]
        structure_changed()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._mapping)

    def __len__(self) -> int:
        return len(self._mapping)

    def __getattr__(self, k: str) -> Any:
        try:
            return self.__dict__["_mapping"][k]
        except KeyError:
            raise AttributeError(k) from None

    def __repr__(self) -> str:
        return f"State({self._mapping!r})"


class FlatState(Sequence):
    """A state as ``(path, leaf)`` pairs, in path order when made by ``to_flat_state``:
    the form in which a state is filtered, split and mapped.  A pytree of its leaves."""

    def __init__(self, items: Iterable[tuple[tuple, Any]], /, *, sort: bool):
        pairs = sorted(items, key=lambda item: item[0]) if sort else list(items)
        self._keys = tuple(p for p, _ in pairs)
        self._values = [v for _, v in pairs]

    @property
    def paths(self) -> tuple[tuple, ...]:
        return self._keys

    @property
    def leaves(self) -> list:
        return self._values

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return FlatState(zip(self._keys[index], self._values[index]), sort=False)
        return self._keys[index], self._values[index]

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[tuple[tuple, Any]]:
        return iter(zip(self._keys, self._values))

    def __repr__(self) -> str:
        return f"FlatState({list(self)!r})"

    def to_nested_state(self) -> State:
        return State.from_flat(dict(self))

    def split(self, first: Filter, /, *filters: Filter
              ) -> "FlatState | tuple[FlatState, ...]":
        """One ``FlatState`` per filter; a leaf no filter matches is an error."""
        *parts, rest = _partition(self, (first, *filters))
        if rest:
            path = rest.paths[0]
            raise errors.InvalidVariablesError(
                f"split: the leaf at {'/'.join(map(str, path))} matches none of the filters.",
                path=tuple(map(str, path)), **errors.where(),
                fix="add a last filter ... to collect the rest")
        return parts[0] if len(parts) == 1 else tuple(parts)

    def filter(self, first: Filter, /, *filters: Filter
               ) -> "FlatState | tuple[FlatState, ...]":
        """One ``FlatState`` per filter; the leaves no filter matches are left out."""
        *parts, _ = _partition(self, (first, *filters))
        return parts[0] if len(parts) == 1 else tuple(parts)

    @staticmethod
    def merge(flat_state: Iterable, /, *flat_states: Iterable) -> "FlatState":
        """The pairs of all, sorted by path (one ``FlatState`` alone is returned as it is)."""
        if not flat_states:
            return flat_state if isinstance(flat_state, FlatState) else FlatState(flat_state, sort=True)
        return FlatState((pair for f in (flat_state, *flat_states) for pair in f), sort=True)


def _partition(flat: FlatState, filters: tuple) -> list[FlatState]:
    """One ``FlatState`` per filter, each leaf in the first that matches, then the rest.
    ``...`` (or ``True``) matches everything, so only more of it may follow it."""
    for i, f in enumerate(filters):
        if _is_everything(f) and not all(_is_everything(g) for g in filters[i + 1:]):
            raise errors.ConfigError(
                f"`...` matches every leaf, so it can only be among the last filters; it is "
                f"filter {i} of {len(filters)}.", **errors.where(), fix="move `...` to the end")
    predicates = [to_predicate(f) for f in filters]
    parts: list[list] = [[] for _ in range(len(filters) + 1)]
    for path, leaf in flat:
        i = next((i for i, p in enumerate(predicates) if p(path, leaf)), len(filters))
        parts[i].append((path, leaf))
    return [FlatState(part, sort=False) for part in parts]


def _is_everything(f: Any) -> bool:
    return f is ... or f is True


def _flat_state_unflatten(keys: tuple, values: Any) -> FlatState:
    return FlatState(zip(keys, values), sort=False)


jax.tree_util.register_pytree_node(FlatState, lambda f: (f._values, f._keys), _flat_state_unflatten)


def _nested(v: Any) -> bool:
    return isinstance(v, (dict, State))


_INT_TEXT = re.compile(r"[+-]?[0-9]+")


def int_or_key(k: Any) -> Any:
    """``k`` as an int if it is a string of digits (a list index a checkpoint stored as a
    string), optionally signed; any other key (an int, a float, a name, None) unchanged."""
    return int(k) if isinstance(k, str) and _INT_TEXT.fullmatch(k) else k


def _order(s: State) -> list:
    return sorted(s._mapping, key=lambda k: (isinstance(k, str), k))


# Every key a DictKey, a list index too, as flax.nnx keys a State: Orbax names a saved node by
# its key's type (a SequenceKey's node is a list), so both libraries' checkpoints match.
jax.tree_util.register_pytree_with_keys(
    State,
    lambda s: ([(jax.tree_util.DictKey(k), s._mapping[k]) for k in _order(s)], tuple(_order(s))),
    lambda keys, children: State(dict(zip(keys, children))),
    lambda s: ([s._mapping[k] for k in _order(s)], tuple(_order(s))))
