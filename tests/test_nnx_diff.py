"""Differential test: random NNX modules under ``flax.nnx`` and ``varjax.nnx``.

Each example draws a spec (``tests/nnx_diff/modules.py``): a tree of small ``nnx.Module``
classes built in ``__init__(self, rngs)`` from ``Linear`` / ``Conv`` / ``LayerNorm`` /
``BatchNorm`` / ``Dropout``, a user-defined ``Count`` Variable incremented in ``__call__``,
``nnx.List`` of layers and a child module shared at two attributes, and a stack of up to two
transforms around the forward: ``nnx.jit``, ``nnx.grad`` / ``nnx.value_and_grad`` of the
sum of what is inside, ``nnx.vmap`` over the batch with the module broadcast
(``in_axes=(None, 0)``), ``nnx.cond`` on the sign of the input's sum (the other branch runs on
``2 * x``), ``nnx.fori_loop`` of 2 steps carrying the module and the activation, ``nnx.remat``.
One source builds the classes against both libraries, and the test checks, from the same seed:

* construction: every Variable (``nnx.to_pure_dict(nnx.state(model))``: params, batch
  statistics, counters, the RNG streams' keys and counts) bit for bit;
* the transformed call in train mode, then in eval mode (``model.train()`` / ``.eval()``):
  its result (outputs, gradients as pure dicts) and every Variable afterwards, to 1e-5
  relative, and absolute relative to the largest value compared.  A float32 difference is
  recomputed by both libraries in float64, from the same Variables: it is roundoff when the
  float64 answers agree to 1e-9 (counted), otherwise the example fails.

A spec flax.nnx rejects (it raises while building or calling) is skipped
(``hypothesis.reject``); anything varjax raises where flax did not, or any difference, fails.

``VARJAX_NNX_EXAMPLES`` sets the number of examples (default 20, derandomized);
``make fuzz-nnx`` runs 1,000, records every failing example and prints the smallest of each
kind at the end (``VARJAX_NNX_KEEP_GOING=1``).
"""
from __future__ import annotations

import collections
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from hypothesis import reject

from varjax import nnx as vj_nnx

sys.path.insert(0, os.path.dirname(__file__))
from differential import Campaign  # noqa: E402
from nnx_diff import modules as M  # noqa: E402

RTOL = ATOL = 1e-5
RTOL64 = ATOL64 = 1e-9

_stats: collections.Counter = collections.Counter()    # the campaign's (differential.py)

# flax.nnx warns on Variable access styles it is deprecating; not what is compared here.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


# --- comparison ----------------------------------------------------------------------------

def pure(nnx, tree):
    """Nested dicts of arrays: States as ``to_pure_dict``, keys as their key data."""
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    if isinstance(tree, dict) or hasattr(tree, "items"):
        return {k: pure(nnx, v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return tuple(pure(nnx, v) for v in tree)
    if isinstance(tree, jax.Array) and jnp.issubdtype(tree.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(tree)
    return tree


def variables(nnx, model) -> dict:
    return pure(nnx, nnx.state(model))


def layout(tree) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): (tuple(np.shape(x)), str(jnp.result_type(x))) for p, x in flat}


def assert_layout(actual, expected, what: str, desc: str = "") -> None:
    a, e = layout(actual), layout(expected)
    if a != e:
        only_a = {k: v for k, v in a.items() if e.get(k) != v}
        only_e = {k: v for k, v in e.items() if a.get(k) != v}
        raise AssertionError(f"{what}: layout differs\n varjax only: {only_a}\n flax only:   {only_e}{desc}")


class Mismatch(AssertionError):
    """Values differ where layouts agree: float32 roundoff or a wrong answer (``_settle``)."""


def assert_close(actual, expected, what: str, desc: str = "", rtol: float = RTOL, atol: float = ATOL) -> None:
    assert_layout(actual, expected, what, desc)
    flat = jax.tree_util.tree_flatten_with_path(expected)[0]
    # Absolute tolerance relative to the largest value compared: a value that is zero in
    # exact arithmetic is float32 cancellation noise of the size of the terms that cancelled.
    scale = max([1.0] + [float(np.max(np.abs(np.asarray(e, np.float64)), initial=0.0)) for _, e in flat])
    for (path, e), a in zip(flat, jax.tree.leaves(actual)):
        try:
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(e, np.float64), rtol=rtol,
                                       atol=atol * scale, err_msg=f"{what}{jax.tree_util.keystr(path)}")
        except AssertionError as err:
            raise Mismatch(f"{what}: values differ{err}{desc}") from None


