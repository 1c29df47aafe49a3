"""NNX's two mode switches: graph mode and graph updates (the Tree Mode note).

``graph`` says whether NNX's functions and transforms treat objects as graphs (shared
references allowed, found once) or as trees (a shared reference is an error);
``graph_updates`` whether a transform carries structural changes and object identity back
to the caller (NNX's graph updates) or only Variable values.  Both default to True, as in
flax.nnx 0.12.8, and the environment variables ``NNX_GRAPH_MODE``/``NNX_GRAPH_UPDATES``
(``true``/``false``) change the default for the process.

``set_graph_mode(False)`` is three things, as in flax.nnx: a call that sets the value from
now on, a ``with`` block that restores the previous value on exit, and a decorator that
sets it only while the decorated function runs.  Each transform and graph function takes
``graph=``/``graph_updates=`` arguments; ``None`` means the current value (``resolve``).
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable, TypeVar

from varjax.ir import errors

__all__ = ["set_graph_mode", "set_graph_updates", "resolve"]

F = TypeVar("F", bound=Callable[..., Any])


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "t", "yes", "y", "on"):
        return True
    if value in ("0", "false", "f", "no", "n", "off"):
        return False
    raise errors.TransformError(
        f"environment variable {name}={raw!r} is not a boolean.", **errors.where(),
        fix=f"set {name} to true or false")


class _Stacks(threading.local):
    """The values set per thread, innermost last (empty: the process default)."""

    def __init__(self) -> None:
        self.graph: list[bool] = []
        self.graph_updates: list[bool] = []


_STACKS = _Stacks()


class _Setting:
    """A mode switch: calling the class sets the value; the instance is also a ``with``
    block and a decorator, either of which restores the value it replaced."""

    _field = ""
    _env = ""

    @classmethod
    def _stack(cls) -> list[bool]:
        return getattr(_STACKS, cls._field)

    @classmethod
    def current_value(cls) -> bool:
        """The value in force: the innermost one set, else the process default."""
        stack = cls._stack()
        return stack[-1] if stack else _env_flag(cls._env, True)

    def __init__(self, value: bool, /) -> None:
        if not isinstance(value, bool):
            raise errors.TransformError(
                f"nnx.{type(self).__name__} takes True or False, got {value!r}.",
                **errors.where(), fix="pass a bool")
        stack = self._stack()
        self._had = bool(stack)
        self._previous = stack[-1] if stack else None
        if stack:
            stack[-1] = value
        else:
            stack.append(value)
        self._value = value

    def _undo(self) -> None:
        stack = self._stack()
        if self._had:
            stack[-1] = self._previous
        else:
            stack.pop()

    def __enter__(self) -> _Setting:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._undo()

    def __call__(self, f: F) -> F:
        self._undo()
        value = self._value

        @functools.wraps(f)
        def with_value(*args: Any, **kwargs: Any) -> Any:
            stack = self._stack()
            stack.append(value)
            try:
                return f(*args, **kwargs)
            finally:
                stack.pop()
        return with_value   # type: ignore[return-value]


class set_graph_mode(_Setting):   # noqa: N801  (flax.nnx's name)
    """Graph mode (True: objects are graphs) or tree mode (False: shared references are
    errors, modules are plain pytrees)."""

    _field, _env = "graph", "NNX_GRAPH_MODE"


class set_graph_updates(_Setting):   # noqa: N801  (flax.nnx's name)
    """Whether transforms carry structural changes and object identity back (True) or
    only Variable values (False)."""

    _field, _env = "graph_updates", "NNX_GRAPH_UPDATES"


def resolve(graph: bool | None, graph_updates: bool | None = None) -> tuple[bool, bool]:
    """``graph``/``graph_updates`` arguments with ``None`` replaced by the current values.
    Graph updates need graph mode: in tree mode they are off whatever the setting."""
    g = set_graph_mode.current_value() if graph is None else graph
    u = set_graph_updates.current_value() if graph_updates is None else graph_updates
    return g, (u and g)
