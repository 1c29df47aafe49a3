"""``vj.update``: a state written into objects in place (NNX's ``nnx.update``), eagerly and
inside an object-mode transform."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from object_models import MLP, assert_tree_close, bound

import varjax as vj


def test_update_writes_a_state_into_a_bound_module_and_a_variable():
    model, variables = bound(MLP(), mutable=["batch_stats"])
    v = vj.Variable(jnp.zeros(2), collection="counts")
    new = jax.tree.map(lambda a: a + 1, variables["params"])
    vj.update({"model": model, "v": v}, {"params": {"model": new}, "counts": {"v": jnp.ones(2)}})
    assert_tree_close(model.variables["params"], new)
    np.testing.assert_array_equal(v.value, jnp.ones(2))


def test_update_inside_vj_jit_is_an_sgd_step_equal_to_pure_jax():
    model, variables = bound(MLP(), mutable=["params", "batch_stats"])
    x, tx = jax.random.normal(jax.random.key(1), (4, 3)), optax.sgd(0.1)

    @vj.jit
    def step(model, x):
        grads = vj.grad(lambda m: jnp.mean(m(x) ** 2))(model)
        params = vj.state(model, "params")
        vj.update(model, optax.apply_updates(params, tx.update(vj.state(grads, "params"),
                                                               tx.init(params))[0]))

    def loss(p):
        out, _ = MLP().apply({**variables, "params": p}, x, mutable=["batch_stats"])
        return jnp.mean(out ** 2)
    grads = jax.grad(loss)(variables["params"])
    step(model, x)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))   # a real step
    assert_tree_close(model.variables["params"],
                      jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads))


def test_update_with_a_path_that_is_no_variable_of_the_node_raises():
    model, _ = bound(MLP())
    with pytest.raises(vj.errors.TransformError, match="vj.update: variable nope") as e:
        vj.update(model, {"params": {"nope": jnp.zeros(2)}})
    assert e.value.collection == "params" and e.value.path == ("nope",)
