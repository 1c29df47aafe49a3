"""Where RNG streams live in the IR, and which stream a draw comes from.

A stream reaches a traced function in one of two ways, and that choice --
made per call, per stream, by what the caller passes -- is the stream's
*mode*; the model code is the same for both:

* **explicit**: the caller gives a key (``rngs={'dropout': key}``).  The key
  is the read-only scratch variable ``__rng__:dropout``; ``lower-rng`` turns
  draws into ``fold_in(key, n)`` with a static, order-based ``n``.
* **implicit**: the stream is state, two variables of collection ``rngs``:
  ``rngs:dropout/key`` and ``rngs:dropout/count``.  A draw reads both, returns
  ``fold_in(key, count)`` and writes ``count + 1``, so a caller that keeps the
  returned state draws fresh keys on every call.

Both derive the i-th key of a call as ``fold_in(key, count0 + i)``, with
``count0 = 0`` for an explicit key: a fresh ``vj.Rngs(0)`` and the key
``jax.random.key(0)`` initialise bitwise the same parameters.

A draw from a stream that was not given falls back to the ``default``
stream (the positional seed of ``vj.Rngs``), as in Flax NNX; ``Module.make_rng``
then falls back to ``params``, as in Linen.  Fallback is resolved at trace
time, so the IR names the stream that is actually drawn from, and two streams
falling back to ``default`` share its counter instead of repeating its keys.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax

from varjax.primitives import Key

PARAMS = "params"      # initialises parameters, as in Flax
DEFAULT = "default"    # the fallback stream: vj.Rngs's positional seed
KEYS = "__rng__"       # explicit keys (and loop scratch) -- an internal collection
STATE = "rngs"         # implicit state: one {'key', 'count'} pair per stream


def key_variable(stream: str) -> Key:
    """The variable holding an implicit stream's key."""
    return (STATE, (stream, "key"))


def count_variable(stream: str) -> Key:
    """The variable holding an implicit stream's count (a ``uint32`` scalar)."""
    return (STATE, (stream, "count"))


def explicit_key(stream: str) -> Key:
    """The read-only scratch variable that holds an explicit stream's key."""
    return (KEYS, (stream,))


def implicit_streams(variables: Mapping[Key, Any]) -> dict[str, Any]:
    """The streams kept as state in ``variables`` (keyed by ``(collection, path)``, with
    ``VarType`` values): stream name -> the ``VarType`` of its key."""
    found = {}
    for (col, path), vt in variables.items():
        if col == STATE and len(path) == 2 and path[1] == "key" and count_variable(path[0]) in variables:
            found[path[0]] = vt
    return found


def derive(key: Any, n: Any) -> Any:
    """The ``n``-th key of a stream whose key is ``key``: ``fold_in(key, n)``.  The one
    derivation every path uses (``lower-rng``, a lifted body run directly, ``vj.Rngs``),
    so that they stay bit-identical."""
    return jax.random.fold_in(key, n)


def candidates(name: str, fallbacks: tuple[str, ...] = (DEFAULT,)) -> tuple[str, ...]:
    """The streams a draw from ``name`` may come from, in order."""
    return (name,) + tuple(f for f in fallbacks if f != name)
