"""``passes=`` on the NNX transforms beyond ``nnx.jit`` (beyond flax.nnx), and the IR of an
NNX step for ``vj.dump``/``vj.pretty``.

The passes run on the transform's IR as ``apply(passes=...)`` runs them on a Linen model.
The oracle of a pass is the same step computed by hand (kernels quantized with numpy, a
gradient that is zero); the oracle of the rest of the step (its loss, a BatchNorm's
statistics) is flax.nnx running the same model from the same seed (eagerly: an ulp apart
from a traced step, in both libraries).
"""
from __future__ import annotations

import flax.nnx as fnnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import varjax as vj
from varjax import errors, nnx

X = jnp.arange(8.0).reshape(4, 2) / 7 - 0.5
FAKE_QUANT = "fake-quant{bits=2}"


def _quantized(w: np.ndarray) -> np.ndarray:
    """2-bit symmetric per-tensor fake quantization: levels -s, 0, s with s = max|w|."""
    scale = np.abs(w).max()
    return np.clip(np.round(w / scale), -1, 1) * scale


def _by_hand(layer, x):
    """``layer(x)`` computed with its kernel quantized by hand (the bias is rank 1: kept)."""
    return x @ _quantized(np.asarray(layer.kernel[...])) + layer.bias[...][None]


class Net(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(2, 3, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.linear(x))


class FlaxNet(fnnx.Module):
    def __init__(self, rngs):
        self.linear = fnnx.Linear(2, 3, rngs=rngs)
        self.bn = fnnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.linear(x))


def _loss(model):
    return jnp.mean(model(X) ** 2)


def test_value_and_grad_stop_gradient_zeroes_the_param_grads_while_the_step_runs():
    """An eager ``nnx.value_and_grad`` train step with ``stop-gradient{collection=params}``:
    every Param gradient is zero, and the loss, the BatchNorm statistics it writes and the
    optimizer's count are flax.nnx's for the same step."""
    model, theirs = Net(nnx.Rngs(0)), FlaxNet(fnnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    loss, grads = nnx.value_and_grad(_loss, passes="stop-gradient{collection=params}")(model)
    optimizer.update(model, grads)
    want_loss, want_grads = fnnx.value_and_grad(_loss)(theirs)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)   # jitted vs eager: an ulp
    assert any(np.any(g != 0) for g in jax.tree.leaves(want_grads))   # it would move them
    for g in jax.tree.leaves(nnx.to_pure_dict(grads)):
        np.testing.assert_array_equal(g, np.zeros_like(g))
    jax.tree.map(np.testing.assert_array_equal,
                 nnx.to_pure_dict(nnx.state(model, nnx.Param)), before)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)),
                 fnnx.to_pure_dict(fnnx.state(theirs, fnnx.BatchStat)))
    assert int(optimizer.step[...]) == 1


def test_grad_fake_quant_quantizes_the_kernels_read_with_a_straight_through_gradient():
    layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    grads, out = nnx.grad(lambda m: (jnp.sum(m(X) ** 2), m(X)), has_aux=True,
                          passes=FAKE_QUANT)(layer)
    want = _by_hand(layer, X)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert not np.allclose(out, layer(X))
    kernel_q = jnp.asarray(_quantized(np.asarray(layer.kernel[...])))
    want_grad = jax.grad(lambda k: jnp.sum((X @ k + layer.bias[...][None]) ** 2))(kernel_q)
    np.testing.assert_allclose(grads["kernel"][...], want_grad, rtol=1e-5)


def test_cond_and_switch_passes_run_on_the_branch_taken():
    layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    want = _by_hand(layer, X)
    out = nnx.cond(True, lambda m, x: m(x), lambda m, x: -m(x), layer, X, passes=FAKE_QUANT)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    out = nnx.switch(1, [lambda m, x: -m(x), lambda m, x: m(x)], layer, X, passes=FAKE_QUANT)
    np.testing.assert_allclose(out, want, rtol=1e-6)


def test_loop_passes_run_on_every_iteration_of_the_body():
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    twice = _by_hand(layer, _by_hand(layer, X))
    _, out = nnx.fori_loop(0, 2, lambda i, c: (c[0], c[0](c[1])), (layer, X), passes=FAKE_QUANT)
    np.testing.assert_allclose(out, twice, rtol=1e-5)
    _, out, _ = nnx.while_loop(lambda c: c[2] < 2, lambda c: (c[0], c[0](c[1]), c[2] + 1),
                               (layer, X, 0), passes=FAKE_QUANT)
    np.testing.assert_allclose(out, twice, rtol=1e-5)


def test_remat_passes_run_on_the_checkpointed_function():
    layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    out = nnx.remat(lambda m, x: m(x), passes=FAKE_QUANT)(layer, X)
    np.testing.assert_allclose(out, _by_hand(layer, X), rtol=1e-6)


