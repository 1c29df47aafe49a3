"""Where RNG streams live in the IR, and which stream a draw comes from.

A stream reaches a traced function in one of two ways, and that choice --
made per call, per stream, by what the caller passes -- is the stream's
*mode*; the model code is the same for both:

* **explicit**: the caller gives a key (``rngs={'dropout': key}``).  The key
  is the read-only scratch variable ``__rng__:dropout``; ``lower-rng`` turns
  draws into ``fold_in(key, n)`` with a static ``n``.
* **implicit**: the stream is state, two variables of collection ``rngs``:
  ``rngs:dropout/key`` and ``rngs:dropout/count``.  A draw reads both, returns
  ``fold_in(key, count)`` and writes ``count + 1``, so a caller that keeps the
  returned state draws fresh keys on every call.

The two modes follow two conventions, so that each matches the library whose
calling convention it is:

* **Linen's** (explicit keys): the ``c``-th draw (``c`` from 1) of stream ``s``
  by the module at path ``P`` is ``fold_in(key_s, linen_data(P + (c,)))``,
  counted per stream and per module path.  ``linen_data`` is a 32-bit constant
  computed in Python while lowering, so the IR holds one ``fold_in`` with a
  literal, as hand-written JAX would; ``init`` then returns Linen's parameters
  bit for bit for the same key.
* **NNX's** (implicit state, a ``vj.Rngs``): the i-th draw of a call is
  ``fold_in(key, count0 + i)``, order-based across the whole call.  A lifted
  body handed one key drawn from such a stream counts its own draws the same
  way, with static ``i``.

The counts of Linen's convention are assigned while tracing (``LinenCounts``,
shared by the trace and its lifted bodies, as Linen's scopes share theirs), so
a draw carries its path and count into the IR; NNX's are counted by
``lower-rng`` (static) or by the state itself (dynamic).

A draw from a stream that was not given falls back to the ``default``
stream (the positional seed of ``vj.Rngs``), as in Flax NNX; ``Module.make_rng``
then falls back to ``params``, as in Linen.  Fallback is resolved at trace
time, so the IR names the stream that is actually drawn from, and two streams
falling back to ``default`` share its counter instead of repeating its keys.
"""
from __future__ import annotations

import hashlib
import weakref
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from varjax import _jax
from varjax.ir.primitives import Key, zero_tangent

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
    """The ``n``-th key of a stream whose key is ``key`` under NNX's convention:
    ``fold_in(key, n)``.  The one derivation every NNX path uses (``lower-rng``, a lifted
    body run directly, ``vj.Rngs``, a bound module's n-th call), so that they stay
    bit-identical."""
    if type(n) is int and 0 <= n < 2 ** 32 and _jax.is_typed_key(key):
        return _jax.fold_in_static(key, n)   # the same equation, staged for half the cost
    return jax.random.fold_in(key, n)


