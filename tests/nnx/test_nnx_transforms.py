"""``nnx.jit``/``grad``/``value_and_grad``/``remat`` in graph mode, against flax.nnx: the same
gradients (a ``State`` of ``Param``s), the same updates written back to the caller's module."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx

X = jnp.arange(4.0).reshape(2, 2) / 3


def _model(lib):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
            self.calls = lib.BatchStat(jnp.zeros(()))

        def __call__(self, x):
            self.calls[...] += 1
            return jnp.tanh(self.lin(x))
    return Model(lib.Rngs(0))


def _loss(m, x):
    return jnp.sum(m(x) ** 2)


def _same(a, b):
    assert jax.tree.structure(nnx.to_pure_dict(a)) == jax.tree.structure(flax_nnx.to_pure_dict(b))
    assert jax.tree.all(jax.tree.map(lambda x, y: np.allclose(x, y, rtol=1e-6, atol=0),
                                     nnx.to_pure_dict(a), flax_nnx.to_pure_dict(b)))


def test_grad_of_a_module_is_the_state_of_its_params_and_other_updates_come_back():
    ours, theirs = _model(nnx), _model(flax_nnx)
    g, fg = nnx.grad(_loss)(ours, X), flax_nnx.grad(_loss)(theirs, X)
    assert isinstance(g, nnx.State) and type(g["lin"]["kernel"]) is nnx.Param
    _same(g, fg)
    assert float(ours.calls[...]) == float(theirs.calls[...]) == 1.0


def test_value_and_grad_over_an_array_and_a_module_with_aux():
    ours, theirs = _model(nnx), _model(flax_nnx)

    def loss(x, m):
        y = m(x)
        return jnp.sum(y), y.shape
    (v, aux), (gx, gm) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(X, ours)
    (fv, faux), (fgx, fgm) = flax_nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(X, theirs)
    assert float(v) == float(fv) and aux == faux
    np.testing.assert_allclose(gx, fgx, rtol=1e-6)     # XLA may fuse the two differently
    _same(gm, fgm)


def test_grad_with_a_diff_state_filter_differentiates_what_it_selects():
    ours = _model(nnx)
    g = nnx.grad(_loss, argnums=nnx.DiffState(0, nnx.PathContains("kernel")))(ours, X)
    assert list(g.flat()) == [("lin", "kernel")]


def test_jit_writes_variable_updates_back_and_matches_flax():
    ours, theirs = _model(nnx), _model(flax_nnx)
    step = nnx.jit(lambda m, x: m(x))
    for _ in range(2):
        np.testing.assert_array_equal(step(ours, X), flax_nnx.jit(lambda m, x: m(x))(theirs, X))
    assert float(ours.calls[...]) == 2.0


def test_jit_decorator_with_options_and_a_train_step_on_grads():
    ours, theirs = _model(nnx), _model(flax_nnx)

    def train(lib, m, x, lr):
        grads = lib.grad(_loss)(m, x)
        lib.update(m, jax.tree.map(lambda p, g: p - lr * g, lib.state(m, lib.Param), grads))
    step = nnx.jit(static_argnums=2)(lambda m, x, lr: train(nnx, m, x, lr))
    fstep = flax_nnx.jit(static_argnums=2)(lambda m, x, lr: train(flax_nnx, m, x, lr))
    step(ours, X, 0.1)
    fstep(theirs, X, 0.1)
    _same(nnx.state(ours), flax_nnx.state(theirs))


def test_unbuilt_options_are_refused_by_name():
    with pytest.raises(errors.NotProvidedError, match="reduce_axes"):
        nnx.grad(_loss, reduce_axes=("batch",))
    with pytest.raises(errors.TransformError, match="argnums names argument 3"):
        nnx.grad(_loss, argnums=3)(_model(nnx), X)


def test_remat_computes_what_the_plain_call_does():
    model = _model(nnx)
    want = jnp.tanh(model.lin(X))
    np.testing.assert_allclose(nnx.remat(lambda m, x: m(x))(model, X), want, rtol=1e-6)
    assert float(model.calls[...]) == 1.0


def _passes_mlp():
    import optax

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 4, rngs=rngs)
            self.l2 = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def test_jit_passes_run_on_an_nnx_train_step_stop_gradient_freezes_the_params():
    """``nnx.jit(step, passes=...)`` (beyond flax.nnx): the passes see every Variable of the
    step's objects, as ``apply(passes=...)`` sees a Linen model's."""
    x, y = jnp.ones((4, 3)), jnp.zeros((4, 2))
    model, optimizer = _passes_mlp()
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    step = nnx.jit(_train_step, passes="stop-gradient{collection=params}")
    losses = [float(step(model, optimizer, x, y)) for _ in range(2)]
    assert losses[0] == losses[1]
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                 before)
    assert int(optimizer.step[...]) == 2            # the rest of the step still ran
    free_model, free_opt = _passes_mlp()
    free = nnx.jit(_train_step)
    assert [float(free(free_model, free_opt, x, y)) for _ in range(2)][1] < losses[1]


def test_jit_passes_fake_quant_quantizes_the_kernels_an_nnx_step_reads():
    layer = nnx.Linear(3, 2, use_bias=False, rngs=nnx.Rngs(0))
    probe = jnp.eye(3)                                # the output is the kernel as read
    read = nnx.jit(lambda m, x: m(x), passes="fake-quant{bits=2}")(layer, probe)
    kernel = layer.kernel[...]
    assert not np.allclose(read, kernel)
    for column in np.asarray(read).T:               # 2 bits: at most 4 levels per channel
        assert len(np.unique(column)) <= 4
    np.testing.assert_allclose(read, kernel, atol=float(jnp.abs(kernel).max()) / 2)
