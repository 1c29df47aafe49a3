"""Staging cost of the residual MLP as a module: varjax.nn vs Flax Linen vs pure JAX.

The model class is written once (``models.module_mlp``) and instantiated with
``varjax.nn`` and with ``flax.linen``.  "Cold" repetitions build a new model
class, so nothing is cached (equal varjax modules share their traces, so a new
object of the same class would be a cache hit, reported as its own row): the
time includes tracing, the pass pipeline and the module machinery.  Targets: ``make_jaxpr(init)`` and
``make_jaxpr(apply)`` at most 1.5x pure JAX (``models.pure_init`` /
``models.pure_apply``, which trace the same computation over a flat dict).
Every case stages a new lambda: ``make_jaxpr`` caches traces by function object.
"""
from __future__ import annotations

from typing import Any

import flax.linen
import jax
import numpy as np

import varjax.nn
from bench import models
from bench.harness import Case, Table, compare

REPS = 7
TARGET = 1.5


def run() -> list[Table]:
    key, x = models.inputs()
    params = models.pure_init(key, x)
    vj_model, flax_model = models.module_mlp(varjax.nn), models.module_mlp(flax.linen)
    variables = flax_model().init(key, x)
    np.testing.assert_allclose(vj_model().apply(variables, x), flax_model().apply(variables, x),
                               rtol=1e-5, atol=1e-5)

    def init_of(make: Any) -> Case:
        return Case(lambda m: jax.make_jaxpr(lambda k, x: m.init(k, x))(key, x), lambda: (make(),))

    def apply_of(make: Any) -> Case:
        return Case(lambda m: jax.make_jaxpr(lambda v, x: m.apply(v, x))(variables, x),
                    lambda: (make(),))

    def fresh(nn: Any) -> Any:
        return lambda: models.module_mlp(nn)()

    tables = []
    for what, pure, case_of in [
            ("init", Case(lambda: jax.make_jaxpr(lambda k, x: models.pure_init(k, x))(key, x)), init_of),
            ("apply", Case(lambda: jax.make_jaxpr(lambda p, x: models.pure_apply(p, x))(params, x)),
             apply_of)]:
        cases = {"pure JAX": pure, "varjax.nn, cold": case_of(fresh(varjax.nn)),
                 "varjax.nn, equal model again": case_of(vj_model),
                 "flax.linen": case_of(fresh(flax.linen))}
        table = Table(
            f"make_jaxpr of Module.{what}: {models.DEPTH}-block residual MLP "
            f"(width {models.WIDTH}, batch {models.BATCH})", baseline="pure JAX",
            value_label="median (ms)",
            note="cold = a new model class per repetition (nothing cached); 'equal model again' = "
                 "a new object equal to an earlier one, which shares its traces. The model class "
                 "is written once for both module libraries. Repetitions interleaved.")
        for name, timing in compare(cases, reps=REPS).items():
            table.add_timing(name, timing, target=TARGET if name == "varjax.nn, cold" else None)
        tables.append(table)
    return tables
