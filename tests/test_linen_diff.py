"""Differential test: random Linen-style modules under ``flax.linen`` and ``varjax.nn``.

Each example draws a spec (``tests/linen_diff/modules.py``): a tree of small module classes,
``setup`` or ``@compact`` style, made of ``Dense`` / ``Conv`` / ``BatchNorm`` / ``LayerNorm`` /
``Dropout`` layers, ``self.param``, ``sow``, in-place counters, and child modules under up to
two nested lifted ``remat`` / ``jit`` / ``vmap`` / ``scan`` / ``cond`` / ``while_loop`` with
their variable options.  One source builds the classes against both libraries, and the test
checks

* ``init`` (``train=True``, so dropout draws from its stream): the same variables layout
  (collections, paths, shapes, dtypes).  Both inits are traced abstractly (``jax.eval_shape``),
  and varjax's is also executed for a fifth of the examples.  Values are not compared:
  initial parameters come from each library's own RNG derivation, which differs by design
  (``notes/modules.md``);
* ``apply`` (``train=False``: dropout deterministic, since masks differ for the same reason)
  of *both* libraries to the *same* variables: random values in Linen's layout (positive
  running variances), minus the collections the spec has apply re-create, with the spec's
  ``mutable=``: the outputs and mutated collections;
* ``jax.grad`` of ``sum(output)`` w.r.t. the params (``jax.jvp`` along a random direction
  when a ``while_loop`` is in the model: reverse mode cannot cross it, in either library);
* ``jax.jit`` of varjax's apply and derivative, against Linen's;
* when the model has a dropout of rate > 0, ``apply(train=True)``: the layout of the output
  and of the mutated collections only.

Linen runs under ``jax.jit`` (one compilation per example instead of one per lifted call),
varjax both eagerly (its apply) and under ``jax.jit``.  Tolerances are 1e-5, relative, and
absolute relative to the largest value compared.

A spec Linen rejects (it raises in ``init`` or ``apply``) is skipped (``hypothesis.reject``);
anything varjax raises where Linen did not, or any difference, fails the test.

``VARJAX_LINEN_EXAMPLES`` sets the number of examples (default 20, derandomized);
``make fuzz-linen`` runs 3,000 and the session prints ``fuzz-linen: N examples checked``.
"""
from __future__ import annotations

import collections
import os
import re
import sys
import traceback

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, reject, settings

import varjax.nn as vj_nn

sys.path.insert(0, os.path.dirname(__file__))
from linen_diff import modules as M  # noqa: E402

_ENV = "VARJAX_LINEN_EXAMPLES"
EXAMPLES = int(os.environ.get(_ENV, "20"))
# CI (no env var): a fixed example sequence.  An explicit count (`make fuzz-linen`): fresh randomness.
DERANDOMIZE = os.environ.get("VARJAX_LINEN_DERANDOMIZE", "1" if _ENV not in os.environ else "0") == "1"
# `make fuzz-linen`: a failing example is recorded and the run goes on, so one run lists every
# kind of failure; the test fails at the end, with the smallest spec of each kind.  Otherwise
# (CI) the first failure fails the test and hypothesis shrinks it.
KEEP_GOING = os.environ.get("VARJAX_LINEN_KEEP_GOING", "0") == "1"
RTOL = ATOL = 1e-5

_stats: collections.Counter = collections.Counter()
_failures: dict[str, list] = {}     # failure kind -> [(spec size, spec, message)], KEEP_GOING only
_failure_counts: collections.Counter = collections.Counter()

# Flax warns when it sees a jax.Array where it used to see a FrozenDict, and on lifted
# transforms over modules with no variables; neither is about what is compared here.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


# --- comparison ----------------------------------------------------------------------------

