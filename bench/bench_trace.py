"""Staging cost: ``jax.make_jaxpr`` of the residual MLP, varjax vs pure JAX.

Staging (tracing to a jaxpr) is what a user waits for before ``jit`` compiles,
and what varjax adds work to: its own trace plus the pass pipeline.  Measured:

* **apply, cold**: a new ``vj.functionalize`` object every repetition, so its
  cache is empty and ``apply`` traces and runs the whole pipeline.  Target:
  at most 1.5x pure JAX's ``make_jaxpr`` of the same model.
* **apply, warm**: the same object and shapes again, so ``apply`` stages the
  cached pure jaxpr as one call equation, with no trace and no pipeline.
  Target: at most 0.3x pure JAX, which traces every block every time.
* **init, cold**: ``make_jaxpr`` of ``init`` against a pure-JAX init that also
  runs the model (see ``models``).  Reported; the issue sets no target.

Every baseline gets a new function object per repetition too, although
``make_jaxpr`` never caches its top-level trace.
"""
from __future__ import annotations

from typing import Any

import jax

from bench import models
from bench.harness import Case, Table, compare, count_eqns

REPS = 7
COLD_TARGET = 1.5
WARM_TARGET = 0.3


def run() -> list[Table]:
    key, x = models.inputs()
    params = models.check_same_model(key, x)
    variables = {"params": params}

    def stage_pure_apply() -> Any:
        return jax.make_jaxpr(lambda p, x: models.pure_apply(p, x))(params, x)

    def stage_apply(model: Any) -> Any:
        return jax.make_jaxpr(lambda v, x: model.apply(v, x))(variables, x)

    def stage_pure_init() -> Any:
        return jax.make_jaxpr(lambda k, x: models.pure_init(k, x))(key, x)

    def stage_init(model: Any) -> Any:
        return jax.make_jaxpr(lambda k, x: model.init(k, x))(key, x)

    def fresh():
        return (models.varjax_mlp(),)

    warm = models.varjax_mlp()
    stage_apply(warm)  # the cache miss that fills `warm`'s cache
    apply_cases = {
        "pure JAX": Case(stage_pure_apply),
        "varjax, cold": Case(stage_apply, fresh),
        "varjax, warm": Case(lambda: stage_apply(warm)),
    }
    init_cases = {
        "pure JAX": Case(stage_pure_init),
        "varjax, cold": Case(stage_init, fresh),
    }
    targets = {"varjax, cold": COLD_TARGET, "varjax, warm": WARM_TARGET}

    apply = Table(
        f"make_jaxpr of apply: {models.DEPTH}-block residual MLP "
        f"(width {models.WIDTH}, batch {models.BATCH})",
        baseline="pure JAX", value_label="median (ms)",
        note="cold = new vj.functionalize object per repetition (trace + pass pipeline); "
             "warm = same object, cache hit. Repetitions interleaved.")
    for name, timing in compare(apply_cases, reps=REPS).items():
        apply.add_timing(name, timing, _staged(apply_cases[name]), target=targets.get(name))

    init = Table(
        "make_jaxpr of init: same model", baseline="pure JAX", value_label="median (ms)",
        note="Both inits run the forward pass to create parameters; varjax cold as above.")
    for name, timing in compare(init_cases, reps=REPS).items():
        init.add_timing(name, timing, _staged(init_cases[name]))
    return [apply, init]


def _staged(case: Case) -> dict[str, str]:
    """What the case staged: top-level equations / all, counting sub-jaxprs."""
    jaxpr = case.fn(*case.setup())
    return {"eqns staged (top / all)": f"{len(jaxpr.eqns)} / {count_eqns(jaxpr)}"}
