"""The Tree Mode NNX design note's examples (shared/design/003), ported to varjax object mode,
with flax.nnx in tree mode as the oracle where the numbers can be compared."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from object_models import Foo, Lin, Probe, assert_tree_close

import varjax as vj
import varjax.nn as nn


@contextlib.contextmanager
def tree_mode():
    """nnx with the note's defaults: no graph mode, no graph updates."""
    with nnx.set_graph_mode(False), nnx.set_graph_updates(False):
        yield


# --- Prefix filters: split/merge instead of StateAxes ------------------------------------

def test_vmap_with_a_vectorized_and_a_broadcast_group_matches_nnx():
    kernels = jnp.arange(12.0, dtype=jnp.float32).reshape(2, 3, 2) / 10
    bias = jnp.array([0.5, -0.5])
    model = Lin().bind({"params": {"Dense_0": {"kernel": kernels, "bias": bias}}})
    x = jnp.arange(3.0, dtype=jnp.float32)

    graphdef, vectorized, broadcasted = vj.split(model, lambda path, v: path[-1] == "kernel", ...)

    @vj.vmap(in_axes=(0, None, None))
    def f(vectorized, broadcasted, x):
        model = vj.merge(graphdef, vectorized, broadcasted)
        return model(x)
    out = f(vectorized, broadcasted, x)

    with tree_mode():
        lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        lin.kernel = nnx.Param(kernels)
        lin.bias = nnx.Param(bias)
        ngraphdef, nvec, nbroad = nnx.split(lin, lambda path, v: path[-1] == "kernel", ...)

        @nnx.vmap(in_axes=(0, None, None))
        def g(vectorized, broadcasted, x):
            return nnx.merge(ngraphdef, vectorized, broadcasted)(x)
        expected = g(nvec, nbroad, x)
    np.testing.assert_allclose(out, expected, atol=1e-6)
    np.testing.assert_allclose(out, jnp.einsum("i,mio->mo", x, kernels) + bias[None], atol=1e-6)


# --- nnx.grad: the non-differentiable state is split off ----------------------------------

class LinBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False, momentum=0.5)(nn.Dense(2)(x))


class NnxLinBN(nnx.Module):
    def __init__(self, kernel, bias):
        self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.lin.kernel[...] = kernel
        self.lin.bias[...] = bias
        self.bn = nnx.BatchNorm(2, momentum=0.5, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.bn(self.lin(x))


X = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3) ** 1.3 / 10


def test_grad_of_params_with_non_differentiable_state_split_off_matches_nnx():
    variables = LinBN().init(jax.random.key(0), X)
    model = LinBN().bind(variables, mutable=["batch_stats"])
    graphdef, params, nondiff = vj.split(model, "params", ...)

    def loss_fn(params, nondiff):
        model = vj.merge(graphdef, params, nondiff)
        return jnp.sum(model(X)[:, 0] ** 3)
    grads = vj.grad(loss_fn)(params, nondiff)
    assert sorted(grads) == ["params"]

    p = variables["params"]["Dense_0"]
    with tree_mode():
        oracle = NnxLinBN(p["kernel"], p["bias"])
        ngraphdef, nparams, nnondiff = nnx.split(oracle, nnx.Param, ...)

        def nnx_loss(params, nondiff):
            return jnp.sum(nnx.merge(ngraphdef, params, nondiff)(X)[:, 0] ** 3)
        expected = nnx.grad(nnx_loss)(nparams, nnondiff)
    g = grads["params"]
    np.testing.assert_allclose(g["Dense_0"]["kernel"], expected["lin"]["kernel"][...], atol=1e-4)
    np.testing.assert_allclose(g["Dense_0"]["bias"], expected["lin"]["bias"][...], atol=1e-4)
    np.testing.assert_allclose(g["BatchNorm_0"]["scale"], expected["bn"]["scale"][...], atol=1e-4)
    np.testing.assert_allclose(g["BatchNorm_0"]["bias"], expected["bn"]["bias"][...], atol=1e-4)


def test_grad_of_a_model_without_non_differentiable_state_has_the_models_type():
    variables = Lin().init(jax.random.key(0), X)
    model = Lin().bind(variables)
    grads = vj.grad(lambda model: jnp.sum(model(X) ** 2))(model)
    assert type(grads) is Lin
    expected = jax.grad(lambda p: jnp.sum(Lin().apply(p, X) ** 2))(variables)
    assert_tree_close(grads.variables, expected, atol=1e-5)


# --- nnx.custom_vjp: bwd gets the output cotangent, returns the input's type ----------------

