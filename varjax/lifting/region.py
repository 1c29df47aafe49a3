"""The lifting API: run stateful code inside any JAX transformation.

JAX transformations take pure functions; a module body reads and writes variables.
``lift`` bridges the two, as Flax's ``pack`` does for scopes, but reads the body's
variable traffic off the IR:

    lifted = vj.lift(transform, body, variables=(f0, f1, ...), rngs=(g0, ...))
    out = lifted(*args)              # inside a functionalized function

When ``lifted`` runs, the variables of the enclosing trace are split into *groups* by the
filters (first matching filter wins), the RNG streams likewise, and ``transform`` is called as

    transform(region, groups, rng_groups, *args) -> (out, groups_out)

``groups`` is a tuple of dicts ``{(collection, path): value}``; ``rng_groups`` a tuple of
dicts ``{stream: key}``.  ``region`` is the body in functionalized form, a pure function the
author may call under any JAX transformation:

    region(groups, rng_groups, *args) -> (out, groups_out)

It runs the body seeing exactly the variables and keys it is handed (so inside ``jax.vmap``
it sees per-example shapes): directly in the transform's trace, with reads and writes
resolved in a dictionary, or -- when the body uses a variable inside an inner JAX trace, or
the transform asked for its ``traffic`` -- through the IR: traced, made pure by the pass
pipeline, and its equations bound. A transform may withhold variables (``set_aside``: say,
ones without the mapped axis); a body touching one raises ``TransformError`` rather than
creating a new variable; ``groups_out`` is ``groups`` plus every variable the body wrote or
created. ``region.traffic(...)`` traces without running and says what the body reads,
writes, creates and draws, so a transform can decide how to run it (peel a loop iteration,
reject a branch).

Around the transform, ``lift`` re-emits effects in the enclosing trace: a ``var_get`` for
each variable the transform's result depends on, an ``rng_draw`` for each stream it uses,
the transform itself as one ``jit`` equation, and a ``var_set`` for each variable a region
wrote. So lifted transforms nest: an inner one is ordinary variable effects to the outer
one, and each body is traced once per level. Nested in a body that runs directly, where a
variable is a dictionary entry, a lift instead hands in everything and runs the transform in
the enclosing trace (``_LiftedCall._inlines``).

Rules:
  * a variable touched in the body whose collection matches no filter raises
    ``TransformError`` naming it (never a silent drop); an RNG stream matching
    no ``rngs`` filter is not available in the body;
  * every variable a region wrote must be in ``groups_out`` (under its
    group); dropping one raises ``TransformError``;
  * a leading ``Module`` argument of ``lifted`` is closed over by every body
    rather than passed to the transform (Linen's ``fn(module, *args)``
    convention), and each body first runs the module's ``setup`` in the region
    (``Module._varjax_bodies``); closures over modules and variables work the
    same way, since the body's variable traffic is read from the IR, not from
    its arguments.
"""
from __future__ import annotations

import dataclasses
from collections import ChainMap
from typing import Any, Callable, Mapping, Sequence, TypeGuard

import jax

from varjax import _jax
from varjax.functionalization.functionalized import Functionalized
from varjax.functionalization.outputs import reveal
from varjax.ir import errors, filters, liveness, streams
from varjax.ir.effects import RngEffect
from varjax.ir.primitives import Key, VarType, handing
from varjax.ir.protocols import LiftableModule
from varjax.lifting.body import DerivedKeys as DerivedKeys  # part of vj.lift's API
from varjax.lifting.body import (
    DictStore,
    DirectFallback,
    Lifted,
    LiftRetry,
    key_avals,
    lifted_as,
    with_counts_moved,
)
from varjax.lifting.groups import Group, is_array, is_handle
from varjax.passes.framework.analysis import traffic as _traffic
from varjax.passes.framework.pipeline import parse_entries
from varjax.trace import variable_api
from varjax.trace.context import IR_STORE, Store, TraceContext, activate, current, lifted_like, site
from varjax.trace.pass_scopes import CreateOutside


