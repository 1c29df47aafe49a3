"""Staging cost of lifted transforms: nested ``nn.vmap``, nested ``nn.scan``, scan over layers.

Each model is written once (``vmap_model``, ``scan_model``) and built with
``varjax.nn`` and with ``flax.linen``; the baseline is the same computation in
pure JAX, written by hand with nested ``jax.vmap`` / ``jax.lax.scan`` over explicit
parameter trees (the same ``{'Dense_0': {'kernel', 'bias'}, ...}`` layout, the same
initializers, keys split per member as ``split_rngs={'params': True}`` does).
The body is ``Dense(8) -> relu -> Dense(8)``, wrapped in ``d`` levels of
``vmap`` (axis size 2 each) or ``scan`` (length 2 each, carry of shape (8,)),
``variable_axes={'params': 0}, split_rngs={'params': True}`` at every level.

Measured: ``jax.make_jaxpr`` of ``init`` and of ``apply``, cold (a new model class
per repetition, so no varjax trace cache is hit; every pure-JAX function is a new
closure per repetition, so ``lax.scan``'s trace cache is not hit either), the
**minimum** over interleaved repetitions; and the number of times the innermost
body's Python ``__call__`` runs per trace (one extra cold trace, not timed).

Targets (varjax only; Linen is shown for comparison):
  * ``varjax <= 1.5x pure JAX`` at every depth / length;
  * nested ``vmap``: ``varjax below Linen at every depth`` (its time under Linen's);
  * ``body traced once per level``: the innermost body runs once per trace at
    every depth (a transform that traces its body k times per level runs it k^d
    times -- Linen's scan traces it 2^d times);
  * ``linear in depth``: the per-level increment of the time over the deeper half of
    the depths (least-squares slope over ``m..D``, ``m = (1 + D) // 2``) is at most 2x
    the increment over the shallower half (slope over ``1..m``; floored at 5% of
    ``t(1)`` so noise cannot make it ~0).  Linear gives 1x; ``t = d^2`` 2.25x (D=6) or 2x (D=4);
    ``t = 2^d`` 6.1x (D=6) or 3x (D=4);
  * scan over L layers: ``constant in length``: ``t(64) <= 1.5x t(4)`` (one trace
    of the block whatever L is).
"""
from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any

import flax.linen
import jax
import jax.numpy as jnp
import numpy as np

import varjax.nn
from bench.harness import Case, compare

REPS = 7
WIDTH = 8
BATCH = 4
AXIS = 2                      # vmap axis size / scan length at every nesting level
VMAP_DEPTHS = range(1, 7)
SCAN_DEPTHS = range(1, 5)
LAYERS = (4, 16, 64)
RATIO_TARGET = 1.5
LINEAR_TARGET = 2.0
FLAT_TARGET = 1.5
LIBS = {"varjax": varjax.nn, "Linen": flax.linen}
SPLIT = {"variable_axes": {"params": 0}, "split_rngs": {"params": True}}

kernel_init = jax.nn.initializers.lecun_normal()


@dataclasses.dataclass
class Counter:
    """How many times the innermost body's ``__call__`` ran."""

    n: int = 0


# -- the models, written once for any ``nn`` namespace ------------------------------------------

def _mlp(nn: Any, x: jax.Array, counter: Counter) -> jax.Array:
    """The body, called from a compact method: ``Dense -> relu -> Dense``."""
    counter.n += 1
    h = nn.relu(nn.Dense(WIDTH)(x))
    return nn.Dense(WIDTH)(h)


def vmap_model(nn: Any, depth: int, counter: Counter) -> Any:
    """The body in ``depth`` levels of ``nn.vmap``; input ``(2,) * depth + (BATCH, WIDTH)``."""
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return _mlp(nn, x, counter)
    cls = Block
    for _ in range(depth):
        cls = nn.vmap(cls, **SPLIT)
    return cls


def scan_model(nn: Any, depth: int, counter: Counter, length: int = AXIS) -> Any:
    """The body as a scan step ``c -> (c, None)`` in ``depth`` levels of ``nn.scan``."""
    class Step(nn.Module):
        @nn.compact
        def __call__(self, c):
            return _mlp(nn, c, counter), None
    cls = Step
    for _ in range(depth):
        cls = nn.scan(cls, length=length, **SPLIT)
    return cls


# -- the same computations in pure JAX ----------------------------------------------------------
# Every function is built afresh per call: ``lax.scan`` caches the trace of its body by
# function identity, which a cold varjax/Linen trace never gets to use.