def assert_equal(actual, expected, what: str, desc: str = "") -> None:
    assert_layout(actual, expected, what, desc)
    flat = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, e), a in zip(flat, jax.tree.leaves(actual)):
        try:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e),
                                          err_msg=f"{what}{jax.tree_util.keystr(path)}")
        except AssertionError as err:
            raise AssertionError(f"{what}: values differ{err}{desc}") from None


class VarjaxFailure(AssertionError):
    pass


def _varjax(what: str, desc: str, fn, *args):
    """``fn(*args)``; an exception is a varjax-only failure (flax did this step)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - anything varjax raises here is the finding
        tb = "".join(traceback.format_exception_only(type(e), e)).strip()
        raise VarjaxFailure(f"{what}: varjax raised where flax did not\n{tb}{desc}") from e


def _flax(fn, *args):
    """``fn(*args)``; a spec flax rejects is skipped."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        _stats["flax rejected: " + type(e).__name__] += 1
        reject()


# --- the transform stack -------------------------------------------------------------------

def program(nnx, kinds: tuple):
    """``f(model, x)``: the forward with the transforms ``kinds`` around it, innermost first."""
    def f(m, x):
        return m(x)
    for kind in kinds:
        f = _wrap(nnx, kind, f)
    return f


def _wrap(nnx, kind: str, g):
    if kind == "jit":
        return nnx.jit(g)
    if kind == "remat":
        return nnx.remat(g)
    if kind == "vmap":
        return nnx.vmap(g, in_axes=(None, 0))
    if kind == "grad":
        return nnx.grad(lambda m, x: jnp.sum(g(m, x)))
    if kind == "value_and_grad":
        return nnx.value_and_grad(lambda m, x: jnp.sum(g(m, x)))
    if kind == "cond":
        return lambda m, x: nnx.cond(jnp.sum(x) > 0, g, lambda m, x: g(m, 2 * x), m, x)
    if kind == "fori_loop":
        return lambda m, x: nnx.fori_loop(0, 2, lambda i, c: (c[0], g(c[0], c[1])), (m, x))[1]
    raise ValueError(kind)


def _input(spec: M.Spec):
    return jnp.asarray(np.random.default_rng(spec.seed).standard_normal(spec.shape), jnp.float32)


def _models(spec: M.Spec, desc: str):
    f_model = _flax(lambda: M.build(flax_nnx, spec)(flax_nnx.Rngs(params=spec.seed, dropout=spec.seed + 1)))
    v_model = _varjax("construction", desc, lambda: M.build(vj_nnx, spec)(
        vj_nnx.Rngs(params=spec.seed, dropout=spec.seed + 1)))
    return f_model, v_model


# --- one example ---------------------------------------------------------------------------

def check_spec(spec: M.Spec) -> None:
    desc = "\n" + M.format_spec(spec)
    f_model, v_model = _models(spec, desc)
    f_vars = variables(flax_nnx, f_model)
    assert_equal(variables(vj_nnx, v_model), f_vars, "after construction", desc)
    x = _input(spec)
    f_run, v_run = program(flax_nnx, spec.transforms), program(vj_nnx, spec.transforms)
    for mode in ("train", "eval"):
        before = variables(flax_nnx, f_model)
        getattr(f_model, mode)()
        _varjax(f"model.{mode}()", desc, getattr(v_model, mode))
        f_out = pure(flax_nnx, _flax(f_run, f_model, x))
        v_out = pure(vj_nnx, _varjax(f"{mode} mode: the call", desc, v_run, v_model, x))
        what = f"{mode} mode, transforms {spec.transforms}: "
        want = (f_out, variables(flax_nnx, f_model))
        got = (v_out, variables(vj_nnx, v_model))
        for part, label in enumerate(("result", "variables after")):
            try:
                assert_close(got[part], want[part], what + label, desc)
            except Mismatch as m:
                _settle(m, spec, mode, before, x, part)
    _stats["checked"] += 1