@dataclasses.dataclass(frozen=True)
class BodyTraffic:
    """What one trace of a body does with variables and RNG streams."""

    reads: frozenset[Key]      # needed on entry
    writes: frozenset[Key]     # written on some path (creations included)
    creates: frozenset[Key]    # written, and not handed in
    streams: frozenset[str]    # RNG streams drawn from


def is_module(x: Any) -> TypeGuard[LiftableModule]:
    """Whether ``x`` is a varjax.nn Module (``protocols.LiftableModule``: this layer sits
    below varjax.nn, so it tests the class marker instead of importing the class)."""
    return getattr(type(x), "_varjax_module", False)


class LiftedRegion:
    """One body of a lifted transform, as a pure function of variable groups, keys and
    arguments (see the module docstring)."""

    def __init__(self, body: Callable[..., Any], call: "_LiftedCall", path: tuple[str, ...]):
        self._lifted = call
        # The scope the body runs in (a leading module's path, else the function's scope): the
        # group conversions make group keys relative to it, as Linen's dicts are.
        self.path = path
        self.body = body
        self._fns: dict[tuple, tuple[Functionalized, dict]] = {}
        self.__name__ = getattr(body, "__name__", "body")
        self.writes: set[Key] = set()
        self._probed = False

    @property
    def linen(self) -> streams.LinenCounts | None:
        """The enclosing trace's Linen draw counts (None when no stream follows Linen's
        convention): a transform that traces its body as Linen does not (``scan``'s
        extra trace) keeps them equal to Linen's."""
        return streams.linen_counts(self._lifted.outer.origin)

    def group_of(self, key: Key) -> int | None:
        """The index of the variable group that variable ``key`` belongs to."""
        return self._lifted.group_of(key[0])

    @property
    def mutable(self) -> Any:
        """The enclosing trace's mutable filter: with ``False`` the body can neither write
        nor create a variable, so a transform need not ask ``traffic`` about it."""
        return self._lifted.outer.mutable

    def _traced(self, trace: Callable[[Functionalized], Any], jaxpr_of: Callable[[Any], Any]) -> Any:
        """Run ``trace`` on the body's ``Functionalized`` for the current Linen counts.

        Under Linen's convention a trace bakes the counts it starts from into its draws,
        so traces are cached per starting counts; a cached trace advances the counts as
        tracing it did, so every call of a region counts as one trace (as in Linen)."""
        linen = streams.linen_counts(self._lifted.outer.origin)
        start = () if linen is None else tuple(sorted(linen.counts.items()))
        if start not in self._fns:
            fn = Functionalized(self.body, context=self._context, inline=True,
                                passes=self._lifted.passes)
            self._fns[start] = (fn, self._moved_traces(fn, dict(start)) if linen else {})
        fn, ends = self._fns[start]
        before, rebased = fn.trace_count, streams.rebased()
        result = trace(fn)
        if linen is not None:
            jaxpr = jaxpr_of(result)
            if fn.trace_count != before or id(jaxpr) not in ends:
                ends[id(jaxpr)] = (jaxpr, linen.snapshot(), streams.rebased() == rebased)
            else:
                linen.restore(ends[id(jaxpr)][1])
        return result

    def _moved_traces(self, fn: Functionalized, start: dict) -> dict:
        """Seed ``fn`` (this body from Linen counts ``start``) with the traces from other
        starts whose counts can be moved (``with_counts_moved``); returns their ends."""
        ends: dict = {}
        seeded: set = set()    # one trace per key: a moved trace is moved again, not both
        for other, (earlier, earlier_ends) in self._fns.items():
            for traced in earlier._effectful_traces():
                found = earlier_ends.get(id(traced.jaxpr))
                if traced.key in seeded or found is None or not found[2] \
                        or streams.linen_base(traced.context):
                    continue   # seeded already, or a draw's path may not be its counted one
                moved = with_counts_moved(traced.jaxpr, dict(other), found[1], start)
                if moved is not None:
                    fn._adopt(traced, *moved)
                    ends[id(moved[0])] = (*moved, True)
                    seeded.add(traced.key)
        return ends

    def _context(self, key: Any) -> TraceContext:
        return self._region_context(dict(key.variables), dict(key.rngs))

    def _region_context(self, handed: dict[Key, VarType], keys: dict[str, Any],
                        store: Store = IR_STORE) -> TraceContext:
        withheld = frozenset(k for types in self._lifted.var_types for k in types
                             if k not in handed)
        view = dataclasses.replace(self._lifted.view, withheld=withheld)
        outer = self._lifted.outer
        ctx = outer.region(handed, keys, view, store)
        streams.mark_region(ctx)
        streams.set_linen_base(ctx, self.path if self._lifted.forked else
                               streams.linen_base(outer))
        return ctx

    def _flat(self, groups: Sequence[Group], rngs: Sequence[dict]) -> tuple[dict, dict]:
        self._lifted.check_groups(groups, rngs)
        flat = {}
        for group in groups:
            for key, value in group.items():
                leaves, tree = jax.tree.flatten(value)
                flat[key] = (tree, leaves)
        return flat, {s: k for g in rngs for s, k in g.items()}

    def traffic(self, groups: Sequence[Group], rngs: Sequence[dict], *args: Any,
                **kwargs: Any) -> BodyTraffic:
        """Trace the body for these inputs (cached: a later call with the same types does
        not trace again) and report its traffic; nothing runs."""
        self._probed = True   # the call that follows reuses this trace (the IR path)
        flat, keys = self._flat(groups, rngs)
        outer = self._lifted.outer
        closed = self._traced(lambda fn: fn._effectful_jaxpr(flat, args, kwargs, keys, outer.mutable,
                                                             outer.initializing), lambda c: c)
        t = _traffic(closed)
        streams = frozenset(e.stream for e in closed.effects if isinstance(e, RngEffect))
        return BodyTraffic(t.needs, t.may_write, t.may_write - set(flat), streams)

    def __call__(self, groups: Sequence[Group], rngs: Sequence[dict], *args: Any,
                 **kwargs: Any) -> tuple[Any, tuple[Group, ...]]:
        if self._lifted.direct and not self._probed:
            self._lifted.check_groups(groups, rngs)
            out, written = self._run_direct(groups, rngs, args, kwargs)
        else:
            flat, keys = self._flat(groups, rngs)
            outer = self._lifted.outer
            out, written, _ = self._traced(
                lambda fn: fn._call(flat, args, kwargs, keys, outer.mutable, outer.initializing),
                lambda r: r[2].effectful)
            # The IR moved non-array outputs into the output's structure (varjax.functionalization.outputs):
            # the transform gets them back as the direct run returns them.
            out = reveal(out)
        self.writes.update(written)
        groups_out = tuple(dict(g) for g in groups)
        for key, value in written.items():
            groups_out[self._lifted.group_of(key[0])][key] = value
        return out, groups_out

    def _run_direct(self, groups: Sequence[Group], rngs: Sequence[Mapping], args: tuple,
                    kwargs: dict) -> tuple[Any, dict[Key, Any]]:
        """Run the body in the transform's own trace, with reads and writes resolved in a
        dictionary (``DictStore``): no effectful trace, no pipeline, no re-binding.  A
        variable used inside an inner JAX trace raises ``DirectFallback`` and the lift runs
        again through the IR (``Functionalized``)."""
        values = {k: v for g in groups for k, v in g.items()}
        store = DictStore(values, ChainMap(*rngs))   # a key is looked up when drawn
        ctx = self._region_context({k: VarType.of(v) for k, v in values.items()},
                                   key_avals(rngs), store)
        ctx.top_trace = _jax.current_trace()
        with activate(ctx):
            out = self.body(*args, **kwargs)
        return out, {k: store.values[k] for k in sorted(store.written)}


