"""What ``apply(..., mutable=...)`` returns beside the output: its mutable collections.

They are the given variables of the mutable collections with what the call wrote merged
in, as a variables dict.  An eager ``apply`` merges inside its ``jax.jit``
(``Functionalized._dispatch``), so a call does not walk the variables dict in Python:
there a given variable the call did not write is a hole (``None``, which no variable can
be), and ``fill_holes`` puts the object the caller gave in its place afterwards, unchanged
(a NumPy array or a Python number stays one, as it would not through ``jax.jit``).
"""
from __future__ import annotations

from typing import Any, Mapping

from varjax.ir import filters, streams
from varjax.ir.primitives import Key
from varjax.trace.variable_dicts import nested_set, variable_values


def merged(given: Mapping[Key, Any], written: Mapping[Key, Any], mutable: Any, *,
           initializing: bool = False, held: bool = False) -> dict[Key, Any]:
    """The variables of the ``mutable`` collections, sorted by key: ``given`` with
    ``written`` over it.  ``init`` returns the RNG state it was given, not what its forward
    pass drew (the first apply then draws what it would after ``vj.reseed``); with a held
    ``vj.Rngs`` (``held``) it leaves out the ``params`` stream too, keeping the streams
    that model code draws from later."""
    updated = {k: v for k, v in given.items() if filters.matches(mutable, k[0])}
    updated.update((k, v) for k, v in written.items() if filters.matches(mutable, k[0])
                   and not (initializing and k[0] == streams.STATE))
    if held and initializing:
        updated = {k: v for k, v in updated.items()
                   if k[0] != streams.STATE or k[1][0] != streams.PARAMS}
    return dict(sorted(updated.items()))


def holes(entries: Mapping[Key, Any]) -> dict[Key, None]:
    """The entries of ``merged`` that are holes, as a pytree ``jax.jit`` can return (the
    keys ride in its structure)."""
    return {k: None for k, v in entries.items() if v is None}


def fill_holes(updated: dict[str, Any], holes_: Mapping[Key, None],
               variables: Mapping[str, Any]) -> dict[str, Any]:
    """``updated`` (a variables dict) with each hole set, in its place, to the variable
    given in ``variables``."""
    if holes_:
        given = variable_values(variables)
        for col, path in holes_:
            nested_set(updated[col], path, given[(col, path)])
    return updated
