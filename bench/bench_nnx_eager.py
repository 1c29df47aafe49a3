"""Eager NNX beside flax.nnx, and a cold NNX train step beside pure JAX.

Issue 35's targets: eager construction of a 12-block residual MLP and its eager call no
slower than flax.nnx's (the same NNX source, run with ``from varjax import nnx`` and
``from flax import nnx``), and the first call of an ``nnx.jit`` train step in a fresh
process (trace, compile and run) within 1.5x of the same step written in pure JAX under
``jax.jit``.  Why eager matters: NNX code builds and calls modules in Python, outside any
transform, while exploring; why cold: a user's first step pays the trace, which a warm
measurement hides.

Sharp edge: the eager call differs from the jitted one by an ulp in both libraries (each
op dispatched on its own); the rows check that the two libraries agree on the output.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
from typing import Any

import flax.nnx
import jax
import jax.numpy as jnp
import numpy as np

from bench import harness
from varjax import nnx as vnnx

BLOCKS, WIDTH, BATCH = 12, 32, 8
REPS, COLD_REPS = 7, 3


def residual_mlp(nnx: Any) -> type:
    class Block(nnx.Module):
        def __init__(self, rngs: Any):
            self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + nnx.relu(self.norm(self.linear(x)))

    class ResidualMLP(nnx.Module):
        def __init__(self, rngs: Any):
            self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])

        def __call__(self, x: jax.Array) -> jax.Array:
            for block in self.blocks:
                x = block(x)
            return x
    return ResidualMLP


_COLD = """
import time, jax, jax.numpy as jnp, optax
case = {case!r}
x, y = jnp.ones(({batch}, {width})), jnp.zeros(({batch}, {width}))
tx = optax.adam(1e-3)
if case == "pure":
    def init(key):
        keys = jax.random.split(key, {blocks})
        return [{{"kernel": jax.nn.initializers.lecun_normal()(k, ({width}, {width})),
                 "bias": jnp.zeros({width}), "scale": jnp.ones({width}),
                 "shift": jnp.zeros({width})}} for k in keys]

    def forward(params, x):
        for p in params:
            h = x @ p["kernel"] + p["bias"]
            mean = h.mean(-1, keepdims=True)
            var = ((h - mean) ** 2).mean(-1, keepdims=True)
            h = (h - mean) * jax.lax.rsqrt(var + 1e-6) * p["scale"] + p["shift"]
            x = x + jax.nn.relu(h)
        return x

    params = init(jax.random.key(0))
    state = tx.init(params)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((forward(p, x) - y) ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss
    start = time.perf_counter()
    jax.block_until_ready(step(params, state, x, y))
else:
    if case == "varjax":
        from varjax import nnx
    else:
        from flax import nnx
    from bench.bench_nnx_eager import residual_mlp
    model = residual_mlp(nnx)(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss
    start = time.perf_counter()
    jax.block_until_ready(step(model, optimizer, x, y))
print(time.perf_counter() - start)
"""

COLD_CASES = {"pure JAX, jax.jit step": "pure", "varjax.nnx, nnx.jit step": "varjax",
              "flax.nnx, nnx.jit step": "flax"}


def _cold(case: str) -> float:
    program = _COLD.format(case=case, batch=BATCH, width=WIDTH, blocks=BLOCKS)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.split()[-1])


def _eager_tables() -> list[harness.Table]:
    x = jnp.ones((BATCH, WIDTH))
    made = {lib: residual_mlp(nnx)(nnx.Rngs(0)) for lib, nnx in (("varjax", vnnx),
                                                                  ("flax", flax.nnx))}
    np.testing.assert_allclose(made["varjax"](x), made["flax"](x), rtol=1e-5, atol=1e-6)
    build = harness.compare({
        "flax.nnx": harness.Case(lambda: residual_mlp(flax.nnx)(flax.nnx.Rngs(0))),
        "varjax.nnx": harness.Case(lambda: residual_mlp(vnnx)(vnnx.Rngs(0)))}, reps=REPS)
    call = harness.compare({
        "flax.nnx": harness.Case(lambda: jax.block_until_ready(made["flax"](x))),
        "varjax.nnx": harness.Case(lambda: jax.block_until_ready(made["varjax"](x)))},
        reps=REPS)
    tables = []
    for what, timings in (("construction", build), ("call", call)):
        table = harness.Table(
            f"Eager NNX {what}: {BLOCKS}-block residual MLP (Linear {WIDTH}, LayerNorm, relu)",
            baseline="flax.nnx", value_label="median (ms)",
            note=f"The same NNX source under both libraries, {REPS} interleaved repetitions "
                 f"after a warm-up; batch {BATCH} for the call.")
        for name, timing in timings.items():
            table.add_timing(name, timing, target=1.0 if name == "varjax.nnx" else None)
        tables.append(table)
    return tables


def _cold_table() -> harness.Table:
    times: dict[str, list[float]] = {name: [] for name in COLD_CASES}
    for _ in range(COLD_REPS):                # interleaved: load changes hit every case alike
        for name, case in COLD_CASES.items():
            times[name].append(_cold(case))
    table = harness.Table(
        f"Cold first train step: {BLOCKS}-block residual MLP, optax.adam",
        baseline="pure JAX, jax.jit step", value_label="median (s)",
        note=f"Wall time of the first call (trace, compile, run) in a fresh process, imports "
             f"and model construction excluded, {COLD_REPS} interleaved repetitions.")
    for name in COLD_CASES:
        table.add(name, statistics.median(times[name]), {"min (s)": min(times[name]),
                                                          "reps": COLD_REPS},
                  target=1.5 if name.startswith("varjax") else None)
    return table


def run() -> list[harness.Table]:
    return [*_eager_tables(), _cold_table()]
