"""Deep ``init`` from a cold process: 40 stacked ``Dense(2)``, wall time to the variables.

Why cold: what ``init`` costs a user is dominated by XLA compiling, and JAX keeps what it
compiled for the rest of the process, so a warm measurement hides it.  Each repetition of
each case runs in a new Python process (started by this suite, interleaved with the other
cases); the time is measured inside it, from just before ``init`` to the variables being
ready, so interpreter and import time are left out.

Cases: hand-written JAX (the same initializers called eagerly, keys split per layer),
Linen's ``init`` eagerly and under ``jax.jit``, and varjax's the same two ways.  Linen's
eager init dispatches each operation through JAX's per-operation cache; under ``jax.jit``
XLA compiles every initializer of every layer as one program.  Target: varjax's eager
``init`` within 1.5x Linen's eager one.
"""
from __future__ import annotations

import statistics
import subprocess
import sys

from bench import harness

LAYERS = 40
REPS = 3

_PROGRAM = """
import time, jax, jax.numpy as jnp
case, layers = {case!r}, {layers}
x = jnp.ones((1, 2))
if case == "pure":
    def init(key):
        keys = jax.random.split(key, layers)
        return [{{"kernel": jax.nn.initializers.lecun_normal()(k, (2, 2)), "bias": jnp.zeros(2)}}
                for k in keys]
else:
    import flax.linen as linen
    import varjax.nn as vjnn
    nn = linen if case.startswith("linen") else vjnn

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(layers):
                x = nn.Dense(2)(x)
            return x
    init = lambda key: Stack().init(key, x)
    if case.endswith("jit"):
        init = jax.jit(init)
start = time.perf_counter()
jax.block_until_ready(init(jax.random.key(0)))
print(time.perf_counter() - start)
"""

CASES = {
    "pure JAX, eager": "pure",
    "flax.linen, eager init": "linen",
    "flax.linen, jax.jit(init)": "linen-jit",
    "varjax.nn, eager init": "varjax",
    "varjax.nn, jax.jit(init)": "varjax-jit",
}


def _cold(case: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PROGRAM.format(case=case, layers=LAYERS)],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def run() -> list[harness.Table]:
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(REPS):                     # interleaved: load changes hit every case alike
        for name, case in CASES.items():
            times[name].append(_cold(case))
    table = harness.Table(
        f"Cold-process init: {LAYERS} stacked Dense(2)", baseline="flax.linen, eager init",
        value_label="median (s)",
        note=f"Wall time of `init` in a fresh process (imports excluded), {REPS} interleaved "
             "repetitions per case.")
    for name in CASES:
        table.add(name, statistics.median(times[name]), {"min (s)": min(times[name]), "reps": REPS},
                  target=1.5 if name == "varjax.nn, eager init" else None)
    return [table]
