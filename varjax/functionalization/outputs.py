"""Outputs that are not arrays: strings, paths, Python numbers, ``None``.

Linen's ``apply`` runs the method in Python and returns whatever it returns.  varjax traces
it, and a trace's outputs must be arrays.  So before a traced function returns, every leaf
that is not an array is moved into the output's tree structure (``Static``, a pytree node
with no children), which the trace caches with its jaxpr; ``init``/``apply`` put the values
back (``vj.functionalize``, and so every Module entry point).  A cache hit therefore returns
the same Python values without running the function, exactly as the statics of the
arguments key the cache.

Sharp edges:
  * A Python number returned by the function comes back as that number, as in Linen (not
    as a 0-d array, as from ``jax.jit``); compute it from arrays to get an array.
  * Object-mode transforms follow JAX's rule instead (outputs are arrays and numbers):
    ``run`` refuses any other output there.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np


class Static:
    """A non-array output leaf, carried in the tree structure instead of as a value."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and _same(self.value, other.value)

    def __hash__(self) -> int:
        try:
            return hash((type(self.value), self.value))
        except TypeError:
            return id(self.value)

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:             # a value whose == is not a plain bool
        return a is b


jax.tree_util.register_pytree_node(Static, lambda s: ((), s.value), lambda value, _: Static(value))


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class StaticOutputs:
    """Moves the non-array leaves of one traced function's outputs into ``Static`` nodes,
    and remembers whether any trace had one (so ``reveal`` costs nothing otherwise)."""

    def __init__(self) -> None:
        self.seen = False

    def hide(self, out: Any) -> Any:
        leaves, tree = jax.tree.flatten(out)
        if all(_is_array(x) for x in leaves):
            return out
        self.seen = True
        return jax.tree.unflatten(tree, [x if _is_array(x) else Static(x) for x in leaves])

    def reveal(self, result: Any) -> Any:
        return reveal(result) if self.seen else result


def reveal(result: Any) -> Any:
    """``result`` with every ``Static`` node replaced by its value."""
    return jax.tree.map(lambda x: x.value if isinstance(x, Static) else x, result,
                        is_leaf=lambda x: isinstance(x, Static))
