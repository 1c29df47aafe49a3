"""Object-mode ``vj.grad`` / ``vj.value_and_grad``: every float variable of the ``argnums``
arguments is differentiated, the gradient has the argument's type, integer leaves get
``float0``, and updates made in the loss are written back."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from object_models import MLP, Lin, X, assert_tree_close, bound

import varjax as vj
import varjax.nn as nn


def test_grad_of_a_variable_is_a_variable():
    v = vj.Variable(jnp.arange(3.0), collection="w", out_sharding=("a",))
    g = vj.grad(lambda v: jnp.sum(v.value ** 2))(v)
    assert type(g) is vj.Variable and g is not v
    assert g.collection == "w" and g.get_metadata() == {"out_sharding": ("a",)}
    np.testing.assert_array_equal(g.value, [0.0, 2.0, 4.0])


def test_grad_of_a_bound_module_matches_jax_grad_of_apply_and_writes_batch_stats():
    model, variables = bound(MLP(), mutable=["batch_stats"])

    def loss(model, x):
        return jnp.sum(model(x) ** 2)
    grads = vj.grad(loss)(model, X)

    def ref(params):
        out, updates = MLP().apply({**variables, "params": params}, X, mutable=["batch_stats"])
        return jnp.sum(out ** 2), updates
    expected, updates = jax.grad(ref, has_aux=True)(variables["params"])
    assert type(grads) is MLP
    assert_tree_close(grads.variables["params"], expected, atol=1e-5)
    # every float variable is differentiated: the running stats too (unused in training: 0)
    assert jax.tree.map(jnp.shape, grads.variables["batch_stats"]) == jax.tree.map(
        jnp.shape, variables["batch_stats"])
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads.variables["batch_stats"]))
    assert_tree_close(model.variables["batch_stats"], updates["batch_stats"])


def test_grad_of_a_bound_module_matches_nnx_grad_of_linear():
    model, variables = bound(Lin())
    p = variables["params"]["Dense_0"]
    grads = vj.grad(lambda m: jnp.sum(m(X) ** 2))(model)
    with nnx.set_graph_mode(False), nnx.set_graph_updates(False):
        lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        lin.kernel[...] = p["kernel"]
        lin.bias[...] = p["bias"]
        expected = nnx.grad(lambda m: jnp.sum(m(X) ** 2))(lin)
    assert type(expected) is nnx.Linear          # tree mode: the input's type, as here
    g = grads.variables["params"]["Dense_0"]
    np.testing.assert_allclose(g["kernel"], expected.kernel[...], atol=1e-5)
    np.testing.assert_allclose(g["bias"], expected.bias[...], atol=1e-5)


def test_integer_variables_get_float0_and_are_still_updated():
    class Counted(nn.Module):
        @nn.compact
        def __call__(self, x):
            n = self.variable("counter", "n", jnp.zeros, (), jnp.int32)
            n.value = n.value + 1
            return nn.Dense(2)(x)
    model, variables = bound(Counted(), mutable=["counter"])
    start = int(model.variables["counter"]["n"])
    grads = vj.grad(lambda m: m(X).sum())(model)
    assert grads.variables["counter"]["n"].dtype == jax.dtypes.float0
    assert grads.variables["params"]["Dense_0"]["kernel"].dtype == jnp.float32
    assert int(model.variables["counter"]["n"]) == start + 1


def test_argnums_tuple_differentiates_each_argument():
    v = vj.Variable(jnp.arange(3.0))
    n = vj.Variable(jnp.arange(3), collection="ints")
    gv, gn = vj.grad(lambda v, n: jnp.sum(v.value * n.value.astype(jnp.float32)),
                     argnums=(0, 1))(v, n)
    np.testing.assert_array_equal(gv.value, [0.0, 1.0, 2.0])
    assert type(gn) is vj.Variable and gn.value.dtype == jax.dtypes.float0


def test_argument_not_in_argnums_is_not_differentiated_but_is_updated():
    v = vj.Variable(jnp.arange(3.0))
    steps = vj.Variable(jnp.zeros(()), collection="count")

    def loss(v, steps):
        steps.value = steps.value + 1.0
        return jnp.sum(v.value * steps.value)
    g = vj.grad(loss)(v, steps)
    assert type(g) is vj.Variable
    np.testing.assert_array_equal(g.value, [1.0, 1.0, 1.0])
    assert float(steps.value) == 1.0


def test_has_aux_and_value_and_grad():
    v = vj.Variable(jnp.arange(3.0))
    (value, aux), g = vj.value_and_grad(lambda v: (jnp.sum(v.value), v.value * 2),
                                        has_aux=True)(v)
    assert float(value) == 3.0
    np.testing.assert_array_equal(aux, [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(g.value, [1.0, 1.0, 1.0])
    g, aux = vj.grad(lambda v: (jnp.sum(v.value ** 2), 7.0), has_aux=True)(v)
    np.testing.assert_array_equal(g.value, [0.0, 2.0, 4.0])
    assert aux == 7.0
    value, g = vj.value_and_grad(lambda v: jnp.sum(v.value ** 2))(v)
    assert float(value) == 5.0


def test_grad_of_a_pytree_of_variables_has_the_same_structure():
    tree = {"a": vj.Variable(jnp.ones(2)), "b": vj.Variable(jnp.full((2,), 2.0))}
    g = vj.grad(lambda t: jnp.sum(t["a"].value * t["b"].value))(tree)
    assert sorted(g) == ["a", "b"] and all(type(x) is vj.Variable for x in g.values())
    np.testing.assert_array_equal(g["a"].value, [2.0, 2.0])
    np.testing.assert_array_equal(g["b"].value, [1.0, 1.0])


def test_grad_with_respect_to_a_state_dict():
    model, variables = bound(Lin())
    graphdef, params = vj.split(model)
    g = vj.grad(lambda p: jnp.sum(vj.merge(graphdef, p)(X) ** 2))(params)
    expected = jax.grad(lambda p: jnp.sum(Lin().apply(p, X) ** 2))(variables)
    assert_tree_close(g, expected, atol=1e-5)


def test_linen_only_options_of_grad_raise_in_object_mode():
    with pytest.raises(vj.errors.TransformError):
        vj.grad(lambda v: jnp.sum(v.value), variables="params")
