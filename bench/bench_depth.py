"""Depth sweep: tracing cost and memory of the residual MLP at 12, 48 and 192 blocks.

The cost of tracing a model should grow linearly with its depth and stay a small constant
factor above hand-written JAX at every depth.  A constant factor measured at one depth
could hide a cost that only shows at several hundred layers, so here the residual MLP of
``models`` (Dense -> LayerNorm -> relu -> Dense, plus the residual; same width, batch and
initializers) is built at each depth of ``DEPTHS``, in pure JAX, ``varjax.nn``,
``flax.linen`` and ``flax.nnx``.  ``models.check_frameworks`` first checks, at the smallest
depth, that the four compute the same function from the same parameters.

Tables:

* ``make_jaxpr(init)``, cold (a new model class per repetition, nothing cached).  The
  baseline is pure JAX creating the same parameters with the same initializers, one key
  split off per parameter, **without** running the model (the hand-written init a user
  would write); pure JAX creating them while running the forward pass (what Linen and
  varjax ``init`` do, as ``models.pure_init``) is a second reference row.  NNX constructs
  the model with ``nnx.Rngs(key)`` and returns ``nnx.split(model)[1]``.  Target
  (varjax.nn): <= 1.5x at every depth.
* ``make_jaxpr(apply)``, cold.  Pure JAX looks parameters up in a flat dict
  (``models.pure_apply_of``); NNX is ``nnx.merge(graphdef, state)(x)``.  Target
  (varjax.nn): <= 1.5x at every depth.
* Memory held after one cold ``make_jaxpr(apply)`` of the deepest MLP, from
  ``tracemalloc`` in this process: the bytes allocated during the trace that are still
  allocated once it has returned, its jaxpr has been dropped and ``gc.collect()`` has run;
  then again after the model (instance and classes) is deleted.  Every framework first
  traces a 2-block model, so one-time caches (JAX's, Flax's, varjax's) are not counted, and
  the model and its variables exist before tracing starts, so only what the trace itself
  keeps is counted.  Pure JAX is ``jax.jit(apply).trace(...)``: jit keeps its trace for
  the function's lifetime, as varjax keeps a model's traces for the model's (a bare
  ``make_jaxpr`` keeps nothing, and caches nothing either).  Targets (varjax.nn): held <= 2x
  pure JAX (floor 1 MB); after the model is gone, <= 1 MB or <= 2x pure JAX (floor 0.5 MB).

Each row's ratio is against the baseline at its own depth (or moment), so each varjax row
gets its own PASS/MISS.  Timings are medians of interleaved repetitions (fewer at the
deepest depth, where one cold trace takes seconds).  Cold-process ``init`` wall time of a
deep model is ``bench_init``'s.
"""
from __future__ import annotations

import functools
import gc
import tracemalloc
from collections.abc import Callable
from typing import Any

import flax.linen
import jax
import jax.numpy as jnp
from flax import nnx

import varjax.nn
from bench import models
from bench.harness import Case, Table, compare, count_eqns

DEPTHS = (12, 48, 192)
REPS = {12: 5, 48: 5, 192: 3}
WARM_DEPTH = 2
TIME_TARGET = 1.5
HELD_TARGET = 2.0
MB = 2 ** 20
HELD_FLOOR = 1 * MB
RELEASED_FLOOR = 0.5 * MB
LIBS = {"varjax.nn": varjax.nn, "flax.linen": flax.linen}
VARJAX = "varjax.nn"
PURE = "pure JAX"
PURE_NO_FORWARD = "pure JAX, no forward pass"
PURE_FORWARD = "pure JAX, with forward pass"

zeros, ones = jax.nn.initializers.zeros, jax.nn.initializers.ones
# The parameters of one block, in ``models.residual_mlp``'s order: name, initializer, shape.
BLOCK_PARAMS = (
    ("dense0/kernel", models.kernel_init, (models.WIDTH, models.WIDTH)),
    ("dense0/bias", zeros, (models.WIDTH,)),
    ("ln/scale", ones, (models.WIDTH,)),
    ("ln/bias", zeros, (models.WIDTH,)),
    ("dense1/kernel", models.kernel_init, (models.WIDTH, models.WIDTH)),
    ("dense1/bias", zeros, (models.WIDTH,)),
)


# -- the residual MLP at any depth (``models``' builders take ``depth``) ---------------------------

def residual_mlp(depth: int) -> Callable[[jax.Array, models.Param], jax.Array]:
    """``models.residual_mlp`` with ``depth`` blocks: the math over a parameter getter."""
    return functools.partial(models.residual_mlp, depth=depth)


def pure_create(depth: int) -> Callable[[jax.Array], dict[str, jax.Array]]:
    """``key -> params`` without a forward pass: every parameter of ``residual_mlp(depth)``
    from its initializer, one key split off per parameter."""
    def create(key: jax.Array) -> dict[str, jax.Array]:
        keys = iter(jax.random.split(key, depth * len(BLOCK_PARAMS)))
        return {f"blocks_{i}/{name}": init(next(keys), shape)
                for i in range(depth) for name, init, shape in BLOCK_PARAMS}
    return create


