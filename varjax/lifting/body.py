"""What the body of a lifted transform sees: its access policy and, when it runs directly
in its transform's trace, its store.

``varjax.lifting.region`` traces each body under a ``TraceContext`` (``varjax.trace.context``) whose
policy is a ``Lifted``: the body may touch the variables whose collection one of the
transform's filters matches, and the streams it was handed.  Two situations are not
errors but signals to the lift, raised as exceptions and caught by ``Lift.__call__``:

* ``LiftRetry`` -- the body touched a variable outside the lifted module (a closure over
  another module): the lift runs again with that variable handed in;
* ``DirectFallback`` -- a body run directly (``DictStore``) used a variable inside an
  inner JAX trace, which a dictionary cannot follow: the lift runs again through the IR;
* ``pass_scopes.CreateOutside`` -- a pass in a body of a transform that hands variables
  in as they are (``cond``, ``switch``) declared a variable beside one the body was handed
  (a LoRA adapter of a kernel created before the cond): the lift creates it in the
  enclosing trace and runs again with it handed in, so every branch gets it.

The keys a body is handed may be ``DerivedKeys``: derived from the transform's keys only
when the body first draws from a stream.  Under Linen's convention a body traced again
from other draw counts may reuse an earlier trace with its counts moved
(``with_counts_moved``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax

from varjax import _jax
from varjax.ir import errors, filters, nested, streams
from varjax.ir.primitives import Key, Path, VarType, is_internal, rng_draw_p
from varjax.trace.context import TraceContext, site
from varjax.trace.variable_api import immutable_error


def lifted_as(groups: Sequence[filters.Filter], like: Mapping[str, str], collection: str) -> int | None:
    """The group whose filter matches ``collection``, or else the collection a pass's
    variables follow (``like``, from ``Pass.lifted_like``: LoRA adapters lift as ``params``)."""
    def match(name: str) -> int | None:
        return next((i for i, f in enumerate(groups) if filters.matches(f, name)), None)
    found = match(collection)
    alias = like.get(collection)
    return found if found is not None or alias is None else match(alias)


@dataclasses.dataclass(frozen=True)
class Lifted:
    """The access policy of a lifted body: variables whose collection matches one of
    ``groups``, and the RNG streams it was given.  ``hidden`` are the enclosing trace's
    streams that were not lifted; ``fix`` tells the user how to lift a collection
    (``{collection}`` is filled in)."""

    name: str
    groups: tuple
    hidden: frozenset
    fix: str
    # Variables of the enclosing trace (or of any enclosing lifted region) that match a
    # filter but were not handed in, because they are outside the lifted module: touching
    # one raises ``LiftRetry`` and the lift runs again with it handed in.
    outside: frozenset = frozenset()
    # Variables the transform was given but did not hand to this body (it set them aside,
    # e.g. a variable without the mapped axis): touching one is an error, not a creation.
    withheld: frozenset = frozenset()
    # Whether a pass's variable declared beside a handed-in one is created outside, before
    # the transform (``pass_scopes.CreateOutside``).
    create_outside: bool = False

    def check(self, ctx: TraceContext, collection: str, path: Path) -> None:
        key = (collection, path)
        if key in self.outside and key not in ctx.variables:
            raise LiftRetry(key)
        if key in self.withheld and key not in ctx.variables:
            raise errors.TransformError(
                f"variable {errors.format_path(path)} of collection '{collection}' is used inside "
                f"vj.{self.name}, which did not hand it to the body: its value does not fit the "
                "transform (for example, it lacks the mapped or scanned axis).",
                collection=collection, path=path, **site(ctx),
                fix=f"give it that axis, or lift '{collection}' without one (variable_axes "
                    "None, variable_broadcast)")
        if is_internal(collection) or lifted_as(self.groups, ctx.lifted_like, collection) is not None:
            return
        raise errors.TransformError(
            f"variable {errors.format_path(path)} of collection '{collection}' is used inside "
            f"vj.{self.name}, but '{collection}' matches none of its variable filters, so the "
            "transform does not know how to lift it.", collection=collection, path=path,
            **site(ctx), fix=self.fix.format(collection=collection))

    def check_stream(self, ctx: TraceContext, stream: str, where_: Path) -> None:
        if stream in self.hidden:
            raise errors.TransformError(
                f"RNG stream '{stream}' is used inside vj.{self.name}, which was not asked "
                "to lift it.", collection=stream, path=where_ or None, **site(ctx),
                fix=f"include '{stream}' in the transform's rngs filter")


class LiftRetry(Exception):
    """A lifted body touched a variable outside the lifted module (a closure): not an error,
    the lift catches it and traces again with the variable handed in."""

    def __init__(self, key: Key):
        super().__init__(key)
        self.key = key


class DirectFallback(Exception):
    """A lifted body running directly (``DictStore``) used a variable inside an inner JAX
    trace (a raw ``jit``/``scan`` body): the lift runs it again through the IR."""


class DictStore:
    """The store of a lifted body that runs directly in its transform's trace: reads and
    writes are dictionary operations on the values handed in, and draws fold a static,
    order-based counter into the handed key (Linen's convention: the module path and
    count), exactly as ``lower-rng`` would."""

    # A direct body falls back as soon as a variable is used inside an inner trace, so no
    # inner trace made under it depends on variables: one shared jit key.
    jit_key = ("varjax", "direct")

    def __init__(self, values: dict[Key, Any], keys: Mapping[str, Any]):
        self.values = values
        self.keys = keys
        self.counters: dict[str, int] = {}
        self.written: set[Key] = set()

    def observe(self, ctx: TraceContext) -> None:
        if _jax.current_trace() is not ctx.top_trace:
            raise DirectFallback()

    def read(self, ctx: TraceContext, collection: str, path: Path, vt: VarType) -> Any:
        return self.values[(collection, path)]

    def write(self, ctx: TraceContext, collection: str, path: Path, leaves: list, tree: Any) -> None:
        # No check-mutability pass runs over a direct body: check here.
        if not ctx.is_mutable(collection):
            raise immutable_error(ctx, collection, path)
        # Stored values are strongly typed, as a var_get would read them back.
        leaves = [jax.lax.convert_element_type(x, x.dtype) if _jax.get_aval(x).weak_type else x
                  for x in leaves]
        self.values[(collection, path)] = jax.tree.unflatten(tree, leaves)
        self.written.add((collection, path))

    def draw(self, ctx: TraceContext, stream: str) -> Any:
        self.observe(ctx)
        n = self.counters.get(stream, 0)
        self.counters[stream] = n + 1
        return streams.derive(self.keys[stream], n)

    def draw_linen(self, ctx: TraceContext, stream: str, path: Path, count: int) -> Any:
        """A draw under Linen's convention: path and count come from the trace's counts."""
        self.observe(ctx)
        return streams.derive_at(self.keys[stream], path, count, stream)


class DerivedKeys(Mapping):
    """An RNG group whose keys are ``derive(key)`` of ``base``'s, computed when the body
    first draws from a stream.  A transform that derives per-step keys inside a loop body
    (``fold_in(key, i)`` in a ``while_loop``) hands these in, so a stream the body never
    draws from never enters the loop: JAX cannot prune an unused input of a ``while``, and
    the lift would keep drawing the enclosing stream for it.  ``derive`` must keep the
    key's type."""

    def __init__(self, base: Mapping[str, Any], derive: Callable[[Any], Any]):
        self.base = dict(base)
        self.derive = derive
        self._done: dict[str, Any] = {}

    def __getitem__(self, stream: str) -> Any:
        if stream not in self._done:
            self._done[stream] = self.derive(self.base[stream])
        return self._done[stream]

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)

    def aval(self, stream: str) -> Any:
        return _jax.get_aval(self.base[stream])


