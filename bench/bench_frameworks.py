"""One model, four frameworks: pure JAX vs varjax.nn vs flax.linen vs flax.nnx.

For each model of ``models`` (the 12-block residual MLP and the 4-block pre-LN
transformer), written once in pure JAX over a flat parameter dict, once as a
Linen-style module class instantiated with ``varjax.nn`` and with ``flax.linen``,
and once in Flax NNX (``models.check_frameworks`` first checks that all four
compute the same function from the same parameters), five tables, each with
pure JAX as the baseline:

* ``make_jaxpr(init)``, cold: a new model class per repetition, so nothing is
  cached.  Target (varjax.nn): <= 1.5x.
* ``make_jaxpr(apply)``, cold and warm (a new model of an earlier model's class,
  same shapes: equal varjax modules share traces, so varjax stages its cached
  pure jaxpr as one call; Linen and NNX retrace every time).  Targets
  (varjax.nn): cold <= 1.5x, warm <= 0.3x.
* ``jax.jit(apply).lower(...).compile()``, a fresh function and model class per
  repetition: trace (+ varjax's pass pipeline) + lowering + XLA.  No target.
* steady-state jitted apply: the compiled function called ``n`` times per
  sample, ``block_until_ready`` on each result; per-call time.  Target
  (varjax.nn): "1.00 within noise", checked as <= 1.05x.
* eager apply, no jit: ``model.apply(variables, x)`` (varjax dispatches its
  cached jitted pure function; Linen and pure JAX run op by op), NNX calls the
  module.  Target (varjax.nn): <= 1.2x.

Each framework is a ``Built`` -- the things measured, as functions over the
same ``(key, x)`` / ``(variables, x)`` -- so one helper (``tables_for``) builds
every table of every model.  NNX has no ``init``/``apply``; its natural
equivalents are constructing the module and taking its state
(``nnx.split(Model(rngs=nnx.Rngs(key)))[1]``) and ``nnx.merge(graphdef, state)(x)``.
Every staged function is a new lambda: ``make_jaxpr`` / ``jit`` cache traces by
function object.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import flax.linen
import jax
from flax import nnx

import varjax.nn
from bench import models
from bench.harness import Case, Table, Timing, compare, count_eqns

REPS = 7
COMPILE_REPS = 5
SAMPLE_S = 0.1         # steady-state / eager: calls per sample so one sample takes about this
LIBS = {"varjax.nn": varjax.nn, "flax.linen": flax.linen}
INIT_TARGET = 1.5
COLD_TARGET = 1.5
WARM_TARGET = 0.3
STEADY_TARGET = 1.05   # "1.00 within noise"
EAGER_TARGET = 1.2
VARJAX = "varjax.nn"


@dataclasses.dataclass(frozen=True)
class Built:
    """One new model in one framework: ``init(key, x)`` creates the variables,
    ``apply(variables, x)`` is the functional forward pass (``variables`` are the
    pure-JAX parameters in this framework's layout), ``call(x)`` the eager one."""

    init: Callable[[jax.Array, jax.Array], Any]
    apply: Callable[[Any, jax.Array], jax.Array]
    variables: Any
    call: Callable[[jax.Array], jax.Array]
    again: Callable[[], Built]    # a new model of the same class: equal, for "warm"


def frameworks(spec: models.Spec, key: jax.Array, params: dict[str, jax.Array]
               ) -> dict[str, Callable[[], Built]]:
    """Row name -> a builder of a new (cold) model of ``spec`` in that framework."""
    variables = models.to_linen(params)
    pure_init, pure_apply = models.pure_init_of(spec.pure), models.pure_apply_of(spec.pure)

    def pure() -> Built:
        return Built(lambda k, x: pure_init(k, x), lambda p, x: pure_apply(p, x), params,
                     lambda x: pure_apply(params, x), pure)

    def module(nn: Any) -> Callable[[], Built]:
        def build(cls: Any = None) -> Built:
            cls = cls or spec.module(nn)
            model = cls()
            return Built(lambda k, x: model.init(k, x), lambda v, x: model.apply(v, x), variables,
                         lambda x: model.apply(variables, x), lambda: build(cls))
        return build

    def nnx_model(cls: Any = None) -> Built:
        cls = cls or spec.nnx()
        model = models.nnx_with(cls(rngs=nnx.Rngs(key)), params)
        graphdef, state = nnx.split(model)
        return Built(lambda k, x: nnx.split(cls(rngs=nnx.Rngs(k)))[1],
                     lambda s, x: nnx.merge(graphdef, s)(x), state, model, lambda: nnx_model(cls))

    return {"pure JAX": pure, **{name: module(nn) for name, nn in LIBS.items()}, "flax.nnx": nnx_model}


def run() -> list[Table]:
    return [table for spec in (models.MLP, models.TRANSFORMER) for table in tables_for(spec)]


def tables_for(spec: models.Spec) -> list[Table]:
    key, x = spec.inputs()
    params = models.check_frameworks(spec, key, x, libs=LIBS)
    builders = frameworks(spec, key, params)
    warm = {name: build() for name, build in builders.items()}

    def stage_init(b: Built) -> Any:
        return jax.make_jaxpr(lambda k, x: b.init(k, x))(key, x)

    def stage_apply(b: Built) -> Any:
        return jax.make_jaxpr(lambda v, x: b.apply(v, x))(b.variables, x)

    def compile_apply(b: Built) -> Any:
        return jax.jit(lambda v, x: b.apply(v, x)).lower(b.variables, x).compile()

    def cold(fn: Callable[[Built], Any], name: str) -> Case:
        return Case(fn, lambda: (builders[name](),))

    def hot(fn: Callable[[Built], Any], name: str) -> Case:
        return Case(fn, lambda: (warm[name].again(),))

    init = {name: cold(stage_init, name) for name in builders}
    apply = {"pure JAX": cold(stage_apply, "pure JAX")}
    for name in list(builders)[1:]:
        apply |= {f"{name}, cold": cold(stage_apply, name), f"{name}, warm": hot(stage_apply, name)}
    compiled = {name: compile_apply(b) for name, b in warm.items()}
    nnx_note = ("flax.nnx 'init' = make_jaxpr of constructing the model with nnx.Rngs(key) and "
                "returning nnx.split(model)[1], its State: NNX creates parameters from the sizes given "
                "to __init__, without the forward pass the other three run.")
    return [
        staged_table(f"make_jaxpr(init), cold: {spec.title}", init, {VARJAX: INIT_TARGET},
                     "cold = a new model class per repetition (nothing cached). " + nnx_note),
        staged_table(f"make_jaxpr(apply): {spec.title}", apply,
                     {f"{VARJAX}, cold": COLD_TARGET, f"{VARJAX}, warm": WARM_TARGET},
                     "cold = a new model class per repetition; warm = a new model of an earlier "
                     "model's class, same shapes (equal varjax modules share traces, so varjax stages "
                     "its cached pure jaxpr as one call equation; Linen and NNX trace again). flax.nnx "
                     "apply = nnx.merge(graphdef, state)(x). Pure JAX retraces every time: one row."),
        timed_table(f"jit(apply) lower + compile: {spec.title}",
                    compare({name: cold(compile_apply, name) for name in builders}, reps=COMPILE_REPS),
                    {}, "jax.jit(apply).lower(variables, x).compile() with a fresh function and a new "
                        "model class per repetition: trace (+ varjax's passes), lowering and XLA "
                        "compilation. The issue sets no target. HLO ops: instructions in the compiled "
                        "module (equal counts: the same program).",
                    {name: {"HLO ops": hlo_ops(c)} for name, c in compiled.items()}),
        per_call_table(f"Steady-state jitted apply: {spec.title}",
                       {name: lambda c=compiled[name], v=b.variables: c(v, x) for name, b in warm.items()},
                       {VARJAX: STEADY_TARGET},
                       "The compiled jax.jit(apply) called with the variables, block_until_ready on each "
                       f"result. Target: 1.00x within noise, checked as <= {STEADY_TARGET}x."),
        per_call_table(f"Eager apply (no jit): {spec.title}",
                       {name: lambda b=b: b.call(x) for name, b in warm.items()}, {VARJAX: EAGER_TARGET},
                       "model.apply(variables, x) outside jit, warm: varjax.nn dispatches its cached "
                       "jitted pure function; pure JAX and flax.linen run op by op; flax.nnx calls the "
                       "module, model(x). block_until_ready on each result."),
    ]


def hlo_ops(compiled: Any) -> int:
    """Instructions in a compiled module's HLO text (``%name = type op(...)`` lines)."""
    return sum(1 for line in compiled.as_text().splitlines() if " = " in line and "(" in line)


def staged_table(title: str, cases: dict[str, Case], targets: dict[str, float], note: str) -> Table:
    """A make_jaxpr table, with the equations each case stages."""
    def staged(case: Case) -> dict[str, str]:
        jaxpr = case.fn(*case.setup())
        return {"eqns staged (top / all)": f"{len(jaxpr.eqns)} / {count_eqns(jaxpr)}"}

    return timed_table(title, compare(cases, reps=REPS), targets, note,
                       {name: staged(case) for name, case in cases.items()})


def timed_table(title: str, timings: dict[str, Timing], targets: dict[str, float], note: str,
                cells: dict[str, dict[str, Any]] | None = None) -> Table:
    table = Table(title, baseline="pure JAX", value_label="median (ms)",
                  note=note + " Repetitions interleaved.")
    for name, timing in timings.items():
        table.add_timing(name, timing, (cells or {}).get(name), target=targets.get(name))
    return table


def per_call_table(title: str, calls: dict[str, Callable[[], Any]], targets: dict[str, float],
                   note: str) -> Table:
    """Per-call time of each ``calls`` function (the first is the baseline), ``n`` calls per
    sample, ``n`` chosen per function so that a sample takes about ``SAMPLE_S``."""
    def calls_per_sample(call: Callable[[], Any]) -> int:
        jax.block_until_ready(call())
        start = time.perf_counter()
        jax.block_until_ready(call())
        return max(1, round(SAMPLE_S / (time.perf_counter() - start)))

    def repeat(call: Callable[[], Any], n: int) -> Callable[[], None]:
        def calls_n() -> None:
            for _ in range(n):
                jax.block_until_ready(call())
        return calls_n

    n = {name: calls_per_sample(call) for name, call in calls.items()}
    timings = compare({name: Case(repeat(call, n[name])) for name, call in calls.items()}, reps=REPS)
    table = Table(title, baseline="pure JAX", value_label="median (µs / call)",
                  note=f"{note} Each sample times n calls (n: about {SAMPLE_S * 1e3:.0f} ms per sample); "
                       "repetitions interleaved.")
    for name, timing in timings.items():
        table.add(name, timing.median / n[name] * 1e6,
                  {"n": n[name], "min (µs / call)": timing.min / n[name] * 1e6, "reps": timing.reps},
                  target=targets.get(name))
    return table
