"""Variable groups as a lifted transform handles them (see ``varjax.lifting.region``).

A transform receives its variables as groups, dicts ``{(collection, path): value}``, and
its arguments as they were passed; these helpers are what every transform needs around
them: setting aside the variables that do not fit the transform, separating array
arguments from the rest, and converting a group to Linen's nested dicts and back.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from varjax.trace.variable import Variable
from varjax.trace.variable_dicts import unflatten_variables, variable_values

Group = dict  # {(collection, path): value}


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_handle(x: Any) -> bool:
    """A handle on a variable of a trace (not a Variable holding its own value)."""
    return isinstance(x, Variable) and x.path is not None


def group_to_variables(group: Group, path: tuple[str, ...] = ()) -> dict[str, Any]:
    """A group as a variables dict, Linen's nested ``{collection: {name: ...}}``, relative
    to ``path`` (variables outside ``path`` keep their full path).  (Not NNX's ``to_tree``,
    which turns objects into pytrees: hence the name.)"""
    return unflatten_variables({(col, full[len(path):] if full[:len(path)] == path else full): value
                                for (col, full), value in sorted(group.items())})


def variables_to_group(variables: dict[str, Any], path: tuple[str, ...] = ()) -> Group:
    """The inverse of ``group_to_variables``: a variables dict relative to ``path`` as a group."""
    return {(col, path + rel): value for (col, rel), value in variable_values(variables).items()}


def set_aside(groups: Sequence[Group], fits: Callable[[int, Any], bool]
              ) -> tuple[tuple[Group, ...], tuple[Group, ...]]:
    """Each group split into the variables whose every leaf ``fits(group_index, leaf)`` and
    the rest.  A transform hands the first to the region and returns the rest unchanged; a
    body that touches a withheld variable raises ``TransformError``.  (A group holds every
    variable of its collections that the body may use, which for a plain function is every
    variable of the enclosing trace, so some may not fit the transform.)"""
    kept, aside = [], []
    for i, group in enumerate(groups):
        ok = {k: v for k, v in group.items() if all(fits(i, x) for x in jax.tree.leaves(v))}
        kept.append(ok)
        aside.append({k: v for k, v in group.items() if k not in ok})
    return tuple(kept), tuple(aside)


def partition(args: tuple) -> tuple[list[Any], Callable[[Sequence[Any]], tuple]]:
    """Split ``args`` into its array leaves and a function rebuilding ``args`` from new
    ones: transforms that only take arrays (``jax.checkpoint``, ``lax.cond``) pass the
    arrays through and close over everything else (Python scalars, modules, None).

    A handle on a variable of the running trace (``Module.variable``'s result) is kept
    whole, not flattened to its value: inside the body it reads and writes the variable
    through the body's own trace, so a write reaches the variable's owner, as Linen's
    lifted transforms write an ``nn.Variable`` argument in its owner's scope."""
    leaves, tree = jax.tree.flatten(args, is_leaf=is_handle)
    at = [i for i, x in enumerate(leaves) if is_array(x)]

    def rebuild(arrays: Sequence[Any]) -> tuple:
        full = list(leaves)
        for i, x in zip(at, arrays):
            full[i] = x
        return jax.tree.unflatten(tree, full)
    return [leaves[i] for i in at], rebuild
