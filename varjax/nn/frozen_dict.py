"""``FrozenDict``: Linen's immutable variables dict, for code that builds or expects one.

varjax's ``init`` returns plain ``dict``s (as Linen does since 0.7); ``apply`` takes
any mapping, a ``FrozenDict`` included.  Ported code that wraps variables in
``FrozenDict``, calls ``.unfreeze()``/``.copy({...})``/``.pop(k)`` on them, or
uses ``freeze``/``unfreeze`` keeps working.  A ``FrozenDict`` is a pytree with its
keys in sorted order and a mapping whose nested dicts are frozen too.
"""
from __future__ import annotations

from typing import Any, Hashable, Iterator, Mapping

import jax

from varjax.ir.typing import PyTree

__all__ = ["FrozenDict", "freeze", "unfreeze", "copy", "pop", "pretty_repr"]


def _frozen(value: Any) -> Any:
    """Nested plain dicts (and FrozenDicts) as plain dicts, copied so no caller can alias them."""
    if isinstance(value, (dict, FrozenDict)):
        return {k: _frozen(v) for k, v in value.items()}
    return value


class FrozenDict(Mapping):
    """An immutable, hashable mapping; nested dicts come back as ``FrozenDict``."""

    __slots__ = ("_dict", "_hash")

    def __init__(self, *args: Any, **kwargs: Any):
        self._dict = _frozen(dict(*args, **kwargs))
        self._hash: int | None = None

    def __getitem__(self, key: Any) -> Any:
        value = self._dict[key]
        return FrozenDict(value) if isinstance(value, dict) else value

    def __setitem__(self, key: Any, value: Any) -> None:
        raise ValueError("FrozenDict is immutable: use .copy({key: value}) for an updated copy.")

    def __iter__(self) -> Iterator[Any]:
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._dict)

    def __contains__(self, key: object) -> bool:
        return key in self._dict

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple((k, self[k]) for k in sorted(self._dict, key=repr)))
        return self._hash

    def __repr__(self) -> str:
        return self.pretty_repr()

    def __reduce__(self) -> tuple:
        return FrozenDict, (self.unfreeze(),)

    def copy(self, add_or_replace: Mapping[Any, Any] | None = None) -> FrozenDict:
        """A new ``FrozenDict`` with the entries of ``add_or_replace`` added or replaced."""
        return FrozenDict({**self._dict, **_frozen(dict(add_or_replace or {}))})

    def pop(self, key: Hashable) -> tuple[FrozenDict, Any]:  # type: ignore[override]
        """``(a copy without key, its value)``: the frozen counterpart of ``dict.pop``."""
        value = self[key]
        return FrozenDict({k: v for k, v in self._dict.items() if k != key}), value

    def unfreeze(self) -> dict:
        """A mutable deep copy as nested plain dicts."""
        return _frozen(self._dict)

    def pretty_repr(self, num_spaces: int = 4) -> str:
        return f"FrozenDict({_pretty(self._dict, num_spaces)})"


def _pretty(value: Any, num_spaces: int) -> str:
    if not isinstance(value, dict):
        return repr(value)
    if not value:
        return "{}"
    pad = " " * num_spaces
    rows = "".join(f"{k}: {_pretty(v, num_spaces)},\n" for k, v in value.items())
    return "{\n" + "".join(pad + line + "\n" for line in rows.splitlines()) + "}"


jax.tree_util.register_pytree_with_keys(
    FrozenDict,
    lambda d: (tuple((jax.tree_util.DictKey(k), d[k]) for k in sorted(d._dict)), tuple(sorted(d._dict))),
    lambda keys, values: FrozenDict(dict(zip(keys, values))))


def freeze(xs: Mapping[Any, Any]) -> FrozenDict:
    """``xs`` (nested mappings) as a ``FrozenDict``."""
    return FrozenDict(xs)


def unfreeze(x: PyTree) -> PyTree:
    """``x`` with every ``FrozenDict`` (and dict) in it as a fresh plain dict; other values as they are."""
    return _frozen(x)


def copy(x: Mapping[Any, Any], add_or_replace: Mapping[Any, Any] | None = None) -> Mapping[Any, Any]:
    """An updated copy of a ``FrozenDict`` or a plain dict, of the same kind."""
    if isinstance(x, FrozenDict):
        return x.copy(add_or_replace)
    return {**unfreeze(x), **unfreeze(dict(add_or_replace or {}))}


def pop(x: Mapping[Any, Any], key: Hashable) -> tuple[Mapping[Any, Any], Any]:
    """``(x without key, x[key])`` for a ``FrozenDict`` or a plain dict, without mutating ``x``."""
    if isinstance(x, FrozenDict):
        return x.pop(key)
    rest = unfreeze(x)
    return rest, rest.pop(key)


def pretty_repr(x: PyTree, num_spaces: int = 4) -> str:
    """Nested mappings one entry per line (``FrozenDict``'s repr; plain dicts without the wrapper)."""
    return x.pretty_repr(num_spaces) if isinstance(x, FrozenDict) else _pretty(unfreeze(x), num_spaces)