def key_avals(rngs: Sequence[Mapping]) -> dict[str, Any]:
    """Stream -> key aval over RNG groups, without deriving any ``DerivedKeys``."""
    return {s: g.aval(s) if isinstance(g, DerivedKeys) else _jax.get_aval(g[s])
            for g in rngs for s in g}


Counts = Mapping[tuple[str, Path], int]    # Linen draw counts per (stream, module path)


def _counted(eqn: _jax.JaxprEqn) -> tuple[str, Path] | None:
    """The (stream, path) of a Linen draw that took a number from the trace's counts:
    an ``rng_draw`` not yet lowered, or a ``linen_fold_in`` a nested body lowered it to
    (not a handed key, count 0, nor a custom rule's late draw, numbered below 0)."""
    p = eqn.params
    if (eqn.primitive is rng_draw_p and p["path"] is not None and p["count"] > 0) or \
            eqn.primitive is streams.linen_fold_in_p:
        return p["stream"], p["path"]
    return None


def with_counts_moved(jaxpr: _jax.ClosedJaxpr, start: Counts, end: Counts,
                      new_start: Counts) -> tuple[_jax.ClosedJaxpr, dict] | None:
    """The trace a body traced from Linen counts ``start`` (ending at ``end``) would give
    from ``new_start``, and the counts it would end at; None when that cannot be told.

    A trace takes the numbers ``start + 1 .. end`` per (stream, path), so from another
    start the same Python traces the same jaxpr with every count moved by the difference
    of the starts.  Every Linen draw traced inside a lifted body keeps its count in the IR
    (an ``rng_draw``, or the ``linen_fold_in`` a nested body lowered it to: never a
    constant), so moving those moves everything that depends on the counts; numbers taken
    but not in the IR (a nested scan's pre-loop trace) need no moving.  The caller makes
    sure each draw's path is the one it was counted at (no ``nn.jit`` base).  ``scan``
    traces its body twice under Linen's convention (``loops._linen_pretrace``): with this
    the second trace is a walk over the first, at every nesting level."""
    drawn = {k: n - start.get(k, 0) for k, n in end.items() if n != start.get(k, 0)}
    for k, count in _counted_draws(jaxpr):
        if not (k in drawn and start.get(k, 0) < count <= end[k]):
            return None
    by = {k: new_start.get(k, 0) - start.get(k, 0) for k in drawn}

    def move(eqn: _jax.JaxprEqn) -> _jax.JaxprEqn:
        k = _counted(eqn)
        if k is None:
            return eqn
        return eqn.replace(params={**eqn.params, "count": eqn.params["count"] + by[k]})
    new_end = {**new_start, **{k: new_start.get(k, 0) + n for k, n in drawn.items()}}
    return nested.map_eqns(jaxpr, move, enter=lambda j: bool(_counted_draws(j))), new_end


@nested.per_jaxpr
def _counted_draws(jaxpr: _jax.Jaxpr) -> tuple:
    """``((stream, path), count)`` of every counted Linen draw, here or nested (memoised:
    a level's trace holds the inner levels' bodies, and initializer bodies have none)."""
    found: list = []
    for eqn in jaxpr.eqns:
        k = _counted(eqn)
        if k is not None:
            found.append((k, eqn.params["count"]))
        for sub in nested.subjaxprs(eqn):
            found.extend(_counted_draws(sub))
    return tuple(found)
