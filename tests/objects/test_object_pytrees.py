"""Bound modules and ``vj.Rngs`` are pytrees whose leaves are their variables' values: a map
gives an object of the same class, and raw JAX transforms take them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from object_models import MLP, Lin, X, assert_tree_close, bound

import varjax as vj


def test_tree_map_over_bound_module_gives_bound_module_of_same_class():
    model, variables = bound(MLP(), mutable=["batch_stats"])
    doubled = jax.tree.map(lambda a: a * 2, model)
    assert type(doubled) is MLP and doubled is not model
    assert_tree_close(doubled.variables, jax.tree.map(lambda a: a * 2, variables))
    assert_tree_close(model.variables, variables)          # the original is untouched


def test_bound_module_leaves_are_exactly_its_variable_values():
    model, variables = bound(Lin())
    leaves = jax.tree.leaves(model)
    expected = jax.tree.leaves(variables)
    assert len(leaves) == len(expected)
    assert {id(x) for x in leaves} == {id(x) for x in expected}


def test_raw_jax_jit_takes_a_bound_module_and_matches_apply():
    model, variables = bound(Lin())
    out = jax.jit(lambda m, x: m(x))(model, X)
    np.testing.assert_allclose(out, Lin().apply(variables, X), atol=1e-6)
    same = jax.jit(lambda m: m)(model)
    assert type(same) is Lin
    assert_tree_close(same.variables, variables)


def test_raw_jax_grad_of_a_bound_module_is_a_bound_module_of_cotangents():
    model, variables = bound(Lin())
    grads = jax.grad(lambda m: jnp.sum(m(X) ** 2))(model)
    expected = jax.grad(lambda p: jnp.sum(Lin().apply({"params": p}, X) ** 2))(variables["params"])
    assert type(grads) is Lin
    assert_tree_close(grads.variables["params"], expected)


def test_raw_jax_vmap_over_a_stacked_bound_module():
    _, variables = bound(Lin())
    stacked = Lin().bind(jax.tree.map(lambda a: jnp.stack([a, 2 * a]), variables))
    out = jax.vmap(lambda m, x: m(x), in_axes=(0, None))(stacked, X[0])
    expected = jnp.stack([Lin().apply(jax.tree.map(lambda a: k * a, variables), X[0])
                          for k in (1.0, 2.0)])
    np.testing.assert_allclose(out, expected, atol=1e-6)


@pytest.mark.parametrize("to", [jax.typeof, lambda a: None],
                         ids=["avals", "none"])
def test_bound_module_mapped_to_non_array_leaves_flattens_again(to):
    # JAX unflattens pytrees with placeholder leaves (avals in lax.cond's output check,
    # None in prefix trees) and flattens them again; a pytree must allow that.
    model, _ = bound(Lin())
    mapped = jax.tree.map(to, model)
    assert type(mapped) is Lin
    leaves = jax.tree.leaves(mapped, is_leaf=lambda x: x is None)
    assert len(leaves) == 2


def test_variable_mapped_to_avals_flattens_again():
    v = vj.Variable(jnp.ones(2))
    (aval,) = jax.tree.leaves(jax.tree.map(jax.typeof, v))
    assert aval.shape == (2,)


def test_rngs_is_a_pytree_and_raw_jit_draws_like_eager():
    eager, traced = vj.Rngs(0), vj.Rngs(0)
    assert type(jax.tree.map(lambda a: a, traced)) is vj.Rngs
    assert len(jax.tree.leaves(traced)) == 2            # key and count of 'default'
    np.testing.assert_array_equal(jax.jit(lambda r: r.normal((2,)))(traced),
                                  eager.normal((2,)))


def test_template_module_is_one_opaque_leaf_rejected_by_raw_jit():
    template = Lin()
    assert len(jax.tree.leaves(template)) == 1
    with pytest.raises(TypeError):
        jax.jit(lambda m: 0)(template)