def test_custom_vjp_on_a_two_variable_module_matches_the_formula_and_nnx():
    variables = Foo().init(jax.random.key(0))
    m = Foo().bind(variables)

    @vj.custom_vjp
    def f(m):
        return jnp.sum(jnp.sin(m.x) * m.y)

    def f_fwd(m):
        return f(m), (jnp.cos(m.x), jnp.sin(m.x), m)

    def f_bwd(res, g):     # no gradients for updates
        cos_x, sin_x, m = res
        m_g = Foo().bind({"params": {"x": cos_x * g * m.y, "y": sin_x * g}})
        return (m_g,)      # Foo gradient
    f.defvjp(f_fwd, f_bwd)
    grads = vj.grad(f)(m)
    x, y = variables["params"]["x"], variables["params"]["y"]
    ex, ey = jax.grad(lambda x, y: jnp.sum(jnp.sin(x) * y), argnums=(0, 1))(x, y)
    assert type(grads) is Foo
    np.testing.assert_allclose(grads.variables["params"]["x"], ex, atol=1e-6)
    np.testing.assert_allclose(grads.variables["params"]["y"], ey, atol=1e-6)

    class NnxFoo(nnx.Module):
        def __init__(self):
            self.x = nnx.Param(x)
            self.y = nnx.Param(y)

    with tree_mode():
        @nnx.custom_vjp
        def nf(m):
            return jnp.sum(jnp.sin(m.x[...]) * m.y[...])

        def nf_fwd(m):
            return nf(m), (jnp.cos(m.x[...]), jnp.sin(m.x[...]), m)

        def nf_bwd(res, g):
            cos_x, sin_x, m = res
            m_g = nnx.clone(m)
            m_g.x[...] = cos_x * g * m.y[...]
            m_g.y[...] = sin_x * g
            return (m_g,)
        nf.defvjp(nf_fwd, nf_bwd)
        expected = nnx.grad(nf)(NnxFoo())
    np.testing.assert_allclose(grads.variables["params"]["x"], expected.x[...], atol=1e-6)


# --- Module.sow: nnx.capture ------------------------------------------------------------------

def test_capture_of_sow_matches_nnx_capture():
    class Sower(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.sow("intermediates", "y_mean", jnp.mean(x))
            return x

    class NnxSower(nnx.Module):
        def __call__(self, x):
            self.sow(nnx.Intermediate, "y_mean", jnp.mean(x))
            return x
    model = Sower().bind({})
    result, intermediates = vj.capture(model, "intermediates")(X)
    with tree_mode():
        expected_result, expected = nnx.capture(NnxSower(), nnx.Intermediate)(X)
    np.testing.assert_array_equal(result, expected_result)
    (mean,) = intermediates["intermediates"]["y_mean"]
    np.testing.assert_allclose(mean, expected["y_mean"].get_value()[0])
    assert "intermediates" not in model.variables


# --- Module.perturb: capture + grad(argnums=(0, 1)) inside a jitted train step ---------------

def test_train_step_with_perturbation_gradients_matches_linen():
    x = jnp.arange(8.0, dtype=jnp.float32).reshape(2, 4) / 8.0
    y = jnp.ones((2, 2))
    params = Probe().init(jax.random.key(0), x)["params"]
    model = Probe().bind({"params": params})

    @vj.jit
    def train_step(model, x, y):
        _, perturbs = vj.capture(model, "perturbations")(x)     # init perturbations

        def loss_fn(model, perturbs):
            y_pred = vj.capture(model, init=perturbs)(x)
            return jnp.mean((y_pred - y) ** 2)
        grads, interm_grads = vj.grad(loss_fn, argnums=(0, 1))(model, perturbs)
        graphdef, p = vj.split(model, "params")
        new = jax.tree.map(lambda a, g: a - 0.1 * g, p, vj.state(grads, "params"))
        return vj.merge(graphdef, new), interm_grads

    new_model, interm_grads = train_step(model, x, y)

    def ref(p, q):
        return jnp.mean((Probe().apply({"params": p, "perturbations": q}, x) - y) ** 2)
    zeros = {"grad_of_x": jnp.zeros((2, 4)), "h": jnp.zeros((2, 3))}
    gp, gq = jax.grad(ref, argnums=(0, 1))(params, zeros)
    assert_tree_close(interm_grads["perturbations"], gq)
    assert_tree_close(new_model.variables["params"],
                      jax.tree.map(lambda a, g: a - 0.1 * g, params, gp), atol=1e-5)
    assert sorted(model.variables) == ["params"]          # the perturbations were not kept
