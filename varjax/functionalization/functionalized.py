"""``vj.functionalize``: a stateful function as ``init`` / ``apply`` over variable dicts.

``apply(variables, *args, rngs=, mutable=)`` does, on a cache miss:

1. split the arguments: arrays are traced, everything else is static;
2. trace the function with a ``TraceContext`` that knows the given
   variables' types, the mutable collections and the RNG streams, giving the
   *effectful* jaxpr (``.jaxpr(...)`` returns it);
3. run the pass pipeline (``check-mutability, lower-rng, forward-stores,
   dead-reads, shard-variables, discharge`` plus any user passes), giving a pure jaxpr
   (``.functional_jaxpr(...)``) and the discharge ``Signature``;
4. make it callable: ``jax.jit`` of the pure jaxpr when called eagerly, or
   the pure jaxpr bound directly as one ``jit`` equation under a trace.

An eager ``apply`` goes through one ``jax.jit`` per argument structure whose body is
the steps above under a trace (``_dispatch``): a repeated call is JAX's C++ dispatch, with
no Python cache key.  An eager ``init`` runs once: rather than compile every initializer of
every layer, it evaluates the pure jaxpr op by op from JAX's per-operation cache, as
Linen's does (``jax.jit(init)`` is still one program).

The cache key is everything the trace depended on: argument structure,
avals and static values; the given variables' paths and types; the mutable
filter; the RNG stream names and key types; whether this is ``init``.  On a
hit nothing is traced and no pass runs.  Tracing and compiling are cached
separately, so ``.jaxpr()`` never runs a pass.  A compiled entry keeps only the pure
jaxpr: a top-level function lets the effectful trace go once the pipeline has run (a
model alive holds one jaxpr, not two), so ``.jaxpr()`` after a call of the same types
traces again.

``init(rngs, *args)`` is ``apply({}, *args, rngs=rngs, mutable=True)[1]``
(with ``is_initializing()`` true) and produces bitwise the same variables in every
collection but ``rngs``: RNG state comes back as it was given (fresh), not advanced
by init's forward pass.

Sharp edges:
  * A static argument must be hashable; an unhashable non-array argument
    raises ``TypeError`` naming its position.
  * Variable leaves keep their dtype exactly; weak types are dropped when a
    value is stored.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from varjax import _jax
from varjax.functionalization import updates
from varjax.functionalization.entries import Traced, _Effectful, _Key
from varjax.functionalization.outputs import StaticOutputs
from varjax.ir import axis_metadata, errors, filters, streams
from varjax.ir.caches import LRU
from varjax.ir.primitives import Key, VarType
from varjax.ir.statics import typed
from varjax.ir.typing import CollectionFilter, PRNGKey, PyTree, VariableDict
from varjax.passes import Pass, PassContext, Pipeline
from varjax.passes.framework.pipeline import parse_entries
from varjax.trace.context import TraceContext, activate, current
from varjax.trace.pass_scopes import PassScopes
from varjax.trace.rngs import Rngs
from varjax.trace.variable_dicts import SCALAR, flatten_variables, unflatten_variables

DEFAULT_PASSES = ("check-mutability", "lower-rng", "forward-stores", "dead-reads", "shard-variables",
                  "discharge")
# Verification after every pass costs about as much as tracing the model; it is on in
# the test suite and whenever this is set, like a debug build's verifier.
VERIFY_ENV = "VARJAX_VERIFY"

_CONCRETIZATION_HINT = (
    "varjax: the function is traced once per argument shape/dtype, so Python control flow "
    "cannot depend on array values. Pass the value as a Python scalar (non-array arguments "
    "are static) or use jax.lax.cond / jax.lax.while_loop, which varjax discharges.")


# --- arguments ---------------------------------------------------------------------------

def _is_traced(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _split_args(args: tuple, kwargs: dict):
    leaves, tree = jax.tree.flatten((args, kwargs))
    traced, static = [], []
    for i, leaf in enumerate(leaves):
        if _is_traced(leaf):
            traced.append(leaf)
        else:
            try:
                hash(leaf)
            except TypeError:
                raise TypeError(f"argument leaf {i} ({type(leaf).__name__}) is neither an array "
                                "nor hashable, so it can be neither traced nor static") from None
            static.append((i, leaf))
    return tree, traced, tuple(static)


def normalize_rngs(rngs: Any) -> dict[str, Any]:
    """Explicit keys: a key (the ``params`` stream) or a dict of stream name -> key (typed or
    raw).  Anything else raises here, naming it: JAX would reject it later without saying so."""
    named = isinstance(rngs, Mapping)
    keys = dict(rngs) if named else {} if rngs is None else {streams.PARAMS: rngs}
    for stream, key in keys.items():
        dtype = key.dtype if _is_traced(key) else np.dtype(object)
        if not (dtype == np.uint32 or jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)):
            got = f"an array of dtype {key.dtype}" if _is_traced(key) else \
                f"of type {type(key).__name__} ({' '.join(repr(key).split())[:40]})"
            raise errors.InvalidVariablesError(
                f"{f'rngs[{stream!r}]' if named else 'rngs'} is {got}; rngs may be a key, a dict "
                "of stream name to key, or a vj.Rngs.", collection=streams.STATE,
                path=(str(stream),) if named else None, **errors.where(),
                fix="pass rngs=jax.random.key(0), rngs={'dropout': key}, or rngs=vj.Rngs(0, dropout=1)")
    return keys


def _inputs(variables: Mapping[str, Any] | None, rngs: Any, mutable: Any):
    """What a call runs with: flat variables, explicit keys and the mutable filter.

    A ``vj.Rngs`` is the call's RNG state: its streams replace the ``rngs`` collection of
    ``variables`` and are mutable whatever ``mutable`` says (the caller handed them in to be
    drawn from); ``_apply`` advances the ``Rngs`` afterwards."""
    flat = flatten_variables(variables or {})
    if not isinstance(rngs, Rngs):
        return flat, normalize_rngs(rngs), mutable
    flat = {k: v for k, v in flat.items() if k[0] != streams.STATE}
    for stream, (key, count) in rngs._varjax_rng_state().items():
        flat[streams.key_variable(stream)] = (SCALAR, [key])
        flat[streams.count_variable(stream)] = (SCALAR, [count])
    return flat, {}, mutable if mutable is True else [mutable, streams.STATE]


def function_name(fn: Callable[..., Any]) -> str:
    """The name traces, dumps and errors give ``fn``: a ``functools.partial``'s is the
    function's it wraps, a callable object's its class's (neither has a ``__name__``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


