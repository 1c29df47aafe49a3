"""Nested mappings flattened to ``{path: value}`` and back (flax.nnx's ``traversals``): what
a checkpoint's nested dict of a state becomes to be compared, filtered or rewritten by path.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from varjax.ir import errors

__all__ = ["empty_node", "flatten_mapping", "flatten_to_sequence", "unflatten_mapping"]

IsLeaf = Callable[[tuple, Any], bool]


class _EmptyNode:
    """Where ``flatten_mapping(keep_empty_nodes=True)`` found an empty mapping, so that
    ``unflatten_mapping`` can put one back."""

    def __repr__(self) -> str:
        return "empty_node"


empty_node = _EmptyNode()


def _check_mapping(xs: Any, what: str) -> None:
    if not isinstance(xs, Mapping):
        raise errors.InvalidVariablesError(
            f"{what} takes a mapping, got {type(xs).__name__}.", **errors.where(),
            fix="pass a (nested) dict or State")


def _walk(xs: Mapping, is_leaf: IsLeaf | None, keep_empty: bool) -> list[tuple[tuple, Any]]:
    out: list[tuple[tuple, Any]] = []

    def walk(x: Any, path: tuple) -> None:
        if not isinstance(x, Mapping) or (is_leaf is not None and is_leaf(path, x)):
            out.append((path, x))
        elif not x and keep_empty and path:
            out.append((path, empty_node))
        else:
            for k, v in x.items():
                walk(v, (*path, k))

    walk(xs, ())
    return out


def flatten_to_sequence(xs: Mapping, /, *, is_leaf: IsLeaf | None = None
                        ) -> list[tuple[tuple, Any]]:
    """``(path, value)`` for each value of nested mapping ``xs``, in its order; a mapping
    ``is_leaf(path, mapping)`` accepts is a value.  Empty mappings leave nothing."""
    _check_mapping(xs, "flatten_to_sequence")
    return _walk(xs, is_leaf, False)


def flatten_mapping(xs: Mapping, /, *, keep_empty_nodes: bool = False,
                    is_leaf: IsLeaf | None = None, sep: str | None = None) -> dict[Any, Any]:
    """``{path: value}`` of nested mapping ``xs`` (paths ``sep``-joined strings when
    ``sep`` is given); an empty mapping is left out, or kept as ``empty_node``."""
    _check_mapping(xs, "flatten_mapping")
    return {path if sep is None else sep.join(path): v
            for path, v in _walk(xs, is_leaf, keep_empty_nodes)}


def unflatten_mapping(xs: Mapping | Iterable, /, *, sep: str | None = None) -> dict[Any, Any]:
    """The nested dict of ``{path: value}`` (or ``(path, value)`` pairs; ``sep``-joined
    string paths when ``sep`` is given); ``empty_node`` becomes an empty dict."""
    pairs = xs.items() if isinstance(xs, Mapping) else xs
    out: dict[Any, Any] = {}
    for path, value in pairs:
        keys = path.split(sep) if sep is not None else path
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = {} if value is empty_node else value
    return out
