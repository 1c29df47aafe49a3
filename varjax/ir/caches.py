"""Bounded caches for traces and compiled calls, released by ``jax.clear_caches()``.

A ``Functionalized`` keeps one effectful trace and one compiled entry per argument
structure, shape and dtype.  A data pipeline that feeds a new sequence length every step
would otherwise keep every trace it ever made, each holding jaxprs and an executable.
Each cache is an ``LRU``: a hit moves the entry to the front, and an insert past the
bound drops the least recently used entry.

The bound is ``DEFAULT_SIZE`` entries per cache, or the environment variable
``VARJAX_CACHE_SIZE`` when set; ``set_cache_size(n)`` changes it for the process (existing
caches shrink on their next insert).  Every ``LRU`` is registered with JAX's cache
management, so ``jax.clear_caches()`` empties them together with JAX's own caches, and
``vj.clear_caches()`` is the same call.
"""
from __future__ import annotations

import collections
import os
import weakref
from typing import Any, Hashable, Iterator

import jax

from varjax import _jax

SIZE_ENV = "VARJAX_CACHE_SIZE"
DEFAULT_SIZE = 128
_size = [int(os.environ.get(SIZE_ENV, DEFAULT_SIZE))]
_live: "weakref.WeakSet[LRU]" = weakref.WeakSet()


def cache_size() -> int:
    """The current bound on the entries of each cache."""
    return _size[0]


def set_cache_size(n: int) -> None:
    """Bound every varjax cache to ``n`` entries (at least 1)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"cache size must be a positive int, got {n!r}")
    _size[0] = n


class LRU:
    """A mapping that keeps the ``cache_size()`` most recently used entries."""

    __slots__ = ("_data", "__weakref__")

    def __init__(self) -> None:
        self._data: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
        _live.add(self)

    def get(self, key: Hashable) -> Any:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > _size[0]:
            self._data.popitem(last=False)

    def pop(self, key: Hashable) -> Any:
        """Remove ``key``'s entry and return it (None if absent)."""
        return self._data.pop(key, None)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._data)

    def values(self) -> Any:
        return self._data.values()

    def clear(self) -> None:
        self._data.clear()


class _AllCaches:
    """What JAX's cache management sees: one object standing for every live ``LRU``."""

    def cache_clear(self) -> None:
        for cache in list(_live):
            cache.clear()

    def cache_info(self) -> str:
        return f"{len(_live)} varjax caches, {sum(len(c) for c in _live)} entries"

    def cache_keys(self) -> list:
        return [k for c in list(_live) for k in c]


_ALL = _AllCaches()   # module-level: JAX holds its registrations weakly
_jax.register_cache(_ALL, "varjax traces and compiled calls")


def clear_caches() -> None:
    """Release every varjax trace and compiled call, and JAX's caches
    (``jax.clear_caches()``, which clears both)."""
    jax.clear_caches()