def _block_apply(p: dict, x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def _block_init(key: jax.Array, x: jax.Array) -> tuple[jax.Array, dict]:
    """Create the block's parameters (``nn.Dense`` initializers) and run it, as ``init`` does."""
    k0, k1 = jax.random.split(key)
    p = {"Dense_0": {"kernel": kernel_init(k0, (x.shape[-1], WIDTH)), "bias": jnp.zeros(WIDTH)},
         "Dense_1": {"kernel": kernel_init(k1, (WIDTH, WIDTH)), "bias": jnp.zeros(WIDTH)}}
    return _block_apply(p, x), p


def pure_vmap_apply(params: dict, x: jax.Array, depth: int) -> jax.Array:
    fn: Callable = lambda p, x: _block_apply(p, x)  # noqa: E731
    for _ in range(depth):
        fn = jax.vmap(fn)
    return fn(params, x)


def pure_vmap_init(key: jax.Array, x: jax.Array, depth: int) -> dict:
    def level(inner: Callable) -> Callable:
        return lambda k, x: jax.vmap(inner)(jax.random.split(k, AXIS), x)
    fn: Callable = lambda k, x: _block_init(k, x)  # noqa: E731
    for _ in range(depth):
        fn = level(fn)
    return {"params": fn(key, x)[1]}


def pure_scan_apply(params: dict, c: jax.Array, depth: int) -> tuple[jax.Array, None]:
    def level(inner: Callable) -> Callable:
        return lambda c, p: (jax.lax.scan(inner, c, p)[0], None)
    fn: Callable = lambda c, p: (_block_apply(p, c), None)  # noqa: E731
    for _ in range(depth):
        fn = level(fn)
    return fn(c, params)


def pure_scan_init(key: jax.Array, c: jax.Array, depth: int, length: int = AXIS) -> dict:
    def level(inner: Callable) -> Callable:
        return lambda c, k: jax.lax.scan(inner, c, jax.random.split(k, length))
    fn: Callable = lambda c, k: _block_init(k, c)  # noqa: E731
    for _ in range(depth):
        fn = level(fn)
    return {"params": fn(c, key)[1]}


# -- the table ----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Row:
    ms: dict[str, float]            # min over repetitions, per library and "pure JAX"
    traces: dict[str, int]          # body traces per library


class DepthTable:
    """Rows per depth (or length), one column per library plus the pure-JAX baseline;
    targets are printed as verdict lines under the table.  Duck-types ``harness.Table``
    (``title``, ``markdown()``, ``verdicts()``) for ``python -m bench`` and ``--results``."""

    def __init__(self, title: str, key: str, note: str):
        self.title, self.key, self.note = title, key, note
        self.rows: list[tuple[int, _Row]] = []
        self.checks: list[tuple[str, bool, str]] = []

    def add(self, x: int, row: _Row) -> None:
        self.rows.append((x, row))

    def ratio(self, row: _Row, lib: str) -> float:
        return row.ms[lib] / row.ms["pure JAX"]

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))

    def verdicts(self) -> list[tuple[str, bool]]:
        return [(name, ok) for name, ok, _ in self.checks]

    def markdown(self) -> str:
        head = [self.key, *(f"{lib} (ms)" for lib in (*LIBS, "pure JAX")),
                *(f"{lib} / pure" for lib in LIBS), *(f"body traces {lib}" for lib in LIBS)]
        lines = [f"### {self.title}", "", self.note, "", _md(head), _md(["---:"] * len(head))]
        for x, r in self.rows:
            lines.append(_md([str(x), *(f"{r.ms[k]:.3g}" for k in (*LIBS, "pure JAX")),
                              *(f"{self.ratio(r, lib):.2f}x" for lib in LIBS),
                              *(str(r.traces[lib]) for lib in LIBS)]))
        lines.append("")
        lines += [f"- {name}: {detail} -- {'PASS' if ok else 'MISS'}"
                  for name, ok, detail in self.checks]
        return "\n".join(lines) + "\n"