def plain(tree):
    """Nested dicts all the way down (Linen may return FrozenDicts); tuples kept."""
    if hasattr(tree, "items"):
        return {k: plain(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(plain(v) for v in tree)
    return tree


def layout(tree) -> dict:
    """``{path: (shape, dtype)}``."""
    flat = jax.tree_util.tree_flatten_with_path(plain(tree))[0]
    return {jax.tree_util.keystr(p): (tuple(np.shape(x)), str(jnp.result_type(x))) for p, x in flat}


def assert_layout(actual, expected, what: str) -> None:
    a, e = layout(actual), layout(expected)
    if a != e:
        only_a = {k: v for k, v in a.items() if e.get(k) != v}
        only_e = {k: v for k, v in e.items() if a.get(k) != v}
        raise AssertionError(f"{what}: layout differs\n varjax only: {only_a}\n linen only:  {only_e}")


def assert_close(actual, expected, what: str) -> None:
    actual, expected = plain(actual), plain(expected)
    assert_layout(actual, expected, what)
    flat = jax.tree_util.tree_flatten_with_path(expected)[0]
    # Absolute tolerance relative to the largest value compared: a value that is zero in
    # exact arithmetic (the gradient through a normalization of a bias before it) is
    # float32 cancellation noise of the size of the terms that cancelled.
    scale = max([1.0] + [float(np.max(np.abs(np.asarray(e, np.float64)), initial=0.0)) for _, e in flat])
    for (path, e), a in zip(flat, jax.tree.leaves(actual)):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=RTOL,
                                   atol=ATOL * scale, err_msg=f"{what}{jax.tree_util.keystr(path)}")


def random_variables(shapes, seed: int) -> dict:
    """Values for the variables layout ``shapes`` (``jax.ShapeDtypeStruct`` leaves): standard
    normal floats, positive running variances, small counts.  Every value is random, so
    none that is trivial at init (zero biases, unit scales) can hide a difference."""
    rng = np.random.default_rng(seed)

    def value(path, s):
        if jnp.issubdtype(s.dtype, jnp.integer):
            return jnp.asarray(rng.integers(0, 4, s.shape), s.dtype)
        x = rng.standard_normal(s.shape).astype(np.float32)
        if jax.tree_util.keystr(path).endswith("['var']"):
            x = np.exp(0.5 * x)
        return jnp.asarray(x, s.dtype)
    return jax.tree_util.tree_map_with_path(value, plain(shapes))


def _key(seed: int):
    # RBG keys: XLA:CPU compiles threefry init programs several times slower; the key
    # implementation is orthogonal to what is compared here.
    return jax.random.key(seed, impl="rbg")


class VarjaxFailure(AssertionError):
    pass


def _varjax(what: str, desc: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; an exception is a varjax-only failure (Linen did this step)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - anything varjax raises here is the finding
        tb = "".join(traceback.format_exception_only(type(e), e)).strip()
        raise VarjaxFailure(f"{what}: varjax raised where Linen did not\n{tb}{desc}") from e


def _linen(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; a spec Linen rejects is skipped."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        _stats["linen rejected: " + type(e).__name__] += 1
        reject()


# --- one example ---------------------------------------------------------------------------

def _derivative(model, mutable, variables, x, tangent):
    """``d sum(out) / d params``: ``jax.grad``, or ``jax.jvp`` along ``tangent`` when given."""
    def loss(params):
        out = model.apply({**variables, "params": params}, x, mutable=mutable)
        return jnp.sum(out if mutable is False else out[0])
    if tangent is None:
        return jax.grad(loss)(variables["params"])
    return jax.jvp(loss, (variables["params"],), (tangent,))[1]


def check_spec(spec: M.Spec) -> None:
    desc = "\n" + M.format_spec(spec)
    f_cls, v_cls = M.build(flax_nn, spec), M.build(vj_nn, spec)
    x = M.data(spec.shape, spec.seed)
    rngs = {"params": _key(spec.seed), "dropout": _key(spec.seed + 1)}
    drop = {"dropout": _key(spec.seed + 5)}
    f_mut, v_mut = M.mutable_arg(flax_nn, spec), M.mutable_arg(vj_nn, spec)
    f_model, v_model = f_cls(), v_cls()
    with_dropout = M.uses_dropout(spec.root)

    # init, train=True: the dropout stream is drawn from.  Layout only (values come from each
    # library's own RNG derivation), so both are traced abstractly, without compiling.
    f_vars = _linen(jax.eval_shape, f_cls(train=True).init, rngs, x)
    v_vars = _varjax("init", desc, jax.eval_shape, v_cls(train=True).init, rngs, x)
    assert_layout(v_vars, f_vars, "init" + desc + "\nvariables")
    if spec.seed % 5 == 0:      # and for a fifth of the examples, the real thing
        v_vars = _varjax("init", desc, v_cls(train=True).init, rngs, x)
        assert_layout(v_vars, f_vars, "init (executed)" + desc + "\nvariables")

    # The variables both libraries are applied to: random values in Linen's layout.
    variables = random_variables(f_vars, spec.seed + 2)
    variables = {c: v for c, v in variables.items() if c not in spec.drop}
    tangent = None
    if M.has_op(spec.root, M.While) and variables.get("params"):
        # Reverse mode cannot cross a while_loop (in either library): forward mode instead.
        rng = np.random.default_rng(spec.seed + 3)
        tangent = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype),
                               variables["params"])

    def run_all(model, train_model, mutable):
        """apply (train=False), d sum(out)/d params, and apply(train=True) when dropout."""
        def f(variables, x):
            out = model.apply(variables, x, mutable=mutable)
            d = _derivative(model, mutable, variables, x, tangent) if variables.get("params") else None
            train = (train_model.apply(variables, x, rngs=drop, mutable=mutable)
                     if with_dropout else None)
            return out, d, train
        return f

    # Linen runs under jax.jit: one compilation for the whole check instead of one per
    # lifted transform call (a spec it rejects raises at trace time all the same).
    f_out, f_d, f_train = plain(_linen(jax.jit(run_all(f_model, f_cls(train=True), f_mut)),
                                       variables, x))

    # apply, train=False (dropout deterministic: the masks differ by design), eager.
    v_out = _varjax("apply", desc, v_model.apply, variables, x, mutable=v_mut)
    assert_close(v_out, f_out, f"apply(mutable={spec.mutable})" + desc + "\n(out, mutated)")

    # Under jax.jit: apply again, the derivative, and apply(train=True).
    v_jit, v_d, v_train = _varjax("jax.jit(apply)", desc, jax.jit(run_all(v_model, v_cls(train=True), v_mut)),
                                  variables, x)
    assert_close(v_jit, f_out, "jax.jit(apply)" + desc + "\n(out, mutated)")
    what = "jvp w.r.t. params" if tangent is not None else "grad w.r.t. params"
    assert_close(v_d, f_d, what + desc)
    # apply, train=True: the dropout masks differ, so layout only.
    assert_layout(v_train, f_train, "apply(train=True)" + desc + "\n(out, mutated)")

    _stats["checked"] += 1
    for kind in M.lifts(spec.root):
        _stats["with " + kind] += 1
    if _stats["checked"] % 200 == 0:    # every example compiles new programs: bound the caches
        jax.clear_caches()


# --- the test ------------------------------------------------------------------------------

@settings(max_examples=EXAMPLES, deadline=None, derandomize=DERANDOMIZE, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.filter_too_much])
@given(M.specs())
def _fuzz(spec: M.Spec) -> None:
    if not KEEP_GOING:
        check_spec(spec)
        return
    try:
        check_spec(spec)
    except AssertionError as e:
        _record(spec, e)


