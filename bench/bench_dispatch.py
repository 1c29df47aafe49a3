"""Train-step dispatch overhead and HLO op counts: a tiny MLP trained with Optax Adam.

MLP 16 -> 32 -> 32 -> 4 (relu), batch 32, mean squared error, ``optax.adam``: so
little compute that the per-step cost is mostly Python and dispatch.  The baseline
is raw ``jax.jit`` on pure functions (parameters in a flat dict, dense layers by
hand); every other row is a ratio against it, measured in the same run:

* **varjax.nn, jax.jit around apply**: the usual Linen loop over the variables dict.
  Inside ``jax.jit``, ``apply`` stages its cached pure jaxpr, so each step dispatches
  through ``jax.jit`` alone.  Target <= 1.1.
* **varjax.nn, bound module**: ``model.bind(variables, mutable=True)`` and one
  ``bound.train_step(x, y)`` per step.  The method updates ``params`` and the Adam state
  (its own ``opt_state`` collection) inside; each call goes through the bound root's
  cached ``functionalize`` (cache key, then ``jax.jit`` of the pure jaxpr), and the
  written variables go back into the root.  Target <= 1.1.
* **varjax.nn, lifted nn.jit, bound**: the same method under ``nn.jit`` (a jit nested
  inside the bound call's own); no target, it shows what the lifted jit adds.
* **varjax object mode**: NNX-style user code, ``@vj.jit def train_step(model, opt_state,
  x, y)`` over ``model = MLP().bind(variables, mutable="params")`` and ``opt_state =
  vj.Variable(tx.init(params), collection="opt_state")``.  Inside, ``vj.value_and_grad``
  of the loss gives a bound module of cotangents (``vj.state(grads)["params"]``), Optax
  updates the parameters, and the step writes them into the model (``vj.update``, NNX's
  ``nnx.update``) and the new Adam state into ``opt_state.value``; ``vj.jit`` writes both back to
  the argument objects, so the model is updated in place as an ``nnx.Optimizer`` step
  updates an NNX model.  Each call finds the argument objects' variables, dispatches
  through ``jax.jit`` of the cached pure function, and writes back what was written.
  Target <= 1.1.
* For reference: Flax Linen (``jax.jit`` around ``apply``) and Flax NNX:
  ``nnx.jit`` in graph mode (the default), ``nnx.jit(graph=False)`` (tree mode), and the
  functional ``nnx.split``/``nnx.merge`` style inside a raw ``jax.jit``.

Time: one repetition runs ``STEPS`` steps, each feeding its outputs to the next, and
blocks on the last; the value is the median per-step time over ``REPS`` interleaved
repetitions after a warm-up (compilation) repetition.

The object-mode row is checked against pure JAX before it is timed: the same loss and
parameters after ``CHECK_STEPS`` steps from the same start (rtol 1e-5).

The second table counts the HLO instructions XLA compiles for the whole train step
(``jax.jit(step).lower(...).compile().as_text()``), per op kind, varjax vs pure JAX.
Both compute the same math from the same parameters, so the counts must be equal:
varjax's passes leave nothing in the program.  Any op kind whose count differs is
named in the table.  The object-mode ``vj.jit`` step has no ``.lower``: its row lowers a
pure function that binds the model to traced variables, calls the ``vj.jit`` step (a
``jax.jit`` nested in the outer one, as it runs) and returns ``vj.state(model)``.
"""
from __future__ import annotations

import collections
import re
import types
from collections.abc import Callable
from typing import Any

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

import varjax as vj
import varjax.nn
from bench.harness import Case, Table, compare

SIZES = (16, 32, 32, 4)
BATCH = 32
STEPS = 50
REPS = 31
TARGET = 1.1
CHECK_STEPS = 5
OBJECT_ROW = "varjax object mode: vj.jit over a bound module and an optax state"

tx = optax.adam(1e-3)


def mse(pred: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(pred - y))