class _LiftedCall:
    """One call of a lifted function: the enclosing context, the groups, the regions.

    The groups hold the variables under ``scope`` (the lifted module's path; everything
    for a plain function) plus ``extra``: variables outside it that an earlier attempt
    found the body touching (closures over other modules)."""

    def __init__(self, lifted: "Lift", outer: TraceContext, scope_: tuple[str, ...],
                 extra: frozenset[Key], direct: bool, forked: dict[str, Any]):
        self.lifted = lifted
        self.outer = outer
        self.direct = direct
        # The body's pipeline adds the enclosing program's passes and the lift's own.
        self.passes = (*outer.passes, *lifted.passes)
        self.lifted_like = lifted_like(self.passes)
        # Under Linen's convention, the keys a forking lift drew for its body (see Lift).
        self.forked = forked
        self.var_types: list[dict[Key, VarType]] = [{} for _ in lifted.variables]
        outside = set(outer.policy.outside) if outer.policy is not None else set()
        for key, vt in outer.variables.items():
            i = self.group_of(key[0])
            if i is None:
                continue
            if key[1][:len(scope_)] == scope_ or key in extra:
                self.var_types[i][key] = vt
            else:
                outside.add(key)
        self.stream_avals: list[dict[str, Any]] = [{} for _ in lifted.rngs]
        hidden = set()
        for stream, aval in sorted(outer.rng_streams.items()):
            i = self.rng_group_of(stream)
            if i is None:
                hidden.add(stream)
            else:
                self.stream_avals[i][stream] = aval
        # A stream a filter names that the enclosing trace has only through its fallback
        # (vj.Rngs(0): every stream is 'default') is handed in under its own name, drawn
        # from the fallback: split_rngs={'dropout': True} splits dropout even then.
        if streams.DEFAULT in outer.rng_streams and streams.DEFAULT not in hidden:
            named = set().union(*(_names(f) for f in lifted.rngs))
            for name in sorted(named - set(outer.rng_streams)):
                i = self.rng_group_of(name)
                if i is not None:
                    self.stream_avals[i][name] = outer.rng_streams[streams.DEFAULT]
        self.view = Lifted(lifted.name, lifted.variables, frozenset(hidden), lifted.fix,
                           frozenset(outside), create_outside=lifted.create_outside)

    def rng_group_of(self, stream: str) -> int | None:
        return next((i for i, f in enumerate(self.lifted.rngs) if filters.matches(f, stream)), None)

    def group_of(self, collection: str) -> int | None:
        return lifted_as(self.lifted.variables, self.lifted_like, collection)

    def check_groups(self, groups: Sequence[Group], rngs: Sequence[dict]) -> None:
        if len(groups) != len(self.var_types) or len(rngs) != len(self.stream_avals):
            raise errors.TransformError(
                f"the region of vj.{self.lifted.name} was called with {len(groups)} variable "
                f"groups and {len(rngs)} RNG groups; it has {len(self.var_types)} and "
                f"{len(self.stream_avals)}.", **site(self.outer),
                fix="pass the groups the transform received, in the same order")

    def _inlines(self) -> bool:
        """Whether the transform can run in the enclosing trace as it is, with every
        variable and key handed in: when the enclosing body runs directly (its variables are
        values in a dictionary, so handing one that the body never uses costs no read) and
        handing a key draws nothing.  This is the usual case of nested lifted transforms,
        and it spares each level tracing its transform to a jaxpr and replaying it."""
        outer = self.outer
        return (outer.policy is not None and isinstance(outer.store, DictStore)
                and _jax.current_trace() is outer.top_trace
                and all(s in self.forked or variable_api.hands_as_is(outer, s)
                        for avals in self.stream_avals for s in avals))

    def _key(self, stream: str) -> Any:
        return (self.forked[stream] if stream in self.forked else
                variable_api.hand_key_at(self.outer, stream, self.outer.path_prefix))

    def _staged(self, transformed: Callable, var_specs: list, streams: list, args: list,
                name: str) -> list:
        """Trace ``transformed`` to a jaxpr, prune it, and hand in only what it uses: the
        variables it reads and the keys it draws from (a handed key may cost a draw)."""
        in_avals = [a for _, _, vt in var_specs for a in vt.avals]
        in_avals += [aval for _, _, aval in streams]
        in_avals += [_jax.get_aval(x) for x in args]
        closed = _jax.trace_to_jaxpr(transformed, in_avals, name=self.lifted.name)
        pruned, consts, used = liveness.prune(closed)
        inputs, pos = [], 0
        for _, (col, path), vt in var_specs:
            n = len(vt.avals)
            if any(used[pos:pos + n]):
                with handing(self.lifted.name):   # the boundary: passes leave it alone
                    value = jax.tree.leaves(variable_api.read_at(self.outer, col, path))
                inputs += [x for x, u in zip(value, used[pos:pos + n]) if u]
            pos += n
        for _, stream, _ in streams:
            if used[pos]:
                inputs.append(self._key(stream))
            pos += 1
        inputs += [x for x, u in zip(args, used[pos:]) if u]
        if self.outer.policy is None:   # outermost: one jit equation named after the transform
            return _jax.jit_call(pruned, name)(*consts, *inputs)
        return _jax.eval_jaxpr(pruned.jaxpr, (), *consts, *inputs)   # the enclosing trace stages it

    def run(self, bodies: Sequence[Callable], path: tuple[str, ...], args: tuple,
            kwargs: dict) -> Any:
        name = self.lifted.name
        regions = [LiftedRegion(b, self, path) for b in bodies]
        var_specs = [(i, key, vt) for i, types in enumerate(self.var_types)
                     for key, vt in sorted(types.items())]
        streams = [(i, s, aval) for i, avals in enumerate(self.stream_avals)
                   for s, aval in avals.items()]
        leaves, arg_tree = jax.tree.flatten((args, kwargs), is_leaf=is_handle)  # ``partition``
        traced_at = [j for j, x in enumerate(leaves) if is_array(x)]
        result: dict[str, Any] = {}

        def transformed(*flat):
            flat = list(flat)
            groups: list[Group] = [{} for _ in self.var_types]
            for i, key, vt in var_specs:
                n = len(vt.avals)
                groups[i][key] = jax.tree.unflatten(vt.tree, flat[:n])
                del flat[:n]
            rng_groups: list[dict] = [{} for _ in self.stream_avals]
            for i, s, _ in streams:
                rng_groups[i][s] = flat.pop(0)
            full = list(leaves)
            for j, x in zip(traced_at, flat):
                full[j] = x
            a, k = jax.tree.unflatten(arg_tree, full)
            out, groups_out = self.lifted.transform(*regions, tuple(groups), tuple(rng_groups),
                                                    *a, **k)
            written = sorted(set().union(*(r.writes for r in regions)))
            outs, result["out_tree"] = jax.tree.flatten(out)
            result["written"] = []
            for key in written:
                group = groups_out[self.group_of(key[0])] if len(groups_out) == len(groups) else {}
                if key not in group:
                    raise errors.TransformError(
                        f"vj.{name} dropped variable {errors.format_path(key[1])}: its body wrote "
                        "it, but the transform did not return it in its variable groups.",
                        collection=key[0], path=key[1], **site(self.outer),
                        fix="return every group the region returned (groups_out), "
                            "transformed as needed")
                v_leaves, tree = jax.tree.flatten(group[key])
                result["written"].append((key, tree, len(v_leaves)))
                outs += v_leaves
            return outs

        if self._inlines():
            # Every input is handed: unused ones leave dead equations, which the outermost
            # lift's pruning removes with the rest.
            inputs = [x for _, (col, path), _ in var_specs
                      for x in jax.tree.leaves(variable_api.read_at(self.outer, col, path))]
            inputs += [self._key(stream) for _, stream, _ in streams]
            outs = transformed(*inputs, *(leaves[j] for j in traced_at))
        else:
            outs = self._staged(transformed, var_specs, streams, [leaves[j] for j in traced_at],
                                f"{name}({'/'.join(r.__name__ for r in regions)})")
        n_out = result["out_tree"].num_leaves
        out = jax.tree.unflatten(result["out_tree"], outs[:n_out])
        pos = n_out
        for (col, path), tree, n in result["written"]:
            with handing(self.lifted.name):
                variable_api.write_at(self.outer, col, path, jax.tree.unflatten(tree, outs[pos:pos + n]))
            pos += n
        return out