def _kind(e: AssertionError) -> str:
    """A failure's kind: the step and the error's first line, with numbers and names of
    variables taken out, so that one bug in different models is one kind."""
    lines = str(e).splitlines()
    head = " | ".join(line for line in lines[:2] if line.strip())
    head = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", head)
    return re.sub(r"'[^']*'|\[[^\]]*\]", "*", head)[:160]


def _record(spec: M.Spec, e: AssertionError) -> None:
    _stats["FAILED"] += 1
    _failure_counts[_kind(e)] += 1
    size = sum(1 for _ in M.walk_ops(spec.root))
    found = _failures.setdefault(_kind(e), [])
    found.append((size, spec, str(e)))
    found.sort(key=lambda f: f[0])
    del found[3:]


def test_linen_diff(report):
    before = collections.Counter(_stats)
    _failures.clear()
    _failure_counts.clear()
    try:
        _fuzz()
    finally:
        counts = collections.Counter(_stats)
        counts.subtract(before)
        extra = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "checked" and v)
        report(f"fuzz-linen: {counts['checked']} examples checked ({extra})")
    if _failures:
        kinds = [f"{_failure_counts[kind]} example(s) of: {kind}\n\n{found[0][2]}"
                 for kind, found in sorted(_failures.items())]
        pytest.fail(f"{counts['FAILED']} failing examples, {len(_failures)} kinds; the smallest of each:\n\n"
                    + ("\n\n" + "=" * 100 + "\n\n").join(kinds), pytrace=False)


