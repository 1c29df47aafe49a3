"""Object-mode ``vj.remat``: ``jax.checkpoint`` over objects; updates are written back and the
gradient through it is the gradient without it."""
import jax
import jax.numpy as jnp
import numpy as np
from object_models import Lin, X, assert_tree_close, bound

import varjax as vj


def test_remat_writes_back_updates():
    v = vj.Variable(jnp.ones(2), collection="c")

    @vj.remat
    def bump(v, x):
        v.value = v.value + x
        return jnp.sin(v.value).sum()
    np.testing.assert_allclose(bump(v, jnp.ones(2)), 2 * jnp.sin(2.0), atol=1e-6)
    np.testing.assert_array_equal(v.value, [2.0, 2.0])


def test_grad_of_remat_matches_jax_grad_of_apply():
    model, variables = bound(Lin())
    grads = vj.grad(vj.remat(lambda m, x: jnp.sum(jnp.sin(m(x)) ** 2)))(model, X)
    expected = jax.grad(lambda p: jnp.sum(jnp.sin(Lin().apply({"params": p}, X)) ** 2))(
        variables["params"])
    assert type(grads) is Lin
    assert_tree_close(grads.variables["params"], expected, atol=1e-5)