class Functionalized:
    """A stateful function with Flax Linen's ``init`` / ``apply`` interface."""

    def __init__(self, fn: Callable[..., Any], *, passes: Sequence[str | Pass] | str = (),
                 dump_dir: str | None = None, verify: bool | None = None,
                 context: Callable[["_Key"], TraceContext] | None = None,
                 inline: bool = False):
        functools.update_wrapper(self, fn)
        if not hasattr(self, "__name__"):     # a functools.partial or a callable object
            self.__name__ = self.__qualname__ = function_name(fn)
        self.fn = fn
        # Builds the TraceContext a trace runs under; a lifted region (varjax.lifting.region)
        # supplies one that sees the enclosing trace's modules and lifting filters.
        self.context = context or _fresh_context
        # Under a trace, bind the pure jaxpr's equations inline instead of one jit equation:
        # for lifted regions, whose transform stages them anyway (a jit per region would be
        # re-batched by every enclosing vmap).
        self.inline = inline
        # The passes added to the defaults; lifted bodies traced inside run them too.
        self.passes = parse_entries(passes)
        if verify is None:
            verify = os.environ.get(VERIFY_ENV, "") not in ("", "0")
        self.pipeline = Pipeline([*DEFAULT_PASSES, *self.passes], verify=verify, dump_dir=dump_dir)
        # Bounded, and released by jax.clear_caches() (see varjax.ir.caches).
        self._traces: LRU = LRU()   # _Key -> _Effectful
        self._cache: LRU = LRU()    # _Key -> Traced
        self._eager: LRU = LRU()    # argument structure -> jax.jit (see _dispatch)
        self.trace_count = 0
        # Non-array outputs ride in the output structure and come back from init/apply
        # (varjax.functionalization.outputs): Linen's apply returns whatever the method returns.
        self.static_outputs = StaticOutputs()

    @errors.api_boundary
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Inside another functionalized function, just run the code (same variables)."""
        current(f"{self.__name__}()")
        return self.fn(*args, **kwargs)

    # -- public API -----------------------------------------------------------------
    @errors.api_boundary
    def init(self, rngs: PRNGKey | Mapping[str, PRNGKey] | Rngs | None, *args: Any,
             mutable: CollectionFilter = True, **kwargs: Any) -> VariableDict:
        """Create every variable: ``apply({}, *args, rngs=rngs, mutable=True)[1]``.

        ``mutable`` narrows which collections are returned (Module.init keeps Linen's
        default of everything but ``intermediates``)."""
        return self._apply({}, args, kwargs, rngs, mutable, initializing=True)[1]

    @errors.api_boundary
    def init_with_output(self, rngs: PRNGKey | Mapping[str, PRNGKey] | Rngs | None, *args: Any,
                         mutable: CollectionFilter = True, **kwargs: Any) -> tuple[PyTree, VariableDict]:
        return self._apply({}, args, kwargs, rngs, mutable, initializing=True)

    @errors.api_boundary
    def apply(self, variables: VariableDict, *args: Any,
              rngs: PRNGKey | Mapping[str, PRNGKey] | Rngs | None = None,
              mutable: CollectionFilter = False, **kwargs: Any) -> PyTree | tuple[PyTree, VariableDict]:
        """Run with ``variables``; returns ``out``, or ``(out, updated)`` if anything is mutable."""
        out, updated = self._apply(variables, args, kwargs, rngs, mutable, initializing=False)
        return (out, updated) if mutable is not False else out

    @errors.api_boundary
    def jaxpr(self, *args: Any, variables: VariableDict | None = None,
              rngs: PRNGKey | Mapping[str, PRNGKey] | Rngs | None = None,
              mutable: CollectionFilter = False, **kwargs: Any) -> _jax.ClosedJaxpr:
        """The effectful jaxpr, as traced; no pass runs, so this works even when one fails."""
        return self._effectful(self._inspected(variables, args, kwargs, rngs, mutable)).jaxpr

    @errors.api_boundary
    def functional_jaxpr(self, *args: Any, variables: VariableDict | None = None,
                         rngs: PRNGKey | Mapping[str, PRNGKey] | Rngs | None = None,
                         mutable: CollectionFilter = False, **kwargs: Any) -> _jax.ClosedJaxpr:
        """The pure jaxpr after the pass pipeline: ``(var inputs, args) -> (outs, var outputs)``."""
        return self.traced(*args, variables=variables, rngs=rngs, mutable=mutable, **kwargs).pure

    @errors.api_boundary
    def traced(self, *args: Any, variables: VariableDict | None = None,
               rngs: PRNGKey | Mapping[str, PRNGKey] | Rngs | None = None,
               mutable: CollectionFilter = False, **kwargs: Any) -> Traced:
        """The whole cache entry (jaxprs, signature, pass statistics) for these arguments."""
        return self._compiled(self._inspected(variables, args, kwargs, rngs, mutable))

    # -- hooks of the layers above (lifting.region, objects.run), not vj.functionalize's API --
    def _effectful_jaxpr(self, flat_vars: Mapping[Key, tuple[Any, list[Any]]], args: tuple,
                         kwargs: dict, rngs: Any, mutable: Any,
                         initializing: bool) -> _jax.ClosedJaxpr:
        """The effectful jaxpr for flat variables (as ``_call`` takes them); traced once."""
        key, _, _, _ = self._key(flat_vars, args, kwargs, rngs, mutable, initializing)
        return self._effectful(key).jaxpr

    def _effectful_traces(self) -> list[_Effectful]:
        """The cached effectful traces (a lifted body keeps them: see ``Traced``)."""
        return list(self._traces.values())

    def _adopt(self, like: _Effectful, jaxpr: _jax.ClosedJaxpr, linen_end: dict) -> None:
        """Cache ``jaxpr`` as the trace for ``like``'s key, as if traced here: a lifted
        body that another body's trace gives without running its Python again
        (``lifting.body.with_counts_moved``)."""
        self._traces[like.key] = _Effectful(jaxpr, like.out_tree, like.context, like.key, linen_end)

    # -- machinery ------------------------------------------------------------------
    def _inspected(self, variables, args, kwargs, rngs, mutable) -> "_Key":
        """The cache key of a non-init call, for the inspection entry points."""
        flat, keys, mutable = _inputs(variables, rngs, mutable)
        return self._key(flat, args, kwargs, keys, mutable, False)[0]

    def _key(self, flat_vars, args, kwargs, rngs, mutable, initializing):
        """The cache key: everything a trace depends on (see the module docstring)."""
        rngs = normalize_rngs(rngs)
        tree, traced, static = _split_args(args, kwargs)
        var_types = tuple(sorted((k, VarType.of_leaves(t, ls)) for k, (t, ls) in flat_vars.items()))
        rng_avals = tuple(sorted((s, _jax.get_aval(k)) for s, k in rngs.items()))
        key = _Key(tree, tuple((i, typed(v)) for i, v in static),
                   tuple(_jax.get_aval(x) for x in traced), var_types,
                   filters.freeze(mutable), rng_avals, initializing,
                   (jax.sharding.get_abstract_mesh(), typed(axis_metadata.get_logical_axis_rules())),
                   static)
        return key, flat_vars, rngs, traced

    def _effectful(self, key: "_Key") -> _Effectful:
        found = self._traces.get(key)
        if found is None:
            with errors.call_site(_jax.python_user_frame_text()):
                found = self._traces[key] = self._trace(key)
        return found

    def _compiled(self, key: "_Key") -> Traced:
        found = self._cache.get(key)
        if found is None:
            with errors.call_site(_jax.python_user_frame_text()):
                found = self._cache[key] = self._compile(self._effectful(key))
            if not self.inline:
                self._traces.pop(key)   # the pure jaxpr runs from now on (module docstring)
        return found

    def _trace(self, key: "_Key") -> _Effectful:
        self.trace_count += 1
        ctx = self.context(key)
        ctx.use_passes(self.passes)
        static = dict(key.static_values)
        positions = [i for i in range(key.tree.num_leaves) if i not in static]
        out_tree_box: list[Any] = []

        def flat_fn(*arrays):
            ctx.top_trace = _jax.current_trace()
            full = [static.get(i) for i in range(key.tree.num_leaves)]
            for i, a in zip(positions, arrays):
                full[i] = a
            args, kwargs = jax.tree.unflatten(key.tree, full)
            out_leaves, out_tree = jax.tree.flatten(self.static_outputs.hide(self.fn(*args, **kwargs)))
            out_tree_box.append(out_tree)
            return out_leaves

        with activate(ctx):
            try:
                jaxpr = _jax.trace_to_jaxpr(flat_fn, list(key.avals), name=self.__name__)
            except jax.errors.ConcretizationTypeError as e:
                e.add_note(_CONCRETIZATION_HINT)
                raise
        return _Effectful(jaxpr, out_tree_box[-1], ctx, key)

    @errors.api_boundary
    def run_pipeline(self, *args: Any, variables: VariableDict | None = None,
                     rngs: PRNGKey | Mapping[str, PRNGKey] | Rngs | None = None,
                     mutable: CollectionFilter = False, pipeline: Pipeline | None = None,
                     **kwargs: Any) -> tuple[_jax.ClosedJaxpr, PassContext]:
        """Run ``pipeline`` (default: this function's) on the effectful trace, uncached:
        for tools that watch the passes (``vj.dump``).  Returns the result and the context."""
        key = self._inspected(variables, args, kwargs, rngs, mutable)
        return self._run_pipeline(self._effectful(key), pipeline or self.pipeline)

    def _run_pipeline(self, traced: _Effectful, pipeline: Pipeline) -> tuple[_jax.ClosedJaxpr, PassContext]:
        key = traced.key
        # Passes may trace user code late (custom_jvp/vjp rules): under a snapshot of this
        # trace's context, as at the rule's call site.
        context = traced.context    # not ``traced``: the result may keep this closure alive
        pctx = PassContext.for_inputs(dict(key.variables), key.mutable, dict(key.rngs),
                                      reenter=lambda types: activate(context.snapshot(types)))
        pctx.modules = PassScopes(traced.context, traced.linen_end)   # passes' variables
        pctx.region = self.inline                   # a lifted transform's body
        pctx.asked = frozenset(traced.context.origin.asked)
        return pipeline.run(traced.jaxpr, pctx, label=self.__name__), pctx

    def _compile(self, traced: _Effectful) -> Traced:
        pure, pctx = self._run_pipeline(traced, self.pipeline)
        name = self.__name__

        def run_pure(*flat):
            return _jax.eval_jaxpr(pure.jaxpr, pure.consts, *flat)
        run_pure.__name__ = run_pure.__qualname__ = name
        eager_init = traced.key.initializing
        jitted: list[Callable] = []

        def run_eagerly(*flat):
            # init op by op (see the module docstring); else one jax.jit, made on the
            # first eager call: most entries only ever run under a trace
            if eager_init:
                return run_pure(*flat)
            if not jitted:
                jitted.append(jax.jit(run_pure))
            return jitted[0](*flat)
        staged: Callable = run_pure
        if not self.inline:
            # One jit equation of the cached jaxpr, bound directly (jax.jit would re-trace
            # it once); constants (tracers, when the function closes over the enclosing
            # trace) become inputs.
            opened, consts = _jax.open_consts(pure)
            staged = functools.partial(_jax.jit_call(opened, name), *consts)

        def call(*flat):
            return run_eagerly(*flat) if _jax.is_top_level() else staged(*flat)
        return Traced(traced.jaxpr if self.inline else None, pure, pctx.results["signature"],
                      traced.out_tree, call, dict(pctx.stats))

    def _apply(self, variables, args, kwargs, rngs, mutable, *, initializing: bool):
        out, updated = self._run(variables, args, kwargs, rngs, mutable, initializing)
        return self.static_outputs.reveal(out), updated

    def _run(self, variables, args, kwargs, rngs, mutable, initializing):
        held = isinstance(rngs, Rngs)
        if _jax.is_top_level() and not held and not initializing:
            found = self._dispatch(variables, args, kwargs, rngs, mutable)
            if found is not None:
                return found
        flat_vars, keys, run_mutable = _inputs(variables, rngs, mutable)
        out, written = self._call(flat_vars, args, kwargs, keys, run_mutable, initializing)[:2]
        if held:
            rngs._varjax_advance({s: written[streams.count_variable(s)]
                                  for s in rngs._varjax_rng_state()
                                  if streams.count_variable(s) in written})
        if mutable is False:
            return out, None
        given = {k: jax.tree.unflatten(t, ls) for k, (t, ls) in flat_vars.items()}
        return out, unflatten_variables(updates.merged(given, written, mutable,
                                                       initializing=initializing, held=held))

    def _dispatch(self, variables, args, kwargs, rngs, mutable):
        """An eager ``apply`` as one ``jax.jit`` per argument structure, whose body is the
        traced call (``_call`` under a trace stages the cached pure jaxpr) and the merge of
        what it wrote into the mutable collections (``updates``): ``(out, updated)``.  A
        repeated call is then JAX's C++ dispatch, which checks the avals, instead of a Python
        cache key (a ``VarType`` per variable: on a small train step, as costly as the step).
        None when a static argument is unhashable (``_call`` then says which)."""
        leaves, tree = jax.tree.flatten((args, kwargs))
        statics = {i: x for i, x in enumerate(leaves) if not _is_traced(x)}
        try:
            key = (tree, tuple((i, typed(x)) for i, x in statics.items()), filters.freeze(mutable))
            fn = self._eager.get(key)
        except TypeError:
            return None
        if fn is None:
            def run(variables, rngs, arrays):
                given = iter(arrays)
                full = [statics[i] if i in statics else next(given) for i in range(len(leaves))]
                a, k = jax.tree.unflatten(tree, full)
                flat_vars, keys, _ = _inputs(variables, rngs, mutable)
                out, written = self._call(flat_vars, a, k, keys, mutable, False)[:2]
                if mutable is False:
                    return out, None, {}
                entries = updates.merged(dict.fromkeys(flat_vars), written, mutable)
                return out, unflatten_variables(entries), updates.holes(entries)
            run.__name__ = run.__qualname__ = self.__name__
            fn = self._eager[key] = jax.jit(run)
        try:
            out, updated, holes = fn(variables, rngs, [x for x in leaves if _is_traced(x)])
        except TypeError:
            # JAX rejects a leaf it cannot take (a string) without naming the variable.
            flatten_variables(variables)
            normalize_rngs(rngs)
            raise
        return out, updates.fill_holes(updated, holes, variables)

    def _call(self, flat_vars: Mapping[Key, tuple[Any, list[Any]]], args: tuple, kwargs: dict,
             rngs: Any, mutable: Any, initializing: bool) -> tuple[Any, dict[Key, Any], Traced]:
        """The one way a traced function runs: ``flat_vars`` as from ``flatten_variables``;
        returns the output, every variable the function wrote (by key) and the cache entry."""
        key, _, rngs, traced = self._key(flat_vars, args, kwargs, rngs, mutable, initializing)
        entry = self._compiled(key)
        inputs: list[Any] = []
        for (col, path), _ in entry.signature.inputs:
            inputs.extend([rngs[path[0]]] if col == streams.KEYS else flat_vars[(col, path)][1])
        outs = entry.call(*inputs, *traced)
        n_main = entry.out_tree.num_leaves
        out = jax.tree.unflatten(entry.out_tree, outs[:n_main])
        written, pos = {}, n_main
        for (col, path), vt in entry.signature.outputs:
            n = len(vt.avals)
            if col != streams.KEYS:
                written[(col, path)] = jax.tree.unflatten(vt.tree, outs[pos:pos + n])
            pos += n
        return out, written, entry


def _fresh_context(key: _Key) -> TraceContext:
    """A top-level trace draws from the given keys and from the streams kept as state in the
    given variables; a key given for a stream overrides its state."""
    variables = dict(key.variables)
    rngs = {s: vt.avals[0] for s, vt in streams.implicit_streams(variables).items()}
    rngs.update(key.rngs)
    ctx = TraceContext(variables, key.mutable, rngs, key.initializing)
    # Keys given explicitly follow Linen's calling convention, so Linen's derivation.
    streams.start_linen(ctx, dict(key.rngs))
    return ctx


@errors.api_boundary
def functionalize(fn: Callable[..., Any] | None = None, *, passes: Sequence[str | Pass] | str = (),
                  dump_dir: str | None = None, verify: bool | None = None
                  ) -> Functionalized | Callable[[Callable[..., Any]], Functionalized]:
    """A function using ``vj.param``/``variable``/``make_rng``/``sow``, given Linen's ``init``
    (``f.init({"params": key}, x)``: its variables) and ``apply`` (``f.apply(variables, x)``).
    ``passes`` run after the defaults (``"cast-params{dtype=bfloat16}"``); ``dump_dir`` gets
    the IR after each pass; ``verify`` (or env ``VARJAX_VERIFY``, set in tests) checks it."""
    if fn is None:
        return lambda f: Functionalized(f, passes=passes, dump_dir=dump_dir, verify=verify)
    return Functionalized(fn, passes=passes, dump_dir=dump_dir, verify=verify)