def _md(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _ratio_check(table: DepthTable) -> None:
    worst_x, worst = max(((x, table.ratio(r, "varjax")) for x, r in table.rows), key=lambda t: t[1])
    table.check(f"varjax <= {RATIO_TARGET:g}x pure JAX", worst <= RATIO_TARGET,
                f"worst {worst:.2f}x at {table.key} {worst_x}")


def _below_linen_check(table: DepthTable) -> None:
    ratios = {x: r.ms["varjax"] / r.ms["Linen"] for x, r in table.rows}
    slower = [x for x, ratio in ratios.items() if ratio >= 1]
    table.check("varjax below Linen at every depth", not slower,
                f"varjax / Linen {min(ratios.values()):.2f}x..{max(ratios.values()):.2f}x"
                + (f"; varjax slower at {table.key} {', '.join(map(str, slower))}" if slower else ""))


def _once_check(table: DepthTable) -> None:
    counts = {lib: [r.traces[lib] for _, r in table.rows] for lib in LIBS}
    table.check("body traced once per level", all(n == 1 for n in counts["varjax"]),
                "body traces per trace, by " + table.key + ": "
                + "; ".join(f"{lib} {', '.join(map(str, ns))}" for lib, ns in counts.items()))


def _slope(t: dict[int, float], depths: range) -> float:
    """Least-squares slope of ``t`` over ``depths`` (ms per level)."""
    xs = np.array(depths, dtype=float)
    return float(np.polyfit(xs, [t[d] for d in depths], 1)[0])


def _slope_ratio(t: dict[int, float]) -> float:
    """Per-level increment over the deeper half of the depths / over the shallower half."""
    lo_d, hi_d = min(t), max(t)
    mid = (lo_d + hi_d) // 2
    shallow = max(_slope(t, range(lo_d, mid + 1)), 0.05 * t[lo_d])
    return _slope(t, range(mid, hi_d + 1)) / shallow


def _linear_check(table: DepthTable) -> None:
    ratio = {lib: _slope_ratio({x: r.ms[lib] for x, r in table.rows}) for lib in (*LIBS, "pure JAX")}
    d0, d1 = table.rows[0][0], table.rows[-1][0]
    mid = (d0 + d1) // 2
    table.check("linear in depth", ratio["varjax"] <= LINEAR_TARGET,
                f"per-level increment over depths {mid}..{d1} / over {d0}..{mid}: varjax "
                f"{ratio['varjax']:.2f}x <= {LINEAR_TARGET:g}x (Linen {ratio['Linen']:.2f}x, "
                f"pure JAX {ratio['pure JAX']:.2f}x)")


def _flat_check(table: DepthTable) -> None:
    (l0, r0), (l1, r1) = table.rows[0], table.rows[-1]
    growth = {lib: r1.ms[lib] / r0.ms[lib] for lib in (*LIBS, "pure JAX")}
    table.check("constant in length", growth["varjax"] <= FLAT_TARGET,
                f"t({l1}) / t({l0}): varjax {growth['varjax']:.2f}x <= {FLAT_TARGET:g}x "
                f"(Linen {growth['Linen']:.2f}x, pure JAX {growth['pure JAX']:.2f}x)")


# -- measuring ----------------------------------------------------------------------------------

def _measure(make: Callable[[Any, Counter], Any], stage: str, args: tuple,
             pure: Callable[..., Any]) -> _Row:
    """Time ``make_jaxpr`` of ``stage`` ('init' / 'apply') cold for every library and for
    ``pure``, and count body traces in one more cold trace per library."""
    def staged(model: Any) -> Any:
        method = model.init if stage == "init" else model.apply
        return jax.make_jaxpr(lambda *a: method(*a))(*args)

    # The harness runs gc.collect() before every timed call; over the objects JAX, Flax and
    # the earlier cases left behind that takes ~0.2 s on 2 cores, most of the suite's time.
    # Freezing them moves them out of the collector's sight (timed calls run with gc off
    # either way); ``run`` unfreezes them at the end.
    gc.freeze()
    cases = {"pure JAX": Case(lambda: jax.make_jaxpr(lambda *a: pure(*a))(*args))}
    for lib, nn in LIBS.items():
        cases[lib] = Case(staged, lambda nn=nn: (make(nn, Counter())(),))
    timings = compare(cases, reps=REPS)
    traces = {}
    for lib, nn in LIBS.items():
        counter = Counter()
        staged(make(nn, counter)())
        traces[lib] = counter.n
    return _Row({k: t.min * 1e3 for k, t in timings.items()}, traces)


def _variables(make: Callable[[Any, Counter], Any], key: jax.Array, x: jax.Array) -> Any:
    """Linen's variables for ``make`` (zeros: only their shapes matter for tracing)."""
    shapes = jax.eval_shape(make(flax.linen, Counter())().init, key, x)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def check_same_models(key: jax.Array) -> None:
    """Fail loudly unless the three implementations agree at depth 2: the same parameter
    tree, and the same outputs from Linen's parameters."""
    c = jax.random.normal(key, (WIDTH,))
    x = jax.random.normal(key, (AXIS, AXIS, BATCH, WIDTH))
    for make, inp, pure_init, pure_apply in [
            (lambda nn, n: vmap_model(nn, 2, n), x, pure_vmap_init,
             lambda p, x: pure_vmap_apply(p, x, 2)),
            (lambda nn, n: scan_model(nn, 2, n), c, pure_scan_init,
             lambda p, c: pure_scan_apply(p, c, 2)[0])]:
        variables = make(flax.linen, Counter())().init(key, inp)
        shapes = [jax.tree.map(lambda a: a.shape, v) for v in
                  (variables, make(varjax.nn, Counter())().init(key, inp), pure_init(key, inp, 2))]
        if not shapes[0] == shapes[1] == shapes[2]:
            raise AssertionError(f"Linen, varjax and pure JAX parameter trees differ: {shapes}")
        out = [make(nn, Counter())().apply(variables, inp) for nn in LIBS.values()]
        out = [o[0] if isinstance(o, tuple) else o for o in out]
        for o in (*out[1:], pure_apply(variables["params"], inp)):
            np.testing.assert_allclose(o, out[0], rtol=1e-5, atol=1e-5)


def run() -> list[Any]:
    try:
        return _run()
    finally:
        gc.unfreeze()


def _run() -> list[Any]:
    key = jax.random.key(0)
    check_same_models(key)
    c = jnp.ones((WIDTH,))
    tables = []
    cold = (f"make_jaxpr, cold (a new model class per repetition), min of {REPS} interleaved "
            "repetitions after one warm-up; 'body traces': runs of the innermost body's "
            "Python __call__ in one cold trace.")

    nested = [
        ("vmap", VMAP_DEPTHS, lambda d: jnp.ones((AXIS,) * d + (BATCH, WIDTH)), vmap_model,
         pure_vmap_init, pure_vmap_apply,
         f"Dense({WIDTH}) -> relu -> Dense({WIDTH}) in d levels of nn.vmap (axis size {AXIS} "
         f"each, params axis 0, params rngs split), input (2,)*d + ({BATCH}, {WIDTH}). Pure JAX: "
         "nested jax.vmap. "),
        ("scan", SCAN_DEPTHS, lambda d: c, scan_model, pure_scan_init, pure_scan_apply,
         f"Dense({WIDTH}) -> relu -> Dense({WIDTH}) as the step c -> (c, None) of d levels of "
         f"nn.scan (length {AXIS} each, params axis 0, params rngs split), carry ({WIDTH},). "
         "Pure JAX: nested jax.lax.scan. ")]
    for transform, depths, input_of, model, pure_init, pure_apply, what in nested:
        for stage in ("init", "apply"):
            table = DepthTable(f"Nested nn.{transform}: make_jaxpr of Module.{stage}", "depth",
                               what + cold)
            for d in depths:
                x = input_of(d)
                make = lambda nn, n, d=d, model=model: model(nn, d, n)  # noqa: E731
                if stage == "init":
                    args, pure = (key, x), lambda k, x, d=d, f=pure_init: f(k, x, d)
                else:
                    args = (_variables(make, key, x), x)
                    pure = lambda v, x, d=d, f=pure_apply: f(v["params"], x, d)  # noqa: E731
                table.add(d, _measure(make, stage, args, pure))
            _ratio_check(table)
            if transform == "vmap":
                _below_linen_check(table)
            _once_check(table)
            _linear_check(table)
            tables.append(table)

    table = DepthTable("Scan over layers: make_jaxpr of Module.init", "layers",
                       f"One nn.scan of length L over Dense({WIDTH}) -> relu -> Dense({WIDTH}) "
                       f"(params axis 0, params rngs split), carry ({WIDTH},). Pure JAX: one "
                       "jax.lax.scan. " + cold)
    for length in LAYERS:
        make = lambda nn, n, length=length: scan_model(nn, 1, n, length)  # noqa: E731
        pure = lambda k, c, length=length: pure_scan_init(k, c, 1, length)  # noqa: E731
        table.add(length, _measure(make, "init", (key, c), pure))
    _ratio_check(table)
    _once_check(table)
    _flat_check(table)
    tables.append(table)
    return tables
