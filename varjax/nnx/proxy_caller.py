"""``nnx.call``: call a method of a split object as a pure function, and its proxy.

``call((graphdef, state))`` returns a proxy; attribute access and indexing on it record the
way to a method (``call(gs)['b'].increment``), and calling it merges the object, runs
the method, and splits the object again: ``(out, (graphdef, state))``.  So a stateful
method runs inside a raw ``jax.jit`` over states, as NNX's functional API does.  The way
recorded (``DelayedAccessor``) is static to JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from varjax.nnx.graph import merge, split

__all__ = ["DelayedAccessor", "CallableProxy", "call"]


@dataclasses.dataclass(frozen=True)
class DelayedAccessor:
    """A path of attribute names and keys, applied to an object when called."""

    actions: tuple[tuple[str, Any], ...] = ()

    def __call__(self, x: Any) -> Any:
        for kind, key in self.actions:
            x = getattr(x, key) if kind == "attr" else x[key]
        return x

    def __getattr__(self, name: str) -> "DelayedAccessor":
        if name.startswith("__"):
            raise AttributeError(name)
        return DelayedAccessor((*self.actions, ("attr", name)))

    def __getitem__(self, key: Any) -> "DelayedAccessor":
        return DelayedAccessor((*self.actions, ("item", key)))


jax.tree_util.register_static(DelayedAccessor)


class CallableProxy:
    """Records attribute access and indexing; a call runs ``callable(accessor, ...)``."""

    def __init__(self, callable: Callable[..., Any], accessor: DelayedAccessor | None = None):
        self._callable = callable
        self._accessor = DelayedAccessor() if accessor is None else accessor

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._callable(self._accessor, *args, **kwargs)

    def __getattr__(self, name: str) -> "CallableProxy":
        if name.startswith("__"):
            raise AttributeError(name)
        return CallableProxy(self._callable, getattr(self._accessor, name))

    def __getitem__(self, key: Any) -> "CallableProxy":
        return CallableProxy(self._callable, self._accessor[key])


def call(graphdef_state: tuple[Any, Any], /) -> CallableProxy:
    """A proxy calling a method of the object ``graphdef_state`` (``nnx.split``'s pair)
    describes: ``out, (graphdef, state) = nnx.call(gs).method(...)``."""
    def merged_call(accessor: DelayedAccessor, *args: Any, **kwargs: Any) -> Any:
        node = merge(*graphdef_state)
        out = accessor(node)(*args, **kwargs)
        return out, split(node)
    return CallableProxy(merged_call)