def _settle(mismatch: Mismatch, spec: M.Spec, mode: str, before: dict, x, part: int) -> None:
    """Both libraries again in float64, from the Variables ``before`` the call (flax's, which
    were varjax's too: they are compared after construction and after each call).  Roundoff
    when the float64 answers agree to ``RTOL64``."""
    with jax.enable_x64(True), jax.numpy_dtype_promotion("standard"):
        answers = []
        for nnx in (flax_nnx, vj_nnx):
            try:
                model = M.build(nnx, spec)(nnx.Rngs(params=spec.seed, dropout=spec.seed + 1))
                state = nnx.state(model)
                nnx.replace_by_pure_dict(state, jax.tree.map(_wide, before))
                nnx.update(model, state)
                getattr(model, mode)()
                out = pure(nnx, program(nnx, spec.transforms)(model, _wide(x)))
                answers.append((out, variables(nnx, model))[part])
            except Exception as e:  # noqa: BLE001 - a float64 failure leaves the float32 one standing
                raise AssertionError(f"{mismatch}\n\n(the float64 recheck raised: "
                                     f"{type(e).__name__}: {e})") from None
    try:
        assert_close(answers[1], answers[0], "float64", rtol=RTOL64, atol=ATOL64)
    except Mismatch as m64:
        raise AssertionError(f"{mismatch}\n\nand in float64 too:{m64}") from None
    _stats["float32 roundoff (float64 agrees)"] += 1


def _wide(a):
    a = jnp.asarray(a)
    return a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a


# --- the test ------------------------------------------------------------------------------

CAMPAIGN = Campaign("nnx", M.specs(), check_spec,
                    lambda spec: sum(1 for _ in M.walk_ops(spec.root)) + len(spec.transforms),
                    M.format_spec, _stats)


def test_nnx_diff(report):
    CAMPAIGN.run(report)


# --- hand-written specs: one per transform, and the failures the fuzzer found --------------

def _spec(ops: tuple, transforms: tuple, shape=(2, 3, 2), seed: int = 3) -> M.Spec:
    return M.Spec(M.Node("Model", ops), shape, seed, transforms)


def _body(batch_norm: bool) -> tuple:
    """A counter, an nnx.List, a child; the child's BatchNorm where flax.nnx allows it (not
    under vmap with the module broadcast: train mode updates its statistics per member)."""
    child = (M.BatchNorm(3, 0.9),) if batch_norm else ()
    return (M.Linear(2, 3), M.Counter(), M.Seq((M.LayerNorm(3), M.Linear(3, 3))),
            M.Sub(M.Node("Block1", (*child, M.Conv(3, 2, 2)))))


_HAND = {
    **{f"{kind}_counter_list_child": _spec(_body(kind != "vmap"), (kind,)) for kind in M.TRANSFORMS},
    "jit_of_value_and_grad": _spec(_body(True), ("value_and_grad", "jit")),
    "fori_loop_in_vmap": _spec(_body(False), ("fori_loop", "vmap")),
    # Found by the fuzzer: a child module held at two attributes is in flax.nnx's state once,
    # at its first path; varjax's listed it at both.
    "shared_child_is_in_the_state_once": _spec(
        (M.Shared(M.Node("Block1", (M.Linear(2, 2),))),), ()),
    # Found by the fuzzer: flax.nnx's Dropout holds its RngStream at `rngs` (key, count);
    # varjax's held an Rngs at `rngs`, so the stream sat at `rngs/dropout` (fixed: a bare
    # RngStream is an object-mode node, held bare).
    "dropout_stream_path": _spec((M.Dropout(0.5),), ()),
    # Found by the fuzzer (with the two differences above set aside): two shared
    # children under nnx.cond in train mode; after the call the second one's BatchNorm mean
    # held the first one's Linear kernel (or a Dropout's stream count a float vector).
    "two_shared_children_under_cond": _spec(
        (M.Shared(M.Node("Block1", (M.Linear(3, 3),))), M.Shared(M.Node("Block2", (M.BatchNorm(3, 0.9),)))),
        ("cond",), shape=(2, 2, 3), seed=1),
}


@pytest.mark.parametrize("name", sorted(_HAND))
def test_hand_written(name):
    check_spec(_HAND[name])
