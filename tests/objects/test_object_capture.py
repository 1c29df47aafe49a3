"""``vj.capture``: run a bound module or a function with collections captured -- what ``sow``
and ``Module.perturb`` write is returned, and the module is not modified; ``init=`` feeds
perturbations in, so their gradients are the gradients of the intermediates."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from object_models import Probe, assert_tree_close

import varjax as vj

X = jnp.arange(8.0, dtype=jnp.float32).reshape(2, 4) / 8.0
TARGET = jnp.ones((2, 2))


@pytest.fixture(scope="module")
def probe():
    variables = Probe().init(jax.random.key(0), X)
    params = {"params": variables["params"]}
    return Probe().bind(params), params


def test_capture_of_sow_matches_linen_mutable_intermediates(probe):
    model, params = probe
    out, captured = vj.capture(model, "intermediates")(X)
    expected, state = Probe().apply(params, X, mutable=["intermediates"])
    np.testing.assert_allclose(out, expected, atol=1e-6)
    assert_tree_close(captured, state)
    assert sorted(captured["intermediates"]) == ["h", "y_mean"]


def test_capture_does_not_modify_the_module(probe):
    model, params = probe
    before = jax.tree.leaves(model.variables)
    vj.capture(model, "intermediates", "perturbations")(X)
    assert sorted(model.variables) == ["params"]
    assert all(a is b for a, b in zip(jax.tree.leaves(model.variables), before))


def test_capture_of_several_collections(probe):
    model, _ = probe
    _, captured = vj.capture(model, "intermediates", "perturbations")(X)
    assert jax.tree.map(jnp.shape, captured["perturbations"]) == {"grad_of_x": (2, 4),
                                                                  "h": (2, 3)}
    assert all(float(jnp.abs(p).max()) == 0.0 for p in jax.tree.leaves(captured["perturbations"]))


def test_capture_of_a_function_prefixes_paths_with_the_argument_name(probe):
    model, _ = probe

    def double(net, x):
        return net(x) * 2
    out, captured = vj.capture(double, "intermediates")(model, X)
    assert sorted(captured["intermediates"]) == ["net"]
    assert sorted(captured["intermediates"]["net"]) == ["h", "y_mean"]
    np.testing.assert_allclose(out, 2 * model(X), atol=1e-6)


def test_capture_with_only_init_returns_just_the_output(probe):
    model, _ = probe
    _, perturbs = vj.capture(model, "perturbations")(X)
    out = vj.capture(model, init=perturbs)(X)
    assert isinstance(out, jax.Array)
    np.testing.assert_allclose(out, model(X), atol=1e-6)


def test_capture_inside_jit(probe):
    model, params = probe
    out, captured = vj.jit(lambda m, x: vj.capture(m, "intermediates")(x))(model, X)
    _, state = Probe().apply(params, X, mutable=["intermediates"])
    assert_tree_close(captured, state)


def _perturb_loss(model, perturbs):
    y = vj.capture(model, init=perturbs)(X)
    return jnp.mean((y - TARGET) ** 2)


def test_perturbation_gradients_match_linen_jax_grad(probe):
    model, params = probe
    _, perturbs = vj.capture(model, "perturbations")(X)
    grads, perturb_grads = vj.grad(_perturb_loss, argnums=(0, 1))(model, perturbs)

    def ref(p, q):
        y = Probe().apply({"params": p, "perturbations": q}, X)
        return jnp.mean((y - TARGET) ** 2)
    ep, eq = jax.grad(ref, argnums=(0, 1))(params["params"], perturbs["perturbations"])
    assert type(grads) is Probe
    assert_tree_close(perturb_grads["perturbations"], eq)
    assert_tree_close(grads.variables["params"], ep)


def test_perturbation_gradients_match_nnx_capture():
    class NnxProbe(nnx.Module):
        def __init__(self, kernel, bias):
            self.lin = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
            self.lin.kernel[...] = kernel
            self.lin.bias[...] = bias

        def __call__(self, x):
            self.sow(nnx.Intermediate, "y_mean", jnp.mean(x))
            x = self.perturb("grad_of_x", x)
            return self.lin(x)

    from object_models import Lin
    variables = Lin().init(jax.random.key(1), X)
    model = Lin().bind(variables)

    def forward(net, x):
        vj.sow("intermediates", "y_mean", jnp.mean(x))
        return net(x + vj.variable("perturbations", "grad_of_x", jnp.zeros_like, x).value)

    def loss(net, perturbs):
        return jnp.mean((vj.capture(forward, init=perturbs)(net, X) - TARGET) ** 2)
    out, captured = vj.capture(forward, "intermediates", "perturbations")(model, X)
    perturbs = {"perturbations": captured["perturbations"]}
    _, pgrads = vj.grad(loss, argnums=(0, 1))(model, perturbs)

    p = variables["params"]["Dense_0"]
    with nnx.set_graph_mode(False), nnx.set_graph_updates(False):
        oracle = NnxProbe(p["kernel"], p["bias"])
        expected_out, inter = nnx.capture(oracle, nnx.Intermediate)(X)
        _, nnx_perturbs = nnx.capture(oracle, nnx.Perturbation)(X)

        def nnx_loss(m, perturbs):
            return jnp.mean((nnx.capture(m, init=perturbs)(X) - TARGET) ** 2)
        _, expected = nnx.grad(nnx_loss, argnums=(0, 1))(oracle, nnx_perturbs)
    np.testing.assert_allclose(out, expected_out, atol=1e-6)
    np.testing.assert_allclose(captured["intermediates"]["y_mean"][0],
                               inter["y_mean"].get_value()[0])
    np.testing.assert_allclose(pgrads["perturbations"]["grad_of_x"],
                               expected["grad_of_x"][...], atol=1e-6)


@pytest.mark.parametrize("inner", ["jit", "remat"])
def test_capture_sees_sows_inside_a_nested_object_mode_transform(probe, inner):
    model, params = probe

    def forward(net, x):
        return getattr(vj, inner)(lambda net, x: net(x))(net, x)
    _, captured = vj.capture(forward, "intermediates")(model, X)
    _, state = Probe().apply(params, X, mutable=["intermediates"])
    assert_tree_close(captured, {"intermediates": {"net": state["intermediates"]}})


def test_capture_without_collections_or_init_raises(probe):
    model, _ = probe
    with pytest.raises(vj.errors.TransformError):
        vj.capture(model)
