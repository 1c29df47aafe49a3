"""A dict's mutation counter, read without comparing its contents: the proof a kept graph
needs that a module's ``__dict__`` is what it was.

A kept ``nnx.jit`` train step must see a module attribute set by any means, and
``object.__setattr__(m, k, v)`` or ``m.__dict__[k] = v`` run no varjax code.  Comparing
each ``__dict__`` entry by identity on every call sees them but costs about as much as the
rest of the call's Python together (47 entries of a small MLP and its optimizer: 2.2 µs).
CPython (3.11 to 3.13) keeps in every dict a version tag that any change bumps (PEP 509's
``ma_version_tag``, behind the C API's dict watchers): reading it says "not changed since"
in one attribute read.  It is not a public Python attribute, so ``version_reader`` reads it
through ``ctypes`` only after checking, once per process, that the field it reads behaves
as the tag (every kind of change bumps it, reads do not); anywhere else (another Python,
another layout) it returns None and callers compare contents, as before.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

# PyObject_HEAD (refcount, type) then ``ma_used``: the tag is the fourth word of a dict.
_OFFSET = 3 * 8


def _reader(d: dict) -> Any:
    import ctypes
    return ctypes.c_uint64.from_address(id(d) + _OFFSET)


def _behaves_as_tag() -> bool:
    """Whether the word ``_reader`` reads changes on each kind of change to a dict, an
    instance's ``__dict__`` written by ``object.__setattr__`` included, and only then."""
    class Probe:
        pass
    probe = Probe()
    probe.a, probe.b = 1, 2
    d = vars(probe)
    word = _reader(d)

    def assign() -> None:                                 # STORE_ATTR, specialised when hot
        probe.a = object()
    changes: list[Callable[[], Any]] = [
        assign,
        lambda: d.__setitem__("a", object()),             # a value replaced, size unchanged
        lambda: object.__setattr__(probe, "b", object()),
        lambda: (d.pop("a"), d.__setitem__("c", 3)),      # a key renamed, size unchanged
        lambda: d.update(d=4),
        lambda: d.__delitem__("d"),
        lambda: d.setdefault("e", 5),
        lambda: d.clear(),
    ]
    for change in changes * 8:          # repeated: CPython specialises the hot paths
        before = word.value
        _ = (len(d), list(d.items()), "a" in d, probe.__dict__)      # reads change nothing
        if word.value != before:
            return False
        change()
        if word.value == before:
            return False
    return True


def _available() -> bool:
    if sys.implementation.name != "cpython" or sys.maxsize != 2 ** 63 - 1:
        return False
    try:
        return _behaves_as_tag()
    except Exception:   # noqa: BLE001  (no ctypes, or a layout where the read fails)
        return False


_AVAILABLE = _available()


def version_reader(d: dict) -> Any | None:
    """An object whose ``.value`` is ``d``'s version tag (equal while ``d`` is unchanged;
    valid while ``d`` lives), or None where this Python does not keep one."""
    return _reader(d) if _AVAILABLE else None