# --- hand-written specs: one per lifted transform, and the failures the fuzzer found -------

def _lift(kind: str, **opts) -> M.Lift:
    return M.Lift(kind, M.options(opts))


def _spec(root_ops: tuple, shape=(2, 3, 2), mutable=("list", ()), drop=(), style="compact") -> M.Spec:
    return M.Spec(M.Node("Model", style, root_ops), shape, 3, mutable, drop)


_HAND = {
    # Found by the fuzzer: a setup-built counter in a scan body whose params are broadcast
    # (created by varjax's peeled first step) was missing at init (MissingVariableError).
    "scan_setup_counter_broadcast_params": _spec(
        (M.Sub(M.Node("Block", "setup", (M.Counter("counter", "n0", "int"), M.Dense(2)), scan_body=True),
               _lift("scan", variable_axes={"counter": 0}, variable_broadcast="params",
                     split_rngs={"params": False}, in_axes=0, out_axes=0)),),
        mutable=("list", ("counter",))),
    # Found by the fuzzer: children named in a compact method and created before a cond (so
    # that the branches create nothing), then built again by name in the branches: the second
    # branch raised NameInUseError.
    "cond_children_created_before_the_cond": _spec(
        (M.Cond(M.Node("Block", "compact", (M.Dense(2),)), M.Node("Cell", "compact", (M.Dense(2),)),
                pre_init=True),)),
    "vmap_batchnorm_axis_name": _spec(
        (M.Sub(M.Node("Block", "setup", (M.BatchNorm(False, 0.9, False, "batch0"), M.Dense(3))),
               _lift("vmap", variable_axes={"params": 0, "batch_stats": 0}, split_rngs={"params": True},
                     in_axes=0, out_axes=0, axis_name="batch0")),),
        mutable=("list", ("batch_stats",))),
    "remat_jit_sow_put_counter": _spec(
        (M.Sub(M.Node("Block", "compact", (M.Sow("a", False), M.Sub(
            M.Node("Cell", "setup", (M.Counter("stats", "n0", "put"), M.Dense(2))), _lift("jit")),
            M.Sow("a", True))), _lift("remat", policy="dots")),),
        mutable=("list", ("intermediates", "stats")), style="setup"),
    "while_batchnorm_carry": _spec(
        (M.While(M.Node("Block", "setup",
                        (M.BatchNorm(False), M.Dense(2), M.Counter("counter", "n0", "int"))),
                 2, ("batch_stats", "counter"), ("params",)),),
        mutable=("list", ("batch_stats", "counter"))),
    "scan_axes_auto_batchnorm_dropout": _spec(
        (M.Sub(M.Node("Core", "compact", (M.BatchNorm("auto"), M.Counter("counter", "n0", "float"),
                                          M.Dropout(0.5, True)), scan_body=True),
               _lift("scan", variable_axes={"params": 0, "batch_stats": 0, "counter": 0},
                     split_rngs={"params": True, "dropout": True}, in_axes=1, out_axes=0, reverse=True,
                     unroll=2)),),
        mutable=("deny", ("params",)), drop=("counter",)),
    "lifted_method_and_function_forms": _spec(
        (M.Sub(M.Node("Cell", "setup", (M.Dense(2), M.Counter("counter", "n0", "int"))),
               M.Lift("jit", form="method")),
         M.Sub(M.Node("Block", "compact", (M.Dense(2),)),
               M.Lift("vmap", M.options({"variable_axes": {"params": None}, "split_rngs": {"params": False},
                                         "in_axes": 1, "out_axes": 1}), form="fn"))),
        mutable=("list", ("counter",))),
    "one_module_called_twice": _spec(
        (M.Dense(2), M.Sub(M.Node("Block", "compact", (M.BatchNorm(False), M.Dense(2))), _lift("remat")),
         M.Reuse(1, M.Sub(M.Node("Block", "compact", (M.BatchNorm(False), M.Dense(2))), _lift("remat"))),
         M.Reuse(0, M.Dense(2))),
        mutable=("list", ("batch_stats",)), style="setup"),
}


@pytest.mark.parametrize("name", sorted(_HAND))
def test_hand_written(name):
    check_spec(_HAND[name])
