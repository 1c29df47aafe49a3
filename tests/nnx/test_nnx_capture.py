"""``nnx.capture`` with ``Module.sow``/``Module.perturb``, against flax.nnx: the Tree Mode
note's workflows (sown intermediates; perturbations initialised by ``capture`` and
differentiated by ``nnx.grad`` inside ``nnx.jit``) give the same values at the same state
paths, and the module is left as it was."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.capturing import capture

X = jnp.arange(4.0).reshape(2, 2) / 3
Y = jnp.ones((2, 3))
CAPTURE = {nnx: capture, flax_nnx: flax_nnx.capture}


def _same(ours, theirs):
    a, b = nnx.to_pure_dict(ours), flax_nnx.to_pure_dict(theirs)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert jax.tree.all(jax.tree.map(lambda x, y: np.allclose(x, y, rtol=1e-6, atol=1e-7), a, b))


def _foo(lib):
    class Foo(lib.Module):
        def __call__(self, x):
            self.sow(lib.Intermediate, "y_mean", jnp.mean(x))
            return x
    return Foo()


def _model(lib):
    class Block(lib.Module):
        def __init__(self, rngs):
            self.linear = lib.Linear(2, 3, rngs=rngs)

        def __call__(self, x):
            h = self.perturb("h", self.linear(x))
            self.sow(lib.Intermediate, "h_sum", jnp.sum(h))
            return h

    class Model(lib.Module):
        def __init__(self, rngs):
            self.blocks = lib.List([Block(rngs)])
            self.out = lib.Linear(3, 3, rngs=rngs)

        def __call__(self, x):
            x = self.perturb("grad_of_x", x)
            h = self.blocks[0](x)
            self.sow(lib.Intermediate, "features", h)
            return self.out(jnp.tanh(h))
    return Model(lib.Rngs(0))


def test_the_notes_sow_example_returns_flax_intermediates():
    got = capture(_foo(nnx), nnx.Intermediate)(X)
    want = flax_nnx.capture(_foo(flax_nnx), flax_nnx.Intermediate)(X)
    np.testing.assert_array_equal(got[0], want[0])
    _same(got[1], want[1])


def test_intermediates_of_submodules_are_at_their_paths():
    model = _model(nnx)
    out, sown = capture(model, nnx.Intermediate)(X)
    flax_out, flax_sown = flax_nnx.capture(_model(flax_nnx), flax_nnx.Intermediate)(X)
    np.testing.assert_array_equal(out, flax_out)
    _same(sown, flax_sown)
    assert set(sown["blocks"][0]) == {"h_sum"} and type(sown["features"]) is nnx.Intermediate
    assert not hasattr(model, "__captures__") and "features" not in vars(model)


def test_the_notes_perturb_train_step_gives_flax_intermediate_gradients():
    results = []
    for lib in (nnx, flax_nnx):
        cap, model = CAPTURE[lib], _model(lib)
        optimizer = lib.Optimizer(model, optax.sgd(0.1), wrt=lib.Param)

        @lib.jit
        def train_step(model, optimizer, x, y):
            _, perturbs = cap(model, lib.Perturbation)(x)

            def loss_fn(model, perturbs):
                y_pred = cap(model, init=perturbs)(x)
                return jnp.mean((y_pred - y) ** 2)
            grads, interm_grads = lib.grad(loss_fn, argnums=(0, 1))(model, perturbs)
            optimizer.update(model, grads)
            return interm_grads
        results.append((train_step(model, optimizer, X, Y), lib.state(model, lib.Param)))
    (grads, params), (flax_grads, flax_params) = results
    _same(grads, flax_grads)
    _same(params, flax_params)
    assert set(grads) == {"blocks", "grad_of_x"} and type(grads["grad_of_x"]) is nnx.Perturbation


def test_perturbation_gradients_merge_with_sown_values_as_in_flax():
    results = []
    for lib in (nnx, flax_nnx):
        cap, model = CAPTURE[lib], _model(lib)
        _, perturbations = cap(model, lib.Perturbation)(X)

        def loss(model, perturbations, x, cap=cap, lib=lib):
            out, sown = cap(model, lib.Intermediate, init=perturbations)(x)
            return jnp.sum(out ** 2), sown
        (_, perturb_grads), sown = lib.grad(loss, argnums=(0, 1), has_aux=True)(
            model, perturbations, X)
        results.append(lib.merge_state(perturb_grads, sown))
    _same(*results)


def test_capture_as_a_decorator_of_a_function_taking_the_module_first():
    @capture(nnx.Intermediate)
    def forward(model, x):
        return model(x)

    @flax_nnx.capture(flax_nnx.Intermediate)
    def flax_forward(model, x):
        return model(x)
    _same(forward(_model(nnx), X)[1], flax_forward(_model(flax_nnx), X)[1])


def test_capture_of_two_types_returns_a_state_per_type():
    out, cached, perturbs = capture(_model(nnx), nnx.Cache, nnx.Perturbation)(X)
    _, flax_cached, flax_perturbs = flax_nnx.capture(_model(flax_nnx), flax_nnx.Cache,
                                                     flax_nnx.Perturbation)(X)
    assert cached == nnx.State({}) and not flax_cached
    assert set(perturbs) == {"blocks", "grad_of_x"}
    _same(perturbs, flax_perturbs)


def test_capture_of_intermediate_then_perturbation_puts_perturbations_first_as_flax():
    """A Perturbation is an Intermediate: the first type takes it, as flax.nnx's
    split_state does."""
    _, sown, perturbs = capture(_model(nnx), nnx.Intermediate, nnx.Perturbation)(X)
    _, flax_sown, flax_perturbs = flax_nnx.capture(
        _model(flax_nnx), flax_nnx.Intermediate, flax_nnx.Perturbation)(X)
    _same(sown, flax_sown)
    assert perturbs == nnx.State({}) and not flax_perturbs
    assert type(sown["grad_of_x"]) is nnx.Perturbation


def test_sow_of_a_type_not_captured_is_a_no_op_and_perturb_returns_the_value():
    class Probe(nnx.Module):
        def __call__(self, x):
            return self.sow(nnx.Cache, "seen", x), self.perturb("p", x)
    (sowed, perturbed), sown = capture(Probe(), nnx.Intermediate)(X)
    assert sowed is False and perturbed is X and len(sown) == 0


def test_capture_carries_sown_values_through_an_inner_nnx_jit():
    forward = nnx.jit(lambda model, x: model(x))
    flax_forward = flax_nnx.jit(lambda model, x: model(x))
    _same(capture(forward, nnx.Intermediate)(_model(nnx), X)[1],
          flax_nnx.capture(flax_forward, flax_nnx.Intermediate)(_model(flax_nnx), X)[1])


def _methods(lib):
    class Net(lib.Module):
        def features(self, x):
            return x * 2

        def classifier(self, x):
            return x + 1

        def __call__(self, x):
            return self.classifier(self.features(x))
    return Net()


def test_method_outputs_sows_each_methods_output_as_flax():
    model = _methods(nnx)
    got = capture(model, nnx.Intermediate, method_outputs=nnx.Intermediate)(X)
    want = flax_nnx.capture(_methods(flax_nnx), flax_nnx.Intermediate,
                            method_outputs=flax_nnx.Intermediate)(X)
    _same(got[1], want[1])
    assert set(got[1]) == {"features", "classifier", "__call__"}
    assert capture(model, nnx.Intermediate)(X)[1] == nnx.State({})    # methods restored


def test_capture_leaves_the_module_as_it_was_when_the_function_raises():
    model = _model(nnx)

    def broken(model, x):
        model(x)
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        capture(broken, nnx.Intermediate)(model, X)
    assert not any(hasattr(m, "__captures__") for _, m in nnx.iter_modules(model))


def test_capture_of_a_function_called_without_a_module_first_is_a_config_error():
    with pytest.raises(errors.ConfigError, match="first argument"):
        capture(lambda x: x, nnx.Intermediate)(X)


def test_capture_refuses_a_type_that_is_not_a_variable_type():
    with pytest.raises(errors.InvalidVariablesError, match="not a Variable type"):
        capture(_foo(nnx), "intermediates")


def test_sow_and_perturb_outside_capture_keep_their_value_in_an_attribute():
    model = _model(nnx)
    model(X)
    flax_model = _model(flax_nnx)
    with pytest.warns(DeprecationWarning):
        flax_model(X)
    _same(nnx.state(model), flax_nnx.state(flax_model))
    assert type(model.grad_of_x) is nnx.Perturbation and type(model.features) is nnx.Intermediate
