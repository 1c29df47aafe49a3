"""``vj.Variable``: a held value with a collection and metadata, a pytree, and the same class
as the in-trace handles that ``vj.variable`` / ``Module.variable`` return."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn


def test_variable_holds_value_collection_and_metadata():
    v = vj.Variable(jnp.arange(3.0), collection="stats", out_sharding=("a", "b"), tag=1)
    np.testing.assert_array_equal(v.value, [0.0, 1.0, 2.0])
    assert v.collection == "stats"
    assert v.out_sharding == ("a", "b") and v.tag == 1
    assert v.get_metadata() == {"out_sharding": ("a", "b"), "tag": 1}
    assert v.shape == (3,) and v.dtype == jnp.float32     # the value's attributes


def test_variable_default_collection_is_params():
    assert vj.Variable(jnp.zeros(())).collection == "params"


def test_variable_indexing_reads_and_writes_the_value():
    v = vj.Variable(jnp.arange(3.0))
    assert float(v[1]) == 1.0
    np.testing.assert_array_equal(v[...], [0.0, 1.0, 2.0])
    v[1] = 5.0
    np.testing.assert_array_equal(v.value, [0.0, 5.0, 2.0])
    v[...] = jnp.zeros(3)
    np.testing.assert_array_equal(v.value, [0.0, 0.0, 0.0])
    v.value = jnp.ones(3)
    np.testing.assert_array_equal(v.value, [1.0, 1.0, 1.0])


def test_variable_is_a_pytree_whose_leaf_is_its_value():
    v = vj.Variable(jnp.arange(3.0), collection="stats", out_sharding=("a",))
    (leaf,) = jax.tree.leaves(v)
    assert leaf is v.value
    doubled = jax.tree.map(lambda a: a * 2, v)
    assert type(doubled) is vj.Variable and doubled is not v
    assert doubled.collection == "stats" and doubled.get_metadata() == {"out_sharding": ("a",)}
    np.testing.assert_array_equal(doubled.value, [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(v.value, [0.0, 1.0, 2.0])    # the original is untouched


def test_raw_jax_jit_accepts_a_variable():
    v = vj.Variable(jnp.arange(3.0))
    np.testing.assert_array_equal(jax.jit(lambda v: v.value * 2)(v), [0.0, 2.0, 4.0])
    out = jax.jit(lambda v: v)(v)
    assert type(out) is vj.Variable and out.collection == "params"


def test_variable_collection_must_be_a_string():
    with pytest.raises(TypeError):
        vj.Variable(jnp.zeros(()), collection=0)


def test_module_variable_handle_is_a_variable_and_keeps_working():
    class Counter(nn.Module):
        @nn.compact
        def __call__(self):
            n = self.variable("counts", "n", jnp.zeros, (), jnp.int32)
            assert isinstance(n, vj.Variable) and n.collection == "counts"
            n.value = n.value + 1
            n[...] = n[...] + 1
            return n.value

    variables = Counter().init(jax.random.key(0))
    out, updates = Counter().apply(variables, mutable=["counts"])
    assert int(variables["counts"]["n"]) == 2
    assert int(out) == 4 and int(updates["counts"]["n"]) == 4


def test_vj_variable_function_handle_keeps_working():
    def fn(x):
        acc = vj.variable("acc", "total", jnp.zeros, ())
        assert isinstance(acc, vj.Variable)
        acc.value = acc.value + x
        return acc.value

    f = vj.functionalize(fn)
    out, variables = f.init_with_output({}, jnp.float32(3.0))
    assert float(out) == 3.0 and float(variables["acc"]["total"]) == 3.0
