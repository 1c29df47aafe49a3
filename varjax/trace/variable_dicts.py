"""Variables dicts, ``{collection: {scope: {name: value}}}``, as flat entries.

``functionalize`` and every layer above it speak flat ``(collection, path)`` keys; users
speak the nested dicts ``init`` returns.  This module is the one translation between them
(every layer imports it from here), and the one place that says what a variable value may
be: ``flatten_variables``/``variable_values`` check the values, as the entry points that
take a user's dict must; ``variable_entries`` walks a dict made elsewhere (a state of
``vj.split``, a bound module's own variables) without looking at the values;
``unflatten_variables`` and ``nested_set`` go back.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

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


def variable_values(variables: Mapping[str, Any]) -> dict[Key, Any]:
    """``{(collection, path): value}`` of a user's variables dict, checked as by
    ``flatten_variables``; a value is rebuilt from its leaves (a ``Mapping`` scope that is
    not a ``dict`` comes out as plain keys)."""
    return {k: jax.tree.unflatten(t, ls) for k, (t, ls) in flatten_variables(variables).items()}


def variable_entries(variables: Mapping[str, Any]) -> Iterator[tuple[Key, Any]]:
    """``((collection, path), value)`` for every value of a nested dict that is not a
    ``dict``, in the dict's order; the values are not checked: a pytree JAX unflattens
    with avals or placeholders (``jax.tree.map(jax.typeof, model)``) has such variables
    too.  A collection that is not a dict is one variable with an empty path."""
    def visit(col: str, path: tuple[str, ...], node: Any) -> Iterator[tuple[Key, Any]]:
        if isinstance(node, dict):
            for name, sub in node.items():
                yield from visit(col, path + (str(name),), sub)
        else:
            yield (col, path), node
    for col, tree in variables.items():
        yield from visit(col, (), tree)


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
        if path:
            nested_set(out.setdefault(col, {}), path, value)
        else:
            out[col] = value
    return out


def nested_set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    """Put ``value`` at ``path`` (not empty) of ``tree``, making the scopes on the way."""
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value