def spec(depth: int) -> models.Spec:
    return models.Spec(f"{depth}-block residual MLP", residual_mlp(depth),
                       lambda nn: models.module_mlp(nn, depth), lambda: models.nnx_mlp(depth),
                       (models.BATCH, models.WIDTH))


def check(key: jax.Array, x: jax.Array) -> None:
    """Fail loudly unless the four frameworks agree (``models.check_frameworks``) and the
    no-forward-pass init creates ``models.pure_init``'s parameter names and shapes."""
    depth = DEPTHS[0]
    models.check_frameworks(spec(depth), key, x, libs=LIBS)
    created = jax.eval_shape(pure_create(depth), key)
    by_forward = jax.eval_shape(models.pure_init_of(residual_mlp(depth)), key, x)
    if jax.tree.map(lambda a: (a.shape, a.dtype), created) != \
            jax.tree.map(lambda a: (a.shape, a.dtype), by_forward):
        raise AssertionError("pure_create and pure_init disagree on parameter names/shapes")


# -- a table whose ratios are per depth ---------------------------------------------------------

class GroupedTable(Table):
    """A ``harness.Table`` whose rows come in groups (a depth, a moment), each with its own
    baseline row: a row's ratio is its value over the baseline case's value in the same
    group, or over ``floor`` (per group) when that is larger."""

    def __init__(self, title: str, *, baseline: str, value_label: str, note: str = "",
                 floors: dict[str, float] | None = None):
        super().__init__(title, baseline=baseline, value_label=value_label, note=note)
        self.floors = floors or {}
        self.group_of: dict[str, str] = {}

    def row_name(self, case: str, group: str) -> str:
        """Register the row of ``case`` in ``group``; return its name."""
        name = f"{case}, {group}"
        self.group_of[name] = group
        return name

    def ratio(self, name: str) -> float:
        group = self.group_of[name]
        base = self._row(f"{self.baseline}, {group}").value
        return self._row(name).value / max(base, self.floors.get(group, 0.0))


# -- timing -------------------------------------------------------------------------------------

def stagers(depth: int, key: jax.Array, x: jax.Array) -> tuple[dict[str, Case], dict[str, Case]]:
    """``(init cases, apply cases)`` at ``depth``: each a ``make_jaxpr`` of a new function over
    a new model (a new class) built in the untimed setup."""
    model_spec = spec(depth)
    shapes = jax.eval_shape(models.pure_init_of(model_spec.pure), key, x)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    variables = models.to_linen(params)

    def staged(fn: Callable[..., Any], *args: Any) -> Any:
        return jax.make_jaxpr(lambda *a: fn(*a))(*args)

    def pure(fn: Callable[..., Callable[..., Any]], *args: Any) -> Case:
        return Case(lambda f: staged(f, *args), lambda: (fn(),))

    init = {
        PURE_NO_FORWARD: pure(lambda: pure_create(depth), key),
        PURE_FORWARD: pure(lambda: models.pure_init_of(residual_mlp(depth)), key, x),
    }
    apply = {PURE: pure(lambda: models.pure_apply_of(residual_mlp(depth)), params, x)}
    for name, nn in LIBS.items():
        new = lambda nn=nn: (models.module_mlp(nn, depth)(),)  # noqa: E731
        init[name] = Case(lambda m: staged(m.init, key, x), new)
        apply[name] = Case(lambda m: staged(m.apply, variables, x), new)

    def new_nnx() -> tuple[Any, Any]:
        return nnx.split(models.nnx_mlp(depth)(rngs=nnx.Rngs(key)))

    init["flax.nnx"] = Case(lambda cls: staged(lambda k: nnx.split(cls(rngs=nnx.Rngs(k)))[1], key),
                            lambda: (models.nnx_mlp(depth),))
    apply["flax.nnx"] = Case(lambda g, s: staged(lambda s, x: nnx.merge(g, s)(x), s, x), new_nnx)
    return init, apply


def sweep(init: GroupedTable, apply: GroupedTable, key: jax.Array, x: jax.Array) -> None:
    """Fill the two depth-sweep tables: per depth, every case's repetitions interleaved;
    the warm-up call per case also counts the equations it stages."""
    for depth in DEPTHS:
        group = f"{depth} blocks"
        for table, cases in zip((init, apply), stagers(depth, key, x)):
            eqns = {}
            for name, case in cases.items():
                jaxpr = case.fn(*case.setup())
                eqns[name] = {"eqns staged": count_eqns(jaxpr)}
                del jaxpr
            timings = compare(cases, reps=REPS[depth], warmup=0)
            for name, timing in timings.items():
                table.add_timing(table.row_name(name, group), timing, eqns[name],
                                 target=TIME_TARGET if name == VARJAX else None)


# -- memory -------------------------------------------------------------------------------------

