"""``nnx.State``: the leaves of an NNX object, nested by path.

A ``State`` maps each path component (attribute name, list index, stream name) to a
nested ``State`` or a leaf: a Variable (the object's own, as NNX's ``state`` gives it), an
array, or an RNG stream's key or count.  It is a pytree, so ``jax.tree.map`` over it maps
the Variables' values and keeps their types, and a state is what ``jax.jit`` takes where
NNX code passes one.
"""
from __future__ import annotations

from typing import Any, Iterator, MutableMapping

import jax

from varjax.trace.variable import Variable

__all__ = ["State"]


class State(MutableMapping):
    """A nested mapping of an object's leaves (module docstring)."""

    def __init__(self, mapping: Any = (), /):
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

    def replace_by_pure_dict(self, pure: Any) -> None:
        """Puts the values of ``pure`` (``to_pure_dict``'s layout) in place: into the
        Variables, else as the leaves."""
        for k, v in dict(pure).items():
            mine = self._mapping[k]
            if isinstance(mine, State):
                mine.replace_by_pure_dict(v)
            elif isinstance(mine, Variable):
                mine.value = v
            else:
                self._mapping[k] = v

    def __getitem__(self, k: Any) -> Any:
        return self._mapping[k]

    def __setitem__(self, k: Any, v: Any) -> None:
        self._mapping[k] = State(v) if _nested(v) else v

    def __delitem__(self, k: Any) -> None:
        del self._mapping[k]

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


def _nested(v: Any) -> bool:
    return isinstance(v, (dict, State))


def _key(k: Any) -> Any:
    return jax.tree_util.SequenceKey(k) if isinstance(k, int) else jax.tree_util.DictKey(k)


def _order(s: State) -> list:
    return sorted(s._mapping, key=lambda k: (isinstance(k, str), k))


jax.tree_util.register_pytree_with_keys(
    State,
    lambda s: ([(_key(k), s._mapping[k]) for k in _order(s)], tuple(_order(s))),
    lambda keys, children: State(dict(zip(keys, children))),
    lambda s: ([s._mapping[k] for k in _order(s)], tuple(_order(s))))