def mlp_class(nn: Any) -> Any:
    """The MLP as a Linen-style module, written once for ``varjax.nn`` and ``flax.linen``.
    Layers are made in ``setup`` so a train step can address each one's parameters."""

    class MLP(nn.Module):
        def setup(self):
            self.layers = [nn.Dense(n) for n in SIZES[1:]]

        def __call__(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < len(self.layers) - 1:
                    x = nn.relu(x)
            return x

    return MLP


class Trainer(mlp_class(varjax.nn)):
    """The varjax MLP plus a stateful train step: the Adam state is a variable of
    collection ``opt_state`` and the new parameters are written back in place.  The step
    declares that variable, so it is ``@compact`` (Linen's rule)."""

    @varjax.nn.compact
    def train_step(self, x: jax.Array, y: jax.Array) -> jax.Array:
        loss, vjp_fn = varjax.nn.vjp(lambda mdl, x, y: mse(mdl(x), y), self, x, y)
        grads = vjp_fn(jnp.ones((), loss.dtype))[0]["params"]
        params = self.variables["params"]
        opt_state = self.variable("opt_state", "adam", tx.init, params)
        updates, opt_state.value = tx.update(grads, opt_state.value, params)
        new_params = optax.apply_updates(params, updates)
        for i, layer in enumerate(self.layers):
            for name, value in new_params[f"layers_{i}"].items():
                layer.put_variable("params", name, value)
        return loss


VarjaxMLP = mlp_class(varjax.nn)


def mse_of(model: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return mse(model(x), y)


@vj.jit
def object_step(model: Any, opt_state: vj.Variable, x: jax.Array, y: jax.Array) -> jax.Array:
    """The object-mode train step: ``model`` (bound with ``mutable="params"``) and
    ``opt_state`` (a ``vj.Variable``) are updated in place."""
    loss, grads = vj.value_and_grad(mse_of)(model, x, y)
    params = vj.state(model, "params")["params"]
    updates, opt_state.value = tx.update(vj.state(grads, "params")["params"], opt_state.value,
                                         params)
    vj.update(model, {"params": optax.apply_updates(params, updates)})
    return loss


def object_pure(variables: dict, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple:
    """``object_step`` as a pure function (for ``jax.jit(...).lower``): the model and the
    optimizer state are made from the (traced) inputs, and their new values returned."""
    model = VarjaxMLP().bind(variables, mutable="params")
    opt = vj.Variable(opt_state, collection="opt_state")
    loss = object_step(model, opt, x, y)
    return vj.state(model), opt.value, loss


def pure_forward(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The same MLP by hand over a flat dict (``layers_{i}_kernel`` / ``_bias``).  Each
    layer is ``x @ kernel + bias`` with the primitives ``nn.Dense`` binds (``x @ k + b``
    in ``jnp`` adds a reshape of the bias, and its transpose a reshape and a reduction,
    which XLA removes again), so the staged programs compare op for op."""
    n = len(SIZES) - 1
    for i in range(n):
        y = lax.dot_general(x, params[f"layers_{i}_kernel"], (((1,), (0,)), ((), ())))
        x = lax.add(y, lax.broadcast_in_dim(params[f"layers_{i}_bias"], y.shape, (1,)))
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def pure_step(params: dict, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple:
    loss, grads = jax.value_and_grad(lambda p: mse(pure_forward(p, x), y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# pure JAX over the varjax variables layout (nested dicts): isolates pytree cost at dispatch
pure_nested = types.SimpleNamespace(apply=lambda variables, x: pure_forward(flat_params(variables), x))


def module_step(model: Any) -> Any:
    """The Linen training step for a Linen-style module (varjax.nn or flax.linen)."""

    def step(variables: dict, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple:
        params = variables["params"]
        loss, grads = jax.value_and_grad(lambda p: mse(model.apply({"params": p}, x), y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return {"params": optax.apply_updates(params, updates)}, opt_state, loss

    return step


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(SIZES, SIZES[1:])])

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = nnx.relu(x)
        return x


def nnx_step(model: NnxMLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array,
             graph: bool = True) -> jax.Array:
    loss, grads = nnx.value_and_grad(lambda m: mse(m(x), y), graph=graph)(model)
    optimizer.update(model, grads)
    return loss


def inputs() -> tuple[jax.Array, jax.Array, jax.Array]:
    key = jax.random.key(0)
    x = jax.random.normal(jax.random.fold_in(key, 1), (BATCH, SIZES[0]))
    y = jax.random.normal(jax.random.fold_in(key, 2), (BATCH, SIZES[-1]))
    return key, x, y


def flat_params(variables: dict) -> dict[str, jax.Array]:
    return {f"{layer}_{name}": a for layer, d in variables["params"].items() for name, a in d.items()}


# --- dispatch ------------------------------------------------------------------------------

def loop(step: Callable[[], Any]) -> Case:
    """``STEPS`` calls of ``step`` (which carries its own state from call to call),
    blocking on the last result."""

    def run() -> None:
        out = None
        for _ in range(STEPS):
            out = step()
        jax.block_until_ready(out)

    return Case(run)


def dispatch_cases(key: jax.Array, x: jax.Array, y: jax.Array) -> dict[str, Case]:
    variables = Trainer().init(key, x)
    params, flat = variables["params"], flat_params(variables)
    linen = mlp_class(flax.linen)()
    linen_vars = linen.init(key, x)

    def jitted(fn: Callable, variables: Any, params: Any) -> Case:
        """``variables, opt_state, loss = jax.jit(fn)(variables, opt_state, x, y)``, Adam
        over ``params`` (the variables' parameters)."""
        fn, state = jax.jit(fn), [variables, tx.init(params)]

        def step() -> Any:
            state[0], state[1], loss = fn(state[0], state[1], x, y)
            return loss
        return loop(step)

    def bound(module: Any) -> Case:
        b = module.bind({"params": params, "opt_state": {"adam": tx.init(params)}}, mutable=True)
        return loop(lambda: b.train_step(x, y))

    def object_mode() -> Case:
        model = VarjaxMLP().bind(variables, mutable="params")
        opt_state = vj.Variable(tx.init(params), collection="opt_state")
        return loop(lambda: object_step(model, opt_state, x, y))

    def nnx_jit(graph: bool) -> Case:
        model = NnxMLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param, graph=graph)
        fn = nnx.jit(nnx_step, static_argnames="graph", graph=graph)
        return loop(lambda: fn(model, optimizer, x, y, graph=graph))

    def nnx_split_merge() -> Case:
        model = NnxMLP(nnx.Rngs(0))
        graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

        @jax.jit
        def fn(state: Any, x: jax.Array, y: jax.Array) -> tuple:
            model, optimizer = nnx.merge(graphdef, state)
            loss = nnx_step(model, optimizer, x, y)
            return nnx.state((model, optimizer)), loss

        box = [state]

        def step() -> Any:
            box[0], loss = fn(box[0], x, y)
            return loss
        return loop(step)

    return {
        "pure JAX (jax.jit)": jitted(pure_step, flat, flat),
        "pure JAX, nested dicts (jax.jit)": jitted(module_step(pure_nested), variables, params),
        "varjax.nn, jax.jit around apply": jitted(module_step(Trainer()), variables, params),
        "varjax.nn, bound module": bound(Trainer()),
        "varjax.nn, lifted nn.jit, bound": bound(varjax.nn.jit(Trainer)()),
        OBJECT_ROW: object_mode(),
        "flax.linen, jax.jit around apply": jitted(module_step(linen), linen_vars, linen_vars["params"]),
        "nnx.jit (graph mode)": nnx_jit(True),
        "nnx.jit(graph=False) (tree mode)": nnx_jit(False),
        "nnx split/merge in jax.jit": nnx_split_merge(),
    }


def check_object_mode(key: jax.Array, x: jax.Array, y: jax.Array) -> None:
    """``object_step`` gives pure JAX's losses and parameters, step by step."""
    variables = VarjaxMLP().init(key, x)
    flat = flat_params(variables)
    model = VarjaxMLP().bind(variables, mutable="params")
    opt_state = vj.Variable(tx.init(variables["params"]), collection="opt_state")
    pure, state = jax.jit(pure_step), [flat, tx.init(flat)]
    for i in range(CHECK_STEPS):
        loss = object_step(model, opt_state, x, y)
        state[0], state[1], ref = pure(state[0], state[1], x, y)
        np.testing.assert_allclose(loss, ref, rtol=1e-5, err_msg=f"{OBJECT_ROW}: loss, step {i}")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7,
                                                         err_msg=f"{OBJECT_ROW}: params"),
                 flat_params(vj.state(model)), state[0])


def dispatch_table(key: jax.Array, x: jax.Array, y: jax.Array) -> Table:
    table = Table(
        f"Train-step dispatch: MLP {'->'.join(map(str, SIZES))}, batch {BATCH}, Optax Adam",
        baseline="pure JAX (jax.jit)", value_label="per step (us)",
        note=f"Per-step wall time of {STEPS} chained steps (block_until_ready on the last), median "
             f"of {REPS} interleaved repetitions after a warm-up one. 'bound module' = "
             "`model.bind(variables, mutable=True).train_step(x, y)`, the method updating params "
             "and Adam state (collection `opt_state`) in place; 'lifted nn.jit' = the same under "
             "`nn.jit(Trainer)`. 'object mode' = `@vj.jit def train_step(model, opt_state, x, y)` "
             "over `MLP().bind(variables, mutable='params')` and a `vj.Variable` holding the Adam "
             "state, both updated in place (checked against pure JAX over "
             f"{CHECK_STEPS} steps). NNX: `nnx.jit` graph mode (default) and `graph=False` (tree "
             "mode); 'split/merge' = `nnx.merge`/`nnx.state` inside a raw `jax.jit`. The ratio of the "
             "fastest repetitions is shown too: on a loaded machine it is the steadier one.")
    targets = {"varjax.nn, jax.jit around apply": TARGET, "varjax.nn, bound module": TARGET,
               OBJECT_ROW: TARGET}
    check_object_mode(key, x, y)
    timings = compare(dispatch_cases(key, x, y), reps=REPS)
    base_min = timings[table.baseline].min
    for name, timing in timings.items():
        cells = {"min (us)": timing.min / STEPS * 1e6,
                 "min / baseline min": f"{timing.min / base_min:.2f}x", "reps": timing.reps}
        table.add(name, timing.median / STEPS * 1e6, cells, target=targets.get(name))
    return table


# --- HLO op counts -------------------------------------------------------------------------

_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][\w\-]*)\(")


def hlo_ops(compiled_text: str) -> collections.Counter:
    """Instruction count per opcode over every computation of a compiled HLO module."""
    counts: collections.Counter = collections.Counter()
    for line in compiled_text.splitlines():
        m = _OP.match(line)
        if m:
            counts[m.group(1)] += 1
    return counts


_MLIR_OP = re.compile(r"^\s*(?:%[\w#:]+(?:, %[\w#:]+)* = )?\"?([a-z_][\w.]*)")


def stablehlo_ops(lowered_text: str) -> collections.Counter:
    """Operations per name in StableHLO text (``call``, ``return`` and ``func.func`` included;
    a reduction's one-line body is part of its ``stablehlo.reduce``)."""
    counts: collections.Counter = collections.Counter()
    for line in lowered_text.splitlines():
        m = _MLIR_OP.match(line)
        if m and m.group(1) != "module":
            counts[m.group(1)] += 1
    return counts


def hlo_table(key: jax.Array, x: jax.Array, y: jax.Array) -> Table:
    variables = Trainer().init(key, x)
    params, flat = variables["params"], flat_params(variables)
    linen_vars = {"params": params}   # Linen's MLP has the same names and shapes
    steps = {
        "pure JAX": (pure_step, (flat, tx.init(flat), x, y)),
        "varjax.nn, jax.jit around apply": (module_step(Trainer()), (variables, tx.init(params), x, y)),
        "varjax.nn, stateful train_step (apply, mutable)": (
            lambda v, x, y: Trainer().apply(v, x, y, method=Trainer.train_step, mutable=True),
            ({"params": params, "opt_state": {"adam": tx.init(params)}}, x, y)),
        "varjax object mode (vj.jit step, bound module)": (
            object_pure, (variables, tx.init(params), x, y)),
        "flax.linen, jax.jit around apply": (module_step(mlp_class(flax.linen)()),
                                             (linen_vars, tx.init(params), x, y)),
    }
    counts = {}
    for name, (fn, args) in steps.items():
        lowered = jax.jit(fn).lower(*args)
        counts[name] = (stablehlo_ops(lowered.as_text()), hlo_ops(lowered.compile().as_text()))
    # same math: the same loss and new parameters from the same inputs
    outs = {name: jax.jit(fn)(*args) for name, (fn, args) in steps.items()}
    results = {"pure JAX": (outs["pure JAX"][2], outs["pure JAX"][0])}
    for name, out in outs.items():
        if name != "pure JAX":
            loss, new = (out[0], out[1]) if "stateful" in name else (out[2], out[0])
            results[name] = (loss, flat_params(new))
    for name, result in results.items():
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name),
                     result, results["pure JAX"])

    table = Table(
        "HLO op counts of the compiled train step (same MLP, Adam, MSE)", baseline="pure JAX",
        value_label="compiled HLO instructions",
        note="Instructions over every computation of `jax.jit(step).lower(...).compile().as_text()` "
             "(fusion bodies included), and StableHLO ops of `lower(...).as_text()`; the diff columns "
             "list every op kind whose count differs from pure JAX (this - pure). Target: equal counts "
             "and no HLO diff. All rows are checked to give the same loss and new parameters. "
             "'stateful train_step' is what the bound module runs (params and Adam state written by "
             "the method). 'object mode' lowers `object_pure`: the model bound to the traced "
             "variables, the `vj.jit` step called on it (a nested `jax.jit`, as when it runs), "
             "`vj.state(model)` returned. varjax's `apply` stages its cached pure jaxpr as a "
             "`jit` equation (under differentiation: one call for the forward, one for its "
             "transpose): StableHLO `func.func`/`call`/`return` that XLA inlines.")
    base_shlo, base_hlo = counts["pure JAX"]
    for name, (shlo, hlo) in counts.items():
        diff, sdiff = _diff(hlo, base_hlo), _diff(shlo, base_shlo)
        table.add(name, sum(hlo.values()), {
            "StableHLO ops": sum(shlo.values()),
            "fusions": hlo["fusion"],
            "HLO diff": _diff_text(diff),
            "StableHLO diff": _diff_text(sdiff),
        }, target=1.0 if name.startswith("varjax") else None)
    return table


def _diff(counts: collections.Counter, base: collections.Counter) -> dict[str, int]:
    return {op: counts[op] - base[op] for op in sorted(set(counts) | set(base)) if counts[op] != base[op]}


def _diff_text(diff: dict[str, int]) -> str:
    return ", ".join(f"{op} {d:+d}" for op, d in diff.items()) or "none"


def run() -> list[Table]:
    key, x, y = inputs()
    return [dispatch_table(key, x, y), hlo_table(key, x, y)]
