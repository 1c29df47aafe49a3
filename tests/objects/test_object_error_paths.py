"""The remaining object-mode error paths, each a ``varjax.errors`` class naming what is wrong."""
import jax.numpy as jnp
import pytest

import varjax as vj


def test_a_variable_created_outside_every_argument_object_raises():
    def creates(v, x):
        vj.variable("stats", "n", jnp.zeros, ())      # not under v: no object to keep it in
        return x
    with pytest.raises(vj.errors.TransformError, match="created outside every argument") as e:
        vj.jit(creates)(vj.Variable(jnp.ones(()), collection="stats"), jnp.ones(2))
    assert e.value.collection == "stats" and e.value.path == ("n",)


def test_split_of_a_bare_array_raises():
    with pytest.raises(vj.errors.TransformError, match="bare array"):
        vj.split(jnp.ones(2))


def test_merge_with_a_state_that_is_not_a_dict_raises():
    graphdef, _ = vj.split(vj.Variable(jnp.ones(2)))
    with pytest.raises(vj.errors.InvalidVariablesError, match="a state is a dict"):
        vj.merge(graphdef, [jnp.ones(2)])


def test_vmap_with_one_in_axes_entry_too_many_raises():
    v = vj.Variable(jnp.ones(3))
    with pytest.raises(vj.errors.TransformError, match="in_axes has 2 entries for 1 arguments"):
        vj.vmap(lambda v: v.value, in_axes=(0, 0))(v)


def test_a_non_array_output_raises_naming_where_it_is():
    with pytest.raises(vj.errors.TransformError, match=r"returned str 'done' at output \[1\]") as e:
        vj.jit(lambda v: (v.value, "done"))(vj.Variable(jnp.ones(2)))
    assert "test_object_error_paths.py" in str(e.value)