def _names(f: Any) -> set[str]:
    """The stream names a filter spells out (``'dropout'``, ``('a', 'b')``)."""
    if isinstance(f, str):
        return {f}
    if isinstance(f, tuple):
        return set().union(*(_names(x) for x in f))
    return set()


@dataclasses.dataclass(frozen=True)
class Lift:
    """A transform lifted over stateful bodies; see the module docstring."""

    transform: Callable[..., Any]
    bodies: tuple[Callable[..., Any], ...]
    variables: tuple
    rngs: tuple
    name: str
    fix: str
    # Under Linen's convention: draw one key per stream at the module's path before the
    # body runs, and hand it in (Linen's nn.jit / nn.fold_rngs fork the module's rngs).
    fork: bool = False
    # Passes the bodies' pipelines add, after the enclosing ones.
    passes: tuple = ()
    create_outside: bool = False    # see lift()

    def _fork(self, outer: TraceContext, path: tuple[str, ...]) -> dict[str, Any]:
        linen = streams.linen_counts(outer.origin)
        if not self.fork or linen is None:
            return {}
        return {s: variable_api.draw_at(outer, s, path, ()) for s in sorted(outer.rng_streams)
                if s in linen.streams}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        outer = current(f"vj.{self.name}")
        bodies, path = self.bodies, outer.path_prefix
        if args and is_module(args[0]):
            module, args = args[0], args[1:]
            bodies = module._varjax_bodies(bodies)
            path = module.path
        extra: frozenset[Key] = frozenset()
        # A body run directly has no IR for passes to rewrite.
        direct = not (outer.passes or self.passes) and (
            not isinstance(outer.store, DictStore) or _jax.current_trace() is outer.top_trace)
        linen = streams.linen_counts(outer.origin)
        start = drawn = linen.snapshot() if linen is not None else {}   # drawn: CreateOutside
        with errors.call_site(_jax.python_user_frame_text()):
            while True:
                if linen is not None:
                    linen.restore(start)   # an attempt that retries has counted nothing
                call = _LiftedCall(self, outer, path, extra, direct, self._fork(outer, path))
                try:
                    return call.run(bodies, path, args, kwargs)
                except LiftRetry as retry:
                    if retry.key not in outer.variables or retry.key in extra:
                        raise          # outside an enclosing lift too: its retry
                    extra |= {retry.key}
                except DirectFallback:
                    if not direct:
                        raise          # from an enclosing direct body: its fallback
                    direct = False
                except CreateOutside as hoist:   # only a create_outside lift's bodies raise it
                    drawn = hoist.create(linen, start, drawn)


