"""Variables dicts, ``{collection: {scope: {name: value}}}``, as flat entries.

``functionalize`` and every layer above it speak flat ``(collection, path)`` keys; users
speak the nested dicts ``init`` returns.  These two functions are the one translation
between them, and the one place that says what a variable value may be.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from varjax.ir import errors
from varjax.ir.primitives import Key

SCALAR = jax.tree.structure(0)   # the treedef of a single leaf


def flatten_variables(variables: Mapping[str, Any]) -> dict[Key, tuple[Any, list[Any]]]:
    """``{collection: {scope: {name: value}}}`` -> ``{(collection, path): (tree, leaves)}``.

    Dicts are scopes; anything else (array, tuple from ``sow``...) is a variable.
    """
    flat: dict[Key, tuple[Any, list[Any]]] = {}

    def visit(col: str, path: tuple[str, ...], node: Any) -> None:
        if isinstance(node, jax.Array):      # most variables; checked first: ABC checks are slow
            flat[(col, path)] = (SCALAR, [node])
        elif isinstance(node, (dict, Mapping)):
            for name in node:
                visit(col, path + (str(name),), node[name])
        else:
            leaves, tree = jax.tree.flatten(node)
            bad = next((x for x in leaves if not _is_value(x)), None) if leaves else node
            if bad is not None or node is None:
                raise errors.InvalidVariablesError(
                    f"variable {errors.format_path(path)} of collection '{col}' is "
                    f"{'None' if bad is None else f'a {type(bad).__name__} ({repr(bad)[:40]})'}, "
                    "not an array.", collection=col, path=path, **errors.where(),
                    fix="give every variable an array value (a jax or numpy array), as init "
                        "returns them")
            flat[(col, path)] = (tree, leaves)

    if not isinstance(variables, (dict, Mapping)):
        raise errors.InvalidVariablesError(
            f"variables must be a dict of collections, {{collection: {{name: value}}}}, got "
            f"{type(variables).__name__}.", **errors.where(),
            fix="pass the dict that init returned (e.g. {'params': params})")
    for col in variables:
        node = variables[col]
        if not isinstance(node, (dict, Mapping)):
            raise errors.InvalidVariablesError(
                f"collection '{col}' must be a dict of variables, got {type(node).__name__}.",
                collection=str(col), **errors.where(),
                fix=f"pass variables['{col}'] as the dict that init returned")
        visit(col, (), node)
    return flat


def _is_value(x: Any) -> bool:
    """A variable leaf JAX can take: an array or a Python/NumPy number (or, for the
    tools that trace abstractly, a ``jax.ShapeDtypeStruct``)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex,
                          jax.ShapeDtypeStruct))


def unflatten_variables(flat: Mapping[Key, Any]) -> dict[str, Any]:
    """The inverse of ``flatten_variables``; a variable with an empty path is the whole
    collection (a ``vj.Variable`` given alone to ``vj.split``)."""
    out: dict[str, Any] = {}
    for (col, path), value in flat.items():
        if not path:
            out[col] = value
            continue
        node = out.setdefault(col, {})
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
    return out