def linen_data(data: tuple[str | int, ...]) -> int:
    """The 32-bit constant Linen folds into a key for static data (a module path and a
    draw count): the first 4 bytes, big-endian, of the SHA-1 of the items concatenated
    (strings as UTF-8, ints as their minimal big-endian bytes).  Computed once, in Python,
    when a draw is lowered: the IR only sees the literal."""
    digest = hashlib.sha1()
    for item in data:
        if isinstance(item, str):
            digest.update(item.encode("utf-8"))
        else:
            digest.update(int(item).to_bytes((int(item).bit_length() + 7) // 8, "big"))
    return int.from_bytes(digest.digest()[:4], "big")


def derive_at(key: Any, path: tuple[str, ...], count: int, stream: str | None = None) -> Any:
    """Linen's key for draw ``count`` (from 1) of the module at ``path``; ``count == 0``
    is the stream's key itself (what a lifted transform hands its body).  With ``stream``
    (inside a lifted body) the draw stays a ``linen_fold_in`` equation, whose count a
    later trace may move (``lifting.body.with_counts_moved``)."""
    if count == 0:
        return key
    if stream is not None:
        return linen_fold_in_p.bind(key, stream=stream, path=tuple(path), count=int(count))
    return derive(key, linen_data((*path, count)))


# ``fold_in(key, linen_data(path + (count,)))`` with path and count as parameters: what a
# Linen draw inside a lifted body lowers to.  It compiles to exactly that ``fold_in`` of a
# constant, and keeps the count visible, so a body Linen traces twice (scan) can be traced
# once and the second trace made by moving counts, at every nesting level.
linen_fold_in_p = _jax.Primitive("linen_fold_in")


def _fold_impl(key: Any, *, stream: str, path: tuple, count: int) -> Any:
    data = linen_data((*path, count))
    if _jax.is_typed_key(key):
        return derive(key, data)
    # Raw uint32 keys, batched ones too (jax.random.fold_in takes one raw key only).
    return jax.random.key_data(derive(jax.random.wrap_key_data(key), data))


def _fold_batch(args: Any, dims: Any, **params: Any) -> tuple[Any, int]:
    key, dim = args[0], dims[0]
    if not _jax.is_typed_key(key) and dim != 0:   # raw uint32 keys: the key data axis last
        key, dim = jnp.moveaxis(key, dim, 0), 0
    return linen_fold_in_p.bind(key, **params), dim


def _fold_jvp(primals: Any, tangents: Any, **params: Any) -> tuple[Any, Any]:
    out = linen_fold_in_p.bind(primals[0], **params)
    return out, zero_tangent(_jax.get_aval(out))


linen_fold_in_p.def_impl(_fold_impl)
linen_fold_in_p.def_abstract_eval(lambda key, **params: key)
_jax.primitive_batchers[linen_fold_in_p] = _fold_batch
_jax.primitive_jvps[linen_fold_in_p] = _fold_jvp
_jax.lower_as(linen_fold_in_p, _fold_impl)
_jax.stage_uncached(linen_fold_in_p)   # its parameters name module paths, as a variable's do


def candidates(name: str, fallbacks: tuple[str, ...] = (DEFAULT,)) -> tuple[str, ...]:
    """The streams a draw from ``name`` may come from, in order."""
    return (name,) + tuple(f for f in fallbacks if f != name)


class LinenCounts:
    """The draw counts of one top-level trace under Linen's convention: which streams
    follow it (those given as keys) and, per ``(stream, module path)``, how many draws
    were made so far.  Every context of the trace shares it -- lifted bodies included, as
    Linen's scopes share their counters with the transformed scopes -- so a count is a
    static number known while tracing, and each trace of a lifted body (Linen traces
    some twice) advances the counts as it does in Linen."""

    def __init__(self, names: Any):
        self.streams = frozenset(names)
        self.counts: dict[tuple[str, tuple[str, ...]], int] = {}

    def next(self, stream: str, path: tuple[str, ...]) -> int:
        """The number of the next draw of ``stream`` at ``path`` (from 1)."""
        n = self.counts.get((stream, path), 0) + 1
        self.counts[(stream, path)] = n
        return n

    def snapshot(self) -> dict:
        return dict(self.counts)

    def restore(self, snapshot: Mapping) -> None:
        """Set the counts back (a lift that retries its trace, a body traced again)."""
        self.counts.clear()
        self.counts.update(snapshot)


_linen: "weakref.WeakKeyDictionary[Any, LinenCounts]" = weakref.WeakKeyDictionary()


def start_linen(origin: Any, names: Any) -> None:
    """Streams ``names`` of the trace whose origin context is ``origin`` follow Linen's
    convention (a top-level trace calls this with the streams given as keys)."""
    _linen[origin] = LinenCounts(names)


def linen_counts(origin: Any) -> LinenCounts | None:
    """The Linen counts of the trace ``origin`` started, if any stream follows Linen."""
    found = _linen.get(origin)
    return found if found is not None and found.streams else None


_bases: "weakref.WeakKeyDictionary[Any, tuple[str, ...]]" = weakref.WeakKeyDictionary()


_rebased = [0]   # how many contexts got a base so far (see ``rebased``)


def set_linen_base(ctx: Any, base: tuple[str, ...]) -> None:
    """Draws under ``ctx`` fold in their module path relative to ``base``: inside Linen's
    ``nn.jit`` / ``nn.fold_rngs`` the keys are fresh draws at the transformed module's
    path, and paths below it count from there."""
    if base:
        _bases[ctx] = tuple(base)
        _rebased[0] += 1


def rebased() -> int:
    """A number that changes whenever a context gets a base path: a trace during which it
    did not change has draws whose paths are the paths they are counted at."""
    return _rebased[0]


def linen_base(ctx: Any) -> tuple[str, ...]:
    return _bases.get(ctx, ())


_regions: "weakref.WeakSet[Any]" = weakref.WeakSet()
_rule_counts: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def mark_region(ctx: Any) -> None:
    """``ctx`` traces the body of a lifted transform: its draws count on the trace's counts."""
    _regions.add(ctx)


def linen_count(ctx: Any, counts: LinenCounts, stream: str, path: tuple[str, ...]) -> int:
    """The count of the next Linen draw of ``stream`` at ``path`` under ``ctx``.

    A context that is neither a trace's own nor a lifted body's is a snapshot under which a
    pass traces a custom-derivative rule late, after the whole trace: its draws are numbered
    ``-1, -2, ...`` per stream and path, and ``lower-rng`` gives the k-th the count of the
    k-th such draw of the rule's primal, so the rule draws the keys its primal drew."""
    if ctx is ctx.origin or ctx in _regions:
        return counts.next(stream, path)
    mine = _rule_counts.setdefault(ctx, {})
    mine[(stream, path)] = mine.get((stream, path), 0) + 1
    return -mine[(stream, path)]
