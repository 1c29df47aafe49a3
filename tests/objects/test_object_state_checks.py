"""``vj.merge`` / ``vj.update`` take only a state that fits the node, and take it whole.

A state from a typo'd dict, a bigger model or another architecture used to be merged or
written silently (extra variables dropped, wrong shapes stored until the next call failed),
and ``update`` wrote the variables it knew before raising for an unknown one.  Both now
raise at once, naming the variable, before building or writing anything; a wrong shape or
dtype kind is the ``VariableShapeError`` that ``apply`` raises for the same value.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from varjax import nn

X = jnp.ones((1, 3))
V5 = nn.Dense(5).init(jax.random.key(0), X)
V2 = nn.Dense(2).init(jax.random.key(0), X)


def _zeros(variables):
    return jax.tree.map(jnp.zeros_like, variables)


def _unchanged(model, variables):
    return all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(vj.state(model)),
                                                    jax.tree.leaves(variables)))


# --- merge: extra variables ----------------------------------------------------------------

def test_merge_names_each_extra_leaf_and_collection():
    graphdef, state = vj.split(nn.Dense(5).bind(V5))
    bigger = {"params": {**state["params"], "kernal": jnp.ones((3, 5))},
              "batch_stats": {"mean": jnp.zeros(5)}}
    with pytest.raises(vj.errors.TransformError) as e:
        vj.merge(graphdef, bigger)
    message = str(e.value)
    assert "kernal of collection 'params'" in message
    assert "mean of collection 'batch_stats'" in message
    assert e.value.collection == "params" and e.value.path == ("kernal",)
    assert "test_object_state_checks.py" in e.value.source


def test_merge_of_a_bigger_models_state_raises():
    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.Dense(3)(x))

    class One(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x)

    graphdef, _ = vj.split(One().bind(One().init(jax.random.key(0), X)))
    with pytest.raises(vj.errors.TransformError, match="Dense_1/kernel of collection 'params'"):
        vj.merge(graphdef, Two().init(jax.random.key(0), X))


# --- merge / update: types -----------------------------------------------------------------

def test_merge_of_another_architectures_state_raises_what_apply_raises():
    with pytest.raises(vj.errors.VariableShapeError):      # the oracle: apply's own check
        nn.Dense(5).apply(V2, X)
    graphdef, _ = vj.split(nn.Dense(5).bind(V5))
    with pytest.raises(vj.errors.VariableShapeError, match="float32\\[2\\].*float32\\[5\\]") as e:
        vj.merge(graphdef, V2)
    assert e.value.collection == "params" and e.value.path == ("bias",)
    assert "test_object_state_checks.py" in e.value.source


def test_merge_of_a_leaf_of_another_dtype_kind_raises():
    graphdef, state = vj.split(nn.Dense(5).bind(V5))
    state["params"]["kernel"] = state["params"]["kernel"].astype(jnp.int32)
    with pytest.raises(vj.errors.VariableShapeError, match="dtype is of another kind") as e:
        vj.merge(graphdef, state)
    assert e.value.path == ("kernel",)


def test_merge_takes_another_float_dtype_as_apply_does():
    graphdef, state = vj.split(nn.Dense(5).bind(V5))
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16), state)
    nn.Dense(5).apply(half, X)                               # the oracle takes it
    assert vj.merge(graphdef, half).variables["params"]["kernel"].dtype == jnp.bfloat16


def test_merge_inside_vmap_of_a_state_split_stacked_still_works():
    """A stacked state split outside vmap is merged per member inside it: the shapes
    differ by the stacking axis only, which is not a mismatch."""
    stacked = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), V5)
    graphdef, state = vj.split(nn.Dense(5).bind(stacked))
    out = jax.vmap(lambda s: vj.merge(graphdef, s)(X))(state)
    np.testing.assert_allclose(out[0], nn.Dense(5).apply(V5, X), rtol=1e-6)
    second = jax.tree.map(lambda a: a[1], stacked)
    np.testing.assert_allclose(out[1], nn.Dense(5).apply(second, X), rtol=1e-6)


def test_update_with_another_architectures_state_raises_and_writes_nothing():
    model = nn.Dense(5).bind(V5)
    with pytest.raises(vj.errors.VariableShapeError, match="float32\\[3,2\\].*float32\\[3,5\\]") as e:
        vj.update(model, {"params": {"kernel": V2["params"]["kernel"],
                                     "bias": jnp.zeros(5)}})
    assert e.value.path == ("kernel",)
    assert _unchanged(model, V5)


# --- update: all or nothing ----------------------------------------------------------------

def test_update_with_an_unknown_variable_writes_nothing():
    model = nn.Dense(5).bind(V5)
    new = _zeros(V5)
    new["params"]["zzz"] = jnp.ones(1)
    with pytest.raises(vj.errors.TransformError, match="zzz of collection 'params'"):
        vj.update(model, new)
    assert _unchanged(model, V5)


def test_update_caught_inside_jit_writes_nothing():
    model = nn.Dense(5).bind(V5)
    new = _zeros(V5)
    new["params"]["zzz"] = jnp.ones(1)

    def step(m, s):
        try:
            vj.update(m, s)
        except vj.errors.TransformError:
            pass
        return m(X)

    out = vj.jit(step)(model, new)
    assert _unchanged(model, V5)
    np.testing.assert_array_equal(out, nn.Dense(5).apply(V5, X))


# --- what a state needs --------------------------------------------------------------------

def test_state_of_a_string_says_what_it_got_and_what_a_state_needs():
    with pytest.raises(vj.errors.TransformError, match="vj.state: got a str \\('abc'\\)") as e:
        vj.state("abc")
    assert "bound module" in e.value.fix and "variables dict" in e.value.fix


def test_split_of_an_unbound_module_raises():
    with pytest.raises(vj.errors.TransformError, match="Dense module at enc is not bound") as e:
        vj.split({"enc": nn.Dense(2)})
    assert "bind" in e.value.fix and "init" in e.value.fix


@pytest.mark.parametrize("rngs, name, path", [("abc", "rngs", None),
                                              ({"dropout": "abc"}, "rngs\\['dropout'\\]", ("dropout",)),
                                              ({"dropout": 0}, "rngs\\['dropout'\\]", ("dropout",))])
def test_apply_with_rngs_that_are_no_keys_names_the_argument(rngs, name, path):
    with pytest.raises(vj.errors.InvalidVariablesError,
                       match=f"{name} is of type .*rngs may be a key, a dict of stream name to key, "
                             "or a vj.Rngs") as e:
        nn.Dropout(0.5, deterministic=False).apply({}, X, rngs=rngs)
    assert e.value.path == path
    assert "test_object_state_checks.py" in e.value.source