def apply_tracer(framework: str, depth: int, key: jax.Array, x: jax.Array
                 ) -> tuple[dict[str, Any], Callable[[dict[str, Any]], Any]]:
    """``(holder, trace)``: ``holder['model']`` is a new model of ``framework`` at ``depth``
    (pure JAX: its apply function), ``trace(holder)`` returns ``make_jaxpr`` of its apply."""
    shapes = jax.eval_shape(models.pure_init_of(residual_mlp(depth)), key, x)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    if framework == PURE:
        # jax.jit keeps its trace for the function's lifetime, as varjax keeps a model's for
        # the model's: the like-for-like baseline of a cache (make_jaxpr alone keeps nothing).
        holder = {"model": jax.jit(models.pure_apply_of(residual_mlp(depth))), "variables": params}
        return holder, lambda h: h["model"].trace(h["variables"], x)
    holder = {"model": models.module_mlp(LIBS[framework], depth)(), "variables": models.to_linen(params)}
    return holder, lambda h: jax.make_jaxpr(lambda v, x: h["model"].apply(v, x))(h["variables"], x)


def held_bytes(framework: str, depth: int, key: jax.Array, x: jax.Array) -> tuple[int, int]:
    """``(held after the trace, held after the model is deleted)``, in bytes allocated while
    tracing (``tracemalloc``), each after ``gc.collect()``."""
    holder, trace = apply_tracer(framework, depth, key, x)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        jaxpr = trace(holder)
        del jaxpr
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
        del holder["model"]            # the instance; its classes were only referenced by it
        gc.collect()
        released = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return held, released


def memory_table(key: jax.Array, x: jax.Array) -> Table:
    depth = max(DEPTHS)
    frameworks = (PURE, *LIBS)
    for framework in frameworks:           # one-time caches: JAX's, Flax's, varjax's
        holder, trace = apply_tracer(framework, WARM_DEPTH, key, x)
        trace(holder)
    after, gone = "after the trace", "model deleted"
    table = GroupedTable(
        f"Memory held after one cold make_jaxpr(apply): {depth}-block residual MLP",
        baseline=PURE, value_label="held (MB)", floors={after: HELD_FLOOR / MB, gone: RELEASED_FLOOR / MB},
        note=f"tracemalloc in the benchmark process, after a {WARM_DEPTH}-block warm-up per framework: "
             "bytes allocated during the trace still allocated once the jaxpr is dropped and "
             "gc.collect() has run ('after the trace'), then after the model (instance and classes; "
             "pure JAX: its jitted apply function, whose jax.jit(...).trace is the baseline: jit keeps "
             "its trace for the function's lifetime) is deleted ('model deleted'). Ratios against pure JAX "
             f"floored at {HELD_FLOOR / MB:g} MB after the trace and {RELEASED_FLOOR / MB:g} MB once "
             f"the model is deleted, so the {VARJAX} target is held <= {HELD_TARGET:g}x pure JAX (at least "
             f"{HELD_TARGET * HELD_FLOOR / MB:g} MB) and released to <= 1 MB or <= {HELD_TARGET:g}x pure.")
    results = {framework: held_bytes(framework, depth, key, x) for framework in frameworks}
    for group, index in ((after, 0), (gone, 1)):
        for framework in frameworks:
            table.add(table.row_name(framework, group), results[framework][index] / MB,
                      target=HELD_TARGET if framework == VARJAX else None)
    return table


# -- the suite ----------------------------------------------------------------------------------

def run() -> list[Table]:
    key, x = models.inputs()
    check(key, x)
    tables = [memory_table(key, x)]       # first: nothing left over from the timing runs
    cold = ("cold = a new model class (pure JAX: a new function) per repetition. Repetitions "
            "interleaved per depth: " + ", ".join(f"{d} blocks x{REPS[d]}" for d in DEPTHS)
            + "; median. Ratios against the baseline at the same depth. 'eqns staged': equations "
            "in the jaxpr, nested ones included.")
    init = GroupedTable(
        f"Depth sweep, make_jaxpr(init), cold: residual MLP (width {models.WIDTH}, batch {models.BATCH})",
        baseline=PURE_NO_FORWARD, value_label="median (ms)",
        note=f"{cold} '{PURE_NO_FORWARD}': the same parameters from the same initializers, one key "
             f"split off per parameter, without running the model; '{PURE_FORWARD}': created while "
             "running it (as Linen and varjax init do), shown for reference. flax.nnx: constructing "
             "the model with nnx.Rngs(key), returning nnx.split(model)[1].")
    apply = GroupedTable(
        f"Depth sweep, make_jaxpr(apply), cold: residual MLP (width {models.WIDTH}, batch {models.BATCH})",
        baseline=PURE, value_label="median (ms)",
        note=f"{cold} Pure JAX looks parameters up in a flat dict; flax.nnx: "
             "nnx.merge(graphdef, state)(x).")
    # gc.collect() before every timed call would walk everything JAX and Flax have allocated
    # so far; frozen, those objects are out of its sight (new ones are still collected).
    gc.collect()
    gc.freeze()
    try:
        sweep(init, apply, key, x)
    finally:
        gc.unfreeze()
    return [init, apply, *tables]
