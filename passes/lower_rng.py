"""lower-rng: turn ``rng_draw`` into key arithmetic on variables.

Two modes, same model code:

* ``explicit`` (default): stream ``s``'s key is the read-only variable
  ``__rng__:s`` (``functionalize`` feeds the key given in ``rngs=``).  Draws
  in straight-line code get ``fold_in(key, n)`` with a *static*, order-based
  counter ``n`` -- exactly what hand-written JAX does.  Branches of a
  conditional each start from the same counter; afterwards it continues
  from the largest.
* ``implicit``: the stream lives in collection ``rngs`` as variables
  ``s/key`` and ``s/count``; a draw reads both, returns ``fold_in(key, count)``
  and writes ``count + 1``, so repeated calls draw fresh keys.

A loop (``scan``/``while``) that draws cannot use a static counter: every
iteration must differ.  Before the loop the pass draws one key for it and
stores it with a zero counter in scratch variables ``__rng__:s/loopN/key`` and
``.../count``; inside, draws are dynamic (``fold_in(loop key, count)``, count
carried by the loop).  Discharge then threads the counter through the loop
like any other carried variable.

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

from varjax import _jax, errors
from varjax.effects import streams_of
from varjax.passes import hop
from varjax.passes.base import Pass, PassContext
from varjax.passes.rewrite import Region, Rewriter
from varjax.passes.walk import enclosing, walk_eqns
from varjax.primitives import Path, bind_get, bind_set, rng_draw_p

RNG_COLLECTION = "__rng__"
COUNT_AVAL = _jax.ShapedArray((), jnp.uint32)
_SCALAR_TREE = jax.tree.structure(0)


@dataclasses.dataclass
class _Static:
    key: tuple[str, Path]
    aval: Any
    counter: int = 0


@dataclasses.dataclass
class _Dynamic:
    key: tuple[str, Path]
    count: tuple[str, Path]
    aval: Any


def _get(var: tuple[str, Path], aval: Any) -> Any:
    return bind_get(var[0], var[1], _SCALAR_TREE, (aval,))[0]


def _set(var: tuple[str, Path], value: Any) -> None:
    bind_set(var[0], var[1], [value], _SCALAR_TREE)


def stream_state(stream: str, aval: Any, mode: str):
    """Where a stream's key (and count) live at the top level, per mode."""
    if mode == "explicit":
        return _Static((RNG_COLLECTION, (stream,)), aval)
    if mode == "implicit":
        return _Dynamic(("rngs", (stream, "key")), ("rngs", (stream, "count")), aval)
    raise errors.PipelineError(f"lower-rng mode must be 'explicit' or 'implicit', not {mode!r}",
                               source=errors.source_text(),
                               fix="write lower-rng{mode=explicit} or lower-rng{mode=implicit}")


class _Lowerer(Rewriter):
    local = True   # a draw's replacement depends on stream counters, not on other values

    def __init__(self):
        super().__init__()
        self.loop_ids = itertools.count()

    def needs_rewrite(self, jaxpr: _jax.Jaxpr) -> bool:
        return bool(streams_of(jaxpr.effects))

    def rewrites(self, eqn: _jax.JaxprEqn) -> bool:
        return eqn.primitive is rng_draw_p

    def draw(self, st) -> Any:
        key = _get(st.key, st.aval)
        if isinstance(st, _Static):
            st.counter += 1
            return jax.random.fold_in(key, st.counter - 1)
        n = _get(st.count, COUNT_AVAL)
        _set(st.count, n + jnp.uint32(1))
        return jax.random.fold_in(key, n)

    def eqn(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        streams: dict = region.state
        if eqn.primitive is rng_draw_p:
            with _jax.source_info_of(eqn):
                return [self.draw(streams[eqn.params["stream"]])]
        used = streams_of(eqn.effects)
        if not used:
            return region.bind(eqn, invals)
        kind = hop.TABLE[eqn.primitive].kind if eqn.primitive in hop.TABLE else None
        if kind == "loop":
            return region.bind(eqn, invals, self.loop_params(eqn, used, streams))
        entry = copy.deepcopy(streams)
        ends: list[dict] = []

        def lower(body):
            state = copy.deepcopy(entry)
            ends.append(state)
            return self.run(body, region.child(state))

        params = hop.with_bodies(eqn, lower)
        n_bodies = len(hop.bodies(eqn))
        for s, st in streams.items():   # continue after the furthest branch/body
            if isinstance(st, _Static):
                st.counter = max(e[s].counter for e in ends[:n_bodies])
        return region.bind(eqn, invals, params)

    def loop_params(self, eqn: _jax.JaxprEqn, used: set[str], streams: dict) -> dict:
        if eqn.primitive is _jax.while_p and streams_of(eqn.params["cond_jaxpr"].effects):
            raise errors.UnsupportedPrimitiveError(
                "an RNG draw inside a while_loop cond_fun cannot advance its stream.",
                collection=sorted(streams_of(eqn.params["cond_jaxpr"].effects))[0],
                **errors.where(eqn.source_info),
                fix="draw the key in body_fun and carry what cond_fun needs in the loop state")
        inner = dict(streams)
        loop = next(self.loop_ids)
        with _jax.source_info_of(eqn):
            for s in sorted(used):
                st = streams[s]
                base: Path = (s, f"loop{loop}")
                dyn = _Dynamic((RNG_COLLECTION, base + ("key",)),
                               (RNG_COLLECTION, base + ("count",)), st.aval)
                _set(dyn.key, self.draw(st))
                _set(dyn.count, jnp.zeros((), jnp.uint32))
                inner[s] = dyn
        return hop.with_bodies(eqn, lambda body: self.run(body, Region(self, state=dict(inner))))


@dataclasses.dataclass(frozen=True)
class LowerRng(Pass):
    name = "lower-rng"
    summary = "lower rng_draw to fold_in over key/counter variables"
    after = ("check-mutability",)
    mode: str = "explicit"

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        used = streams_of(jaxpr.effects)
        if not used:
            return jaxpr
        missing = sorted(used - set(ctx.rng_streams))
        if missing:
            # The first draw from it names the line (draws in custom rules are not walked).
            draw = next((e for e, _ in walk_eqns(jaxpr)
                         if e.primitive is rng_draw_p and e.params["stream"] == missing[0]), None)
            outer = enclosing(jaxpr, draw) if draw is not None else []
            with errors.enclosing(*(e.source_info for e in outer)):
                where = errors.where(draw.source_info if draw else None)
            raise errors.MissingRngError(
                f"RNG stream '{missing[0]}' is drawn from but was not provided.",
                collection=missing[0], **where,
                fix=f"pass rngs={{'{missing[0]}': jax.random.key(0)}} to init/apply")
        lowerer = _Lowerer()
        state = {s: stream_state(s, ctx.rng_streams[s], self.mode) for s in used}
        ctx.count(self.name, "streams", len(used))
        return lowerer.run(jaxpr, Region(lowerer, state=state))
