"""Train-step dispatch of ``varjax.nnx`` beside flax.nnx's: ``nnx.jit``, ``jit_partial``,
``cached_partial``, against raw ``jax.jit`` of the same pure step measured in the same run.

The model, data and timing are ``bench_dispatch``'s (MLP 16 -> 32 -> 32 -> 4, batch 32,
MSE, ``optax.adam``; ``STEPS`` chained steps per repetition, median of ``REPS``
interleaved ones after a warm-up), written as NNX code once and run with
``from varjax import nnx`` and ``from flax import nnx``: an ``nnx.Optimizer`` step, with
``nnx.jit`` in graph mode (the default) and in tree mode (``graph=False``).  Each
varjax row is checked against the flax.nnx row of the same form before it is timed (the
same losses over ``CHECK_STEPS`` steps from the same seed).

``python -m bench nnx_dispatch`` prints the table.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench import bench_dispatch as base
from bench.harness import Case, Table, compare
from varjax import nnx as vnnx
from varjax.nnx import compilation

CHECK_STEPS = 3
TARGET = 1.1     # issue 35: varjax's nnx.jit dispatch, graph and tree mode, to raw jax.jit
tx = optax.adam(1e-3)


def mlp_class(nnx: Any) -> type:
    class MLP(nnx.Module):
        def __init__(self, rngs: Any):
            self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs)
                                    for a, b in zip(base.SIZES, base.SIZES[1:])])

        def __call__(self, x: jax.Array) -> jax.Array:
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = nnx.relu(x)
            return x
    return MLP


def step_of(nnx: Any) -> Callable:
    def train_step(model: Any, optimizer: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: base.mse(m(x), y))(model)
        optimizer.update(model, grads)
        return loss
    return train_step


def forms(nnx: Any, jit_partial: Callable, cached_partial: Callable) -> dict[str, Callable]:
    """Each form of the step as ``make() -> step()``: a new model and optimizer, bound."""
    mlp, train_step = mlp_class(nnx), step_of(nnx)

    def objects() -> tuple:
        model = mlp(nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    def with_jit(x: jax.Array, y: jax.Array, **mode: bool) -> Callable:
        model, optimizer = objects()
        fn = nnx.jit(train_step, **mode)
        return lambda: fn(model, optimizer, x, y)

    def with_jit_partial(x: jax.Array, y: jax.Array) -> Callable:
        fn = jit_partial(train_step, *objects(), graph_updates=False)
        return lambda: fn(x, y)

    def with_cached_partial(x: jax.Array, y: jax.Array) -> Callable:
        fn = cached_partial(nnx.jit(train_step), *objects())
        return lambda: fn(x, y)
    return {"nnx.jit": with_jit,
            "nnx.jit(graph=False)": lambda x, y: with_jit(x, y, graph=False),
            "jit_partial(graph_updates=False)": with_jit_partial,
            "cached_partial(nnx.jit(step))": with_cached_partial}


VARJAX = forms(vnnx, compilation.jit_partial, compilation.cached_partial)
FLAX = forms(flax.nnx, flax.nnx.jit_partial, flax.nnx.cached_partial)


def pure_case(x: jax.Array, y: jax.Array) -> Case:
    """Raw ``jax.jit`` of the pure step over the same MLP's parameters (a flat dict)."""
    model = mlp_class(vnnx)(vnnx.Rngs(0))
    flat = {f"layers_{i}_{name}": getattr(layer, name)[...]
            for i, layer in enumerate(model.layers) for name in ("kernel", "bias")}
    fn, state = jax.jit(base.pure_step), [flat, tx.init(flat)]

    def step() -> Any:
        state[0], state[1], loss = fn(state[0], state[1], x, y)
        return loss
    return base.loop(step)


def check(x: jax.Array, y: jax.Array) -> None:
    """Each varjax form gives flax.nnx's losses, step by step."""
    for name in VARJAX:
        ours, theirs = VARJAX[name](x, y), FLAX[name](x, y)
        for i in range(CHECK_STEPS):
            np.testing.assert_allclose(ours(), theirs(), rtol=1e-6, err_msg=f"{name}, step {i}")


def run() -> list[Table]:
    _, x, y = base.inputs()
    check(x, y)
    cases = {"pure JAX (jax.jit)": pure_case(x, y)}
    cases.update({f"varjax.nnx {name}": base.loop(make(x, y)) for name, make in VARJAX.items()})
    cases.update({f"flax.nnx {name}": base.loop(make(x, y)) for name, make in FLAX.items()})
    table = Table(
        f"NNX train-step dispatch: MLP {'->'.join(map(str, base.SIZES))}, batch {base.BATCH}, "
        "nnx.Optimizer(optax.adam)", baseline="pure JAX (jax.jit)", value_label="per step (us)",
        note=f"Per-step wall time of {base.STEPS} chained steps (block_until_ready on the last), "
             f"median of {base.REPS} interleaved repetitions after a warm-up one; the same NNX "
             "code with `from varjax import nnx` and `from flax import nnx` (graph mode, the "
             "default, unless the row says graph=False), each varjax form checked against "
             "flax.nnx's losses first. The ratio of the fastest repetitions is shown too. "
             f"Target (issue 35): varjax's nnx.jit within {TARGET}x of raw jax.jit.")
    timings = compare(cases, reps=base.REPS)
    base_min = timings[table.baseline].min
    for name, timing in timings.items():
        table.add(name, timing.median / base.STEPS * 1e6,
                  {"min (us)": timing.min / base.STEPS * 1e6,
                   "min / baseline min": f"{timing.min / base_min:.2f}x", "reps": timing.reps},
                  target=TARGET if name.startswith("varjax.nnx nnx.jit") else None)
    return [table]


if __name__ == "__main__":
    jnp.zeros(())     # start the backend before timing
    for t in run():
        print(t.markdown())
