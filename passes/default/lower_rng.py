"""lower-rng: turn ``rng_draw`` into key arithmetic on variables.

Each stream is lowered in the mode the call chose for it (``varjax.ir.streams``):

* ``explicit`` -- the caller gave a key: it is the read-only variable
  ``__rng__:s``.  Draws in straight-line code get ``fold_in(key, n)`` with a
  *static*, order-based counter ``n`` -- exactly what hand-written JAX does.
  Branches of a conditional each start from the same counter; afterwards it
  continues from the largest.
* ``implicit`` -- the stream is state in collection ``rngs``: variables
  ``s/key`` and ``s/count``.  A draw reads both, returns ``fold_in(key, count)``
  and writes ``count + 1``, so repeated calls draw fresh keys (after a
  conditional, the count is where the branch that ran left it).  The collection
  must be mutable (``ImmutableCollectionError`` names the stream and the line).

Draws that carry a module path and count follow Linen's convention
(``varjax.ir.streams``): ``fold_in(key, c)`` with ``c`` a constant computed here
from the path and count, which tracing assigned.

A loop (``scan``/``while``) that draws cannot use a static counter: every
iteration must differ.  Before the loop the pass draws one key for it (under
Linen's convention: takes the stream's key) and stores it with a zero counter
in scratch variables ``__rng__:s/loopN/key`` and ``.../count``; inside, draws
are dynamic (``fold_in(loop key, count)``; a Linen draw folds the count into
its own key), count carried by the loop.  Discharge then threads the counter
through the loop like any other carried variable.

Sharp edges:
  * Draws in a ``while_loop`` cond_fun are rejected: cond_fun cannot write
    the counter.
  * Adding or removing a draw shifts the keys of every later draw of the same
    stream: keys are order-based, as in Flax.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from varjax import _jax
from varjax.ir import errors, filters, nested, streams
from varjax.ir.caches import LRU
from varjax.ir.effects import RngEffect, streams_of
from varjax.ir.primitives import Path, bind_get, bind_set, rng_draw_p
from varjax.passes.framework.base import Pass, PassContext
from varjax.passes.framework.rewrite import Region, Rewriter

COUNT_AVAL = _jax.ShapedArray((), jnp.uint32)
_SCALAR_TREE = jax.tree.structure(0)


@dataclasses.dataclass
class _Static:
    key: tuple[str, Path]
    aval: Any
    counter: int = 0
    linen: bool = False   # draws carry their module path and count (Linen's convention)


@dataclasses.dataclass
class _Dynamic:
    key: tuple[str, Path]
    count: tuple[str, Path]
    aval: Any


def _get(var: tuple[str, Path], aval: Any) -> Any:
    return bind_get(var[0], var[1], _SCALAR_TREE, (aval,))[0]


def _set(var: tuple[str, Path], value: Any) -> None:
    bind_set(var[0], var[1], [value], _SCALAR_TREE)


def _first_draw(jaxpr: _jax.ClosedJaxpr, stream: str) -> dict[str, Any]:
    """``errors.where`` of the first draw from ``stream`` (the user's line, and the lines of
    the calls around it); draws in custom rules are not walked."""
    draw = next((e for e, _ in nested.walk_eqns(jaxpr)
                 if e.primitive is rng_draw_p and e.params["stream"] == stream), None)
    outer = nested.enclosing_eqns(jaxpr, draw) if draw is not None else []
    with errors.enclosing(*(e.source_info for e in outer)):
        return errors.where(draw.source_info if draw else None)


def stream_state(jaxpr: _jax.ClosedJaxpr, stream: str, ctx: PassContext) -> "_Static | _Dynamic":
    """Where a stream's key (and count) live at the top level: an explicit key if the call
    gave one, else its implicit state in ``rngs``."""
    if stream in ctx.rng_streams:
        return _Static(streams.explicit_key(stream), ctx.rng_streams[stream])
    key, count = streams.key_variable(stream), streams.count_variable(stream)
    if key in ctx.variables and count in ctx.variables:
        if not filters.matches(ctx.mutable, streams.STATE):
            raise errors.ImmutableCollectionError(
                f"RNG stream '{stream}' is kept as state in collection '{streams.STATE}', and "
                "drawing from it advances its count, but the collection is not mutable.",
                collection=streams.STATE, path=count[1], **_first_draw(jaxpr, stream),
                fix=f"pass mutable=['{streams.STATE}'] to apply (and keep the returned state), "
                    f"or give the stream a key: rngs={{'{stream}': key}}")
        return _Dynamic(key, count, ctx.variables[key].avals[0])
    raise errors.MissingRngError(
        f"RNG stream '{stream}' is drawn from but was not provided.", collection=stream,
        **_first_draw(jaxpr, stream),
        fix=f"pass rngs={{'{stream}': jax.random.key(0)}} (or a vj.Rngs) to init/apply")


# The traced replacements of draws, shared by every run: a piece depends only on the
# variables it reads and writes and the key's aval (its key says which), and tracing one
# costs as much as lowering a small init's draws.
_PIECES = LRU()


class _Lowerer(Rewriter):
    local = True   # a draw's replacement depends on stream counters, not on other values

    def __init__(self, symbolic: bool = False):
        super().__init__()
        # In a lifted body: Linen draws become ``linen_fold_in`` (see streams.derive_at).
        self.symbolic = symbolic
        self.loop_ids = itertools.count()
        # While lowering a custom-derivative equation's bodies: the Linen counts of its
        # primal's draws per (stream, path) in order, and the first number the body's own
        # draws have there (see streams.linen_count).
        self.rule_counts: tuple[dict, dict] | None = None

    def linen_count(self, params: dict) -> int:
        """A Linen draw's count; a rule's k-th draw (numbered ``-first``, ``-first - 1``,
        ...) takes its primal's k-th count."""
        count = params["count"]
        if count >= 0:
            return count
        primal, first = self.rule_counts or ({}, {})
        where = (params["stream"], params["path"])
        k = -count - first.get(where, -count)
        if k >= len(primal.get(where, [])):
            raise errors.PassError(
                f"a custom-derivative rule draws from RNG stream '{params['stream']}' at "
                f"{errors.format_path(params['path']) if params['path'] else 'the root path'} "
                "more often than its primal function, "
                "so its keys cannot be the primal's.", collection=params["stream"],
                **errors.where(), fix="draw the same keys in the rule as in the function")
        return primal[where][k]

    def piece(self, eqn: _jax.JaxprEqn, in_avals: list, region: Region) -> tuple:
        """A top-level draw: one traced piece per stream state, reused for every draw.  A
        static counter is the piece's extra input, bound to the draw's counter as a literal
        (so an init drawing a key per parameter traces two or three pieces, not one per
        parameter); a dynamic state's piece reads and advances the count itself."""
        if eqn.primitive is not rng_draw_p:
            return super().piece(eqn, in_avals, region)
        st = region.state[eqn.params["stream"]]
        if eqn.params["path"] is not None:
            return self._linen_piece(eqn, st)
        static = isinstance(st, _Static)
        key = (static, st.key, None if static else st.count, st.aval)
        found = _PIECES.get(key)
        if found is None:
            if static:
                found = self.trace(lambda n: [streams.derive(_get(st.key, st.aval), n)],
                                   [COUNT_AVAL])
            else:
                found = self.trace(lambda: [self.draw(st)], [])
            _PIECES[key] = found
        if not static:
            return found, []
        st.counter += 1
        return found, [_jax.Literal(np.uint32(st.counter - 1), COUNT_AVAL)]

    def _linen_piece(self, eqn: _jax.JaxprEqn, st: "_Static | _Dynamic") -> tuple:
        """A Linen draw: the stream's key itself (count 0), or ``fold_in(key, c)`` with the
        constant ``c`` of its path and count bound as a literal (``streams.linen_data``)."""
        count = self.linen_count(eqn.params)
        if isinstance(st, _Dynamic):   # in a loop: one piece per draw
            params = {**eqn.params, "count": count}
            return self.trace(lambda: [self.draw(st, params)], []), []
        key = (count != 0, st.key, None, st.aval, self.symbolic)
        found = _PIECES.get(key)
        if found is None:
            if count == 0:
                found = self.trace(lambda: [_get(st.key, st.aval)], [])
            elif self.symbolic:   # one piece; each draw sets its fold's parameters
                found = self.trace(lambda: [streams.derive_at(_get(st.key, st.aval), (), 1,
                                                              "")], [])
            else:
                found = self.trace(lambda n: [streams.derive(_get(st.key, st.aval), n)],
                                   [COUNT_AVAL])
            _PIECES[key] = found
        if count == 0:
            return found, []
        if self.symbolic:
            fold = {"stream": eqn.params["stream"], "path": eqn.params["path"], "count": count}
            return nested.map_eqns(found, lambda e: e.replace(params=fold)
                                   if e.primitive is streams.linen_fold_in_p else e), []
        data = streams.linen_data((*eqn.params["path"], count))
        return found, [_jax.Literal(np.uint32(data), COUNT_AVAL)]

    def needs_rewrite(self, jaxpr: _jax.Jaxpr) -> bool:
        return bool(streams_of(jaxpr.effects))

    def rewrites(self, eqn: _jax.JaxprEqn) -> bool:
        return eqn.primitive is rng_draw_p

    def draw(self, st, params: dict | None = None) -> Any:
        key = _get(st.key, st.aval)
        if params is not None and params["path"] is not None:
            key = streams.derive_at(key, params["path"], self.linen_count(params),
                                    params["stream"] if self.symbolic else None)
            if isinstance(st, _Static):
                return key
            n = _get(st.count, COUNT_AVAL)   # in a loop: fold in the iteration's count too
            _set(st.count, n + jnp.uint32(1))
            return streams.derive(key, n)
        if isinstance(st, _Static):
            st.counter += 1
            return streams.derive(key, st.counter - 1)
        n = _get(st.count, COUNT_AVAL)
        _set(st.count, n + jnp.uint32(1))
        return streams.derive(key, n)

    def eqn(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        state: dict = region.state
        if eqn.primitive is rng_draw_p:
            with _jax.source_info_of(eqn):
                return [self.draw(state[eqn.params["stream"]], eqn.params)]
        used = streams_of(eqn.effects)
        if not used:
            return region.bind(eqn, invals)
        if nested.kind_of(eqn) == "loop":
            return region.bind(eqn, invals, self.loop_params(eqn, used, state))
        entry = copy.deepcopy(state)
        ends: list[dict] = []
        primal = None
        if "call_jaxpr" in eqn.params:   # a rule inside a rule: resolve through the outer one
            primal = {k: [self.linen_count({"stream": k[0], "path": k[1], "count": c})
                          for c in counts]
                      for k, counts in _linen_counts(eqn.params["call_jaxpr"]).items()}

        def lower(body):
            state = copy.deepcopy(entry)
            ends.append(state)
            saved = self.rule_counts
            if primal:
                first = {k: min(-c for c in counts) for k, counts in _linen_counts(body).items()
                         if min(counts) < 0}
                self.rule_counts = (primal, first)
            try:
                return self.run(body, region.child(state))
            finally:
                self.rule_counts = saved

        params = nested.with_bodies(eqn, lower)
        n_bodies = len(nested.bodies(eqn))
        for s, st in state.items():   # continue after the furthest branch/body
            if isinstance(st, _Static):
                st.counter = max(e[s].counter for e in ends[:n_bodies])
        return region.bind(eqn, invals, params)

    def loop_params(self, eqn: _jax.JaxprEqn, used: set[str], state: dict) -> dict:
        if eqn.primitive is _jax.while_p and streams_of(eqn.params["cond_jaxpr"].effects):
            raise errors.UnsupportedPrimitiveError(
                "an RNG draw inside a while_loop cond_fun cannot advance its stream.",
                collection=sorted(streams_of(eqn.params["cond_jaxpr"].effects))[0],
                **errors.where(eqn.source_info),
                fix="draw the key in body_fun and carry what cond_fun needs in the loop state")
        inner = dict(state)
        loop = next(self.loop_ids)
        with _jax.source_info_of(eqn):
            for s in sorted(used):
                st = state[s]
                base: Path = (s, f"loop{loop}")
                dyn = _Dynamic((streams.KEYS, base + ("key",)), (streams.KEYS, base + ("count",)),
                               st.aval)
                linen = isinstance(st, _Static) and st.linen
                _set(dyn.key, _get(st.key, st.aval) if linen else self.draw(st))
                _set(dyn.count, jnp.zeros((), jnp.uint32))
                inner[s] = dyn
        return nested.with_bodies(eqn, lambda body: self.run(body, Region(self, state=dict(inner))))


@nested.per_jaxpr
def _linen_streams(jaxpr: _jax.Jaxpr) -> frozenset[str]:
    """The streams drawn from under Linen's convention, here or nested.  Only equations
    with an RNG effect are entered: an init's many initializer bodies are not walked."""
    found: set[str] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive is rng_draw_p:
            if eqn.params["path"] is not None:
                found.add(eqn.params["stream"])
        elif streams_of(eqn.effects):
            for sub in nested.subjaxprs(eqn):
                found |= _linen_streams(sub)
    return frozenset(found)


def _linen_counts(body: Any) -> dict:
    """The counts of the Linen draws in ``body``, per (stream, path), in program order."""
    found: dict = {}
    for eqn, _ in nested.walk_eqns(nested.closed(body)):
        if eqn.primitive is rng_draw_p and eqn.params["path"] is not None:
            found.setdefault((eqn.params["stream"], eqn.params["path"]), []).append(
                eqn.params["count"])
    return found


@dataclasses.dataclass(frozen=True)
class LowerRng(Pass):
    """Lowers every ``rng_draw`` to ``fold_in`` over key and counter variables (a default
    pass; the module docstring gives each stream mode's lowering)."""

    name = "lower-rng"
    summary = "lower rng_draw to fold_in over key/counter variables"
    after = ("check-mutability",)
    lowers = (RngEffect,)
    rootable = True     # one lowering for the whole program, whatever part it is for

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        used = streams_of(jaxpr.effects)
        if not used:
            return jaxpr
        state = {s: stream_state(jaxpr, s, ctx) for s in sorted(used)}
        for stream in _linen_streams(jaxpr):
            st = state[stream]
            if not isinstance(st, _Static):
                eqn = next(e for e, _ in nested.walk_eqns(jaxpr) if e.primitive is rng_draw_p
                           and e.params["stream"] == stream and e.params["path"] is not None)
                raise errors.PassError(
                    f"a draw of RNG stream '{stream}' follows Linen's "
                    "convention, but the stream is kept as state.",
                    collection=stream, **errors.where(eqn.source_info),
                    fix="give the stream as a key (rngs={...}) for Linen's keys")
            st.linen = True
        lowerer = _Lowerer(symbolic=ctx.region)
        ctx.count(self.name, "streams", len(used))
        return lowerer.run(jaxpr, Region(lowerer, state=state))
