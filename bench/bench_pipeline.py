"""Pass-pipeline throughput on synthetic effectful programs of ~1k, ~10k, ~100k equations.

The pipeline runs on every cache miss, so its cost per equation must not grow
with program size: a pass that rescans the jaxpr per equation, or re-traces a
sub-jaxpr per use, is quadratic and shows up here long before a user notices.
The compared value is time per equation; its ratio against the smallest program
is the linearity check (≈1 is linear; target at most 1.5 for 10k and 100k, a
quadratic pass would give ~10x and ~100x).

The program is traced once per size with ``model.jaxpr``; only the pipeline run
on that effectful jaxpr is timed.  Each step reads a ``state`` variable, does
arithmetic and writes it back (4 equations), so forward-stores, dead-reads and
discharge all have work; every ``PARAM_EVERY`` steps it also reads a parameter,
and every ``NESTED_EVERY`` steps the step runs inside a ``jax.jit`` region, so
the rewriter descends into sub-jaxprs.

Sharp edges:
  * To stay in the time budget of ``make bench`` the 100k program gets fewer
    repetitions (see ``SIZES``; the table says how many) and only the smallest
    size gets a warm-up run and the check against ``functional_jaxpr``: both
    are about code paths, which do not depend on size.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

import varjax as vj
from bench.harness import Table, count_eqns, measure
from varjax import passes
from varjax.ir import filters
from varjax.ir.primitives import VarType
from varjax.trace.variable_dicts import flatten_variables

SIZES = {1_000: 5, 10_000: 5, 100_000: 3}  # target equations -> timed repetitions
EQNS_PER_STEP = 4
N_STATE = 64
PARAM_EVERY = 16
NESTED_EVERY = 32
LINEARITY_TARGET = 1.5
MUTABLE = ["state"]
SHAPE = (4,)


def _step(x: jax.Array, name: str) -> jax.Array:
    v = vj.variable("state", name)
    y = v.value * x + 1.0
    v.value = y
    return y


_nested_step = jax.jit(_step, static_argnames="name")


def synthetic(n_eqns: int):
    """A functionalized program of about ``n_eqns`` equations and the variables it reads."""
    steps = n_eqns // EQNS_PER_STEP

    def program(x: jax.Array) -> jax.Array:
        for i in range(steps):
            step = _nested_step if i % NESTED_EVERY == 0 else _step
            x = step(x, name=f"s{i % N_STATE}")
            if i % PARAM_EVERY == 0:
                x = x + vj.param(f"p{i // PARAM_EVERY}", jax.nn.initializers.zeros, SHAPE)
        return x

    zeros = jnp.zeros(SHAPE)
    variables = {
        "state": {f"s{i}": zeros for i in range(min(N_STATE, steps))},
        "params": {f"p{i}": zeros for i in range(-(-steps // PARAM_EVERY))},
    }
    return vj.functionalize(program), variables, zeros


def run() -> list[Table]:
    table = Table(
        "Pass pipeline throughput on synthetic effectful programs",
        baseline="~1k eqns", value_label="median (µs / eqn)",
        note="Only the default pipeline run (verification after each pass only when "
             "VARJAX_VERIFY is set) over an already-traced jaxpr is timed; 'cache miss' is one "
             "full trace + pipeline, for scale. Eqns count "
             "sub-jaxprs recursively. Ratio ≈1 means linear scaling. Repetitions: "
             f"{', '.join(f'~{n // 1000}k: {r}' for n, r in SIZES.items())}.")
    per_pass: dict[str, dict[str, float]] = {}
    for size, reps in SIZES.items():
        first = size == min(SIZES)
        label = f"~{size // 1000}k eqns"
        eqns, miss_s, timing, per_pass[label] = _measure_size(size, reps, first)
        table.add(label, timing.median / eqns * 1e6, {
            "eqns": eqns, "cache miss (s)": miss_s, "pipeline median (ms)": timing.median * 1e3,
            "eqns / s": eqns / timing.median, "reps": reps,
        }, target=None if first else LINEARITY_TARGET)
    return [table, _breakdown(per_pass)]


def _measure_size(size: int, reps: int, first: bool):
    """``(eqns, cache-miss seconds, pipeline Timing, µs / eqn per pass)`` for one size."""
    model, variables, x = synthetic(size)
    start = time.perf_counter()
    jaxpr = model.jaxpr(x, variables=variables, mutable=MUTABLE)
    miss_s = time.perf_counter() - start
    eqns = count_eqns(jaxpr)
    run_once = pipeline_run(model, variables, MUTABLE)
    if first:
        _check_same_as_apply(run_once(jaxpr), model.functional_jaxpr(
            x, variables=variables, mutable=MUTABLE))
    pass_seconds: list[dict[str, float]] = []

    def timed_run() -> None:
        run_once(jaxpr)
        pass_seconds.append(model.pipeline.last_timings)

    timing = measure(timed_run, reps=reps, warmup=1 if first else 0)
    timed = pass_seconds[-reps:]
    per_pass = {name: statistics.median(t[name] for t in timed) / eqns * 1e6 for name in timed[0]}
    per_pass["verification and hooks"] = timing.median / eqns * 1e6 - sum(per_pass.values())
    return eqns, miss_s, timing, per_pass


def _breakdown(per_pass: dict[str, dict[str, float]]) -> Table:
    """Time per equation of each pass, so a non-linear pass can be named."""
    largest = list(per_pass)[-1]
    table = Table("Pipeline time per pass (µs / eqn), by program size",
                  baseline="whole pipeline", value_label=f"{largest}",
                  note="Ratio: the pass's share of the whole pipeline at the largest size.")
    table.add("whole pipeline", sum(per_pass[largest].values()),
              {label: sum(times.values()) for label, times in list(per_pass.items())[:-1]})
    for name in per_pass[largest]:
        table.add(name, per_pass[largest][name],
                  {label: times[name] for label, times in list(per_pass.items())[:-1]})
    return table


def _check_same_as_apply(ours: Any, theirs: Any) -> None:
    """The benchmarked run must be the one ``apply`` does, not a cheaper imitation."""
    if (count_eqns(ours), ours.in_avals, ours.out_avals) != \
            (count_eqns(theirs), theirs.in_avals, theirs.out_avals):
        raise AssertionError("bench pipeline run differs from functionalize's; "
                             "update pipeline_run to match varjax/functionalization/functionalized.py")


def pipeline_run(model, variables: dict, mutable: Any):
    """``jaxpr -> pure jaxpr`` through ``model``'s pipeline, with the ``PassContext``
    that ``Functionalized`` builds (``PassContext.for_inputs``) for a call without RNG
    streams."""
    given = {key: VarType.of(jax.tree.unflatten(tree, leaves))
             for key, (tree, leaves) in flatten_variables(variables).items()}

    def run_once(jaxpr: Any) -> Any:
        ctx = passes.PassContext.for_inputs(given, filters.freeze(mutable))
        return model.pipeline.run(jaxpr, ctx)
    return run_once