def lift(transform: Callable[..., Any], *bodies: Callable[..., Any],
         variables: Sequence[filters.Filter] = (True,), rngs: Sequence[filters.Filter] = (True,),
         name: str = "lift", fix: str | None = None, fork_rngs: bool = False,
         passes: Sequence[Any] | str = (), create_outside: bool = False) -> Lift:
    """Lift ``transform`` over ``bodies``: see the module docstring.

    ``variables`` and ``rngs`` are sequences of collection / stream filters, one per
    group; ``name`` appears in errors and in the IR (the ``jit`` equation's name);
    ``fix`` is the advice given when a body touches a collection no filter matches
    (``{collection}`` is replaced by its name).  ``fork_rngs``: under Linen's RNG
    convention the body gets keys drawn at the module's path before it runs, and folds in
    paths relative to it (Linen's ``nn.jit`` and ``nn.fold_rngs``).  ``passes``: passes
    (instances or pipeline strings) run on the bodies' IR, after any the enclosing program
    runs there (``init``/``apply``'s ``passes=``).  ``create_outside``: see ``CreateOutside``."""
    if not bodies:
        raise TypeError("vj.lift needs at least one body")
    fix = fix or (f"add '{{collection}}' to one of the variable filters of vj.{name}")
    return Lift(transform, tuple(bodies), tuple(filters.freeze(f) for f in variables),
                tuple(filters.freeze(f) for f in rngs), name, fix, fork_rngs,
                parse_entries(passes), create_outside)
