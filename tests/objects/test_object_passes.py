"""``passes=`` on object mode's transforms besides ``vj.jit`` (grad, value_and_grad, vmap,
remat, cond, switch, while_loop, fori_loop, scan): the passes run on the transform's IR,
over every variable of its objects, as ``apply(passes=...)`` runs them on a model.  The
oracle is the computation by hand: kernels quantized with numpy, a zero gradient."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from varjax import errors

X = jnp.arange(8.0).reshape(4, 2) / 7 - 0.5
W = jnp.array([[0.3, -0.9], [0.6, 0.1]])
FAKE_QUANT = "fake-quant{bits=2}"


def _quantized(w) -> np.ndarray:
    """2-bit symmetric per-tensor fake quantization: levels -s, 0, s with s = max|w|."""
    w = np.asarray(w)
    scale = np.abs(w).max()
    return np.clip(np.round(w / scale), -1, 1) * scale


BY_HAND = X @ _quantized(W)


def _apply(w, x):
    return x @ w.value


def test_value_and_grad_stop_gradient_zeroes_the_grads_and_the_writes_still_happen():
    w, count = vj.Variable(W), vj.Variable(jnp.zeros(()), collection="counts")

    def loss(w, count):
        count.value = count.value + 1
        return jnp.sum(_apply(w, X) ** 2)
    value, grads = vj.value_and_grad(loss, passes="stop-gradient{collection=params}")(w, count)
    assert float(value) == pytest.approx(float(jnp.sum((X @ W) ** 2)), rel=1e-6)
    np.testing.assert_array_equal(grads.value, np.zeros((2, 2)))
    assert float(count.value) == 1.0
    free = vj.grad(loss)(w, count)
    assert np.any(np.asarray(free.value) != 0)


def test_grad_fake_quant_quantizes_the_read_with_a_straight_through_gradient():
    w = vj.Variable(W)
    g, out = vj.grad(lambda w: (jnp.sum(_apply(w, X) ** 2), _apply(w, X)), has_aux=True,
                     passes=FAKE_QUANT)(w)
    np.testing.assert_allclose(out, BY_HAND, rtol=1e-6)
    want = jax.grad(lambda k: jnp.sum((X @ k) ** 2))(jnp.asarray(_quantized(W)))
    np.testing.assert_allclose(g.value, want, rtol=1e-5)


def test_vmap_and_remat_passes_run_on_the_body():
    w = vj.Variable(W)
    out = vj.vmap(lambda w, x: x @ w.value, in_axes=(None, 0), passes=FAKE_QUANT)(w, X)
    np.testing.assert_allclose(out, BY_HAND, rtol=1e-6)
    np.testing.assert_allclose(vj.remat(_apply, passes=FAKE_QUANT)(w, X), BY_HAND, rtol=1e-6)


def test_branch_passes_run_on_the_branch_taken():
    w = vj.Variable(W)
    out = vj.cond(True, _apply, lambda w, x: -_apply(w, x), w, X, passes=FAKE_QUANT)
    np.testing.assert_allclose(out, BY_HAND, rtol=1e-6)
    out = vj.switch(0, [_apply, lambda w, x: -_apply(w, x)], w, X, passes=FAKE_QUANT)
    np.testing.assert_allclose(out, BY_HAND, rtol=1e-6)


def test_loop_passes_run_on_every_iteration():
    w = vj.Variable(W)
    twice = BY_HAND @ _quantized(W)
    _, out = vj.fori_loop(0, 2, lambda i, c: (c[0], c[1] @ c[0].value), (w, X),
                          passes=FAKE_QUANT)
    np.testing.assert_allclose(out, twice, rtol=1e-5)
    _, out, _ = vj.while_loop(lambda c: c[2] < 2, lambda c: (c[0], c[1] @ c[0].value, c[2] + 1),
                              (w, X, 0), passes=FAKE_QUANT)
    np.testing.assert_allclose(out, twice, rtol=1e-5)
    _, ys = vj.scan(lambda w, x: (w, x @ w.value), passes=FAKE_QUANT)(w, X)
    np.testing.assert_allclose(ys, BY_HAND, rtol=1e-6)


def test_lifted_value_and_grad_takes_passes_too():
    """The Linen form (``vj.grad(fn, mdl, *primals, passes=...)``) runs them on the body
    (``vj.lift``): the gradient with respect to ``x`` is the quantized kernel's row sums."""
    def program(x):
        def loss(x):
            return jnp.sum(x @ vj.param("w", lambda key, shape: W, (2, 2)))
        (g,) = vj.grad(loss, None, x, passes=FAKE_QUANT)
        return g
    f = vj.functionalize(program)
    g = f.apply(f.init(jax.random.key(0), X), X)
    np.testing.assert_allclose(g, np.broadcast_to(_quantized(W).sum(1), (4, 2)), rtol=1e-6)


def test_a_pass_option_matching_nothing_raises_pipeline_error():
    w = vj.Variable(W)
    with pytest.raises(errors.PipelineError, match="colection"):
        vj.grad(lambda w: jnp.sum(_apply(w, X)), passes="stop-gradient{collection=colection}")(w)
    with pytest.raises(errors.PipelineError, match="colection"):
        vj.vmap(_apply, in_axes=(None, 0), passes="fake-quant{collection=colection}")(w, X)