def test_jvp_and_vjp_passes_run_before_jax_differentiates():
    """Without graph updates, as flax.nnx runs them: the output is the quantized layer's,
    and the tangent (cotangent) of ``x`` goes through the quantized kernel."""
    layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    kernel_q = _quantized(np.asarray(layer.kernel[...]))
    ones = jnp.ones_like(X)
    still = jax.tree.map(jnp.zeros_like, layer)        # the layer's tangent: none
    out, tangent = nnx.jvp(lambda m, x: m(x), (layer, X), (still, ones), graph_updates=False,
                           passes=FAKE_QUANT)
    np.testing.assert_allclose(out, _by_hand(layer, X), rtol=1e-6)
    np.testing.assert_allclose(tangent, ones @ kernel_q, rtol=1e-6)
    out, back = nnx.vjp(lambda m, x: m(x), layer, X, graph_updates=False, passes=FAKE_QUANT)
    np.testing.assert_allclose(out, _by_hand(layer, X), rtol=1e-6)
    _, cotangent = back(jnp.ones_like(out))
    np.testing.assert_allclose(cotangent, jnp.ones_like(out) @ kernel_q.T, rtol=1e-6)


def test_a_pass_option_matching_nothing_raises_pipeline_error():
    model = Net(nnx.Rngs(0))
    with pytest.raises(errors.PipelineError, match="batch_stat"):
        nnx.grad(_loss, passes="stop-gradient{collection=batch_stat}")(model)
    with pytest.raises(errors.PipelineError, match="batch_stat"):
        nnx.cond(True, lambda m: m(X), lambda m: m(X), model,
                 passes="stop-gradient{collection=batch_stat}")


# --- the IR of an NNX step ----------------------------------------------------------------

def _step(model, x):
    return jnp.sum(model(x))


def test_dump_of_an_nnx_step_names_reads_and_writes_by_module_path():
    """``vj.dump(step, model, x)`` traces a plain function over NNX objects as the object
    transforms do: Variable reads and writes (a BatchNorm's statistics) at their module
    paths, then the IR after each pass, the writes discharged at the end; nothing runs."""
    model = Net(nnx.Rngs(0))
    stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    entries = vj.dump(_step, model, X, source=False)
    names = [name for name, _ in entries]
    assert names[0] == "effectful" and names[-1] == "discharge"
    effectful = dict(entries)["effectful"]
    for read in ("params:model/linear/kernel", "params:model/linear/bias",
                 "params:model/bn/scale", "batch_stats:model/bn/mean"):
        assert f"var_get[{read}]" in effectful
    for write in ("batch_stats:model/bn/mean", "batch_stats:model/bn/var"):
        assert f"var_set[{write}]" in effectful
    assert "var_set" not in dict(entries)["discharge"]
    jax.tree.map(np.testing.assert_array_equal,
                 nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)), stats)


def test_dump_of_an_nnx_module_is_the_ir_of_its_call():
    model = Net(nnx.Rngs(0))
    assert vj.dump(model, X, source=False) == vj.dump(lambda model, x: model(x), model, X,
                                                       source=False)


def test_dump_of_a_jitted_nnx_step_runs_its_passes_and_the_extra_ones(tmp_path):
    model = Net(nnx.Rngs(0))
    step = nnx.jit(_step, passes=FAKE_QUANT)
    entries = vj.dump(step, model, X, passes="stop-gradient{collection=params}",
                      source=False, to=tmp_path)
    names = [name for name, _ in entries]
    assert "fake-quant" in names and "stop-gradient" in names
    assert "var_set[batch_stats:model/bn/var]" in dict(entries)["effectful"]
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "00-effectful.txt").read_text().splitlines()[1] == "// effectful"


def test_dump_of_an_object_mode_step_over_vj_variables():
    w, count = vj.Variable(jnp.ones((2, 2))), vj.Variable(jnp.zeros(()), collection="counts")

    def step(w, count, x):
        count.value = count.value + 1
        return x @ w.value

    effectful = dict(vj.dump(step, w, count, X, source=False))["effectful"]
    assert "var_get[params:w]" in effectful and "var_set[counts:count]" in effectful
    assert float(count.value) == 0.0


def test_make_jaxpr_effectful_is_the_ir_vj_pretty_prints():
    model = Net(nnx.Rngs(0))
    jaxpr = nnx.make_jaxpr(_step, effectful=True)(model, X)
    text = vj.pretty(jaxpr)
    assert "var_get[params:model/linear/kernel]" in text
    assert "var_set[batch_stats:model/bn/mean]" in text
    assert "Var[batch_stats]" in text.splitlines()[0]      # the effect set, first line
    jitted = vj.pretty(nnx.make_jaxpr(nnx.jit(_step), effectful=True)(model, X))
    assert "var_set[batch_stats:model/bn/mean]" in jitted  # the IR nnx.jit runs


def test_dump_refuses_linen_inputs_for_an_nnx_step():
    model = Net(nnx.Rngs(0))
    with pytest.raises(errors.TransformError, match="variables, mutable"):
        vj.dump(_step, model, X, variables={}, mutable=True)
    with pytest.raises(errors.ConfigError, match="static_argnums"):
        nnx.make_jaxpr(_step, effectful=True, static_argnums=1)


def test_vmap_passes_run_on_the_body_for_every_member():
    layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    out = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0), passes=FAKE_QUANT)(layer, X)
    np.testing.assert_allclose(out, _by_hand(layer, X), rtol=1e-6)


def test_scan_passes_run_on_every_step():
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    _, ys = nnx.scan(lambda m, x: (m, m(x)), passes=FAKE_QUANT)(layer, X)
    np.testing.assert_allclose(ys, _by_hand(layer, X), rtol=1e-6)
