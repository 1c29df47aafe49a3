"""The Variable-centric object core: one ``Variable`` class hierarchy whose subclasses are
pytrees and nodes of their own class, mapped to collections by one registry."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from varjax.objects.nodes import is_node
from varjax.trace.variable import collection_of, variable_type


class Weight(vj.Variable, collection="weights"):
    pass


class Tally(vj.Variable):        # no collection given: its class name
    pass


# --- (a) one class hierarchy, one registry -----------------------------------------------

def test_subclass_registry_maps_class_to_collection_and_back():
    assert collection_of(Weight) == "weights" and variable_type("weights") is Weight
    assert collection_of(Tally) == "Tally" and variable_type("Tally") is Tally
    assert collection_of(vj.Variable) is None and variable_type("no-such") is vj.Variable
    assert Weight(jnp.ones(2)).collection == "weights"


def test_two_classes_claiming_one_collection_raise():
    with pytest.raises(vj.errors.InvalidVariablesError, match="already the collection of"):
        class Other(vj.Variable, collection="weights"):
            pass
    assert variable_type("weights") is Weight


def test_a_subclass_instance_given_another_collection_raises():
    with pytest.raises(vj.errors.InvalidVariablesError, match="its collection is 'weights'"):
        Weight(jnp.ones(2), collection="params")


def test_subclass_is_a_node_and_unflattens_as_its_class():
    w = Weight(jnp.ones(2), out_sharding=("a",))
    assert is_node(w)
    leaves, tree = jax.tree_util.tree_flatten(w)
    back = jax.tree_util.tree_unflatten(tree, [x * 2 for x in leaves])
    assert type(back) is Weight and back.get_metadata() == {"out_sharding": ("a",)}
    np.testing.assert_array_equal(back.value, [2.0, 2.0])


def test_subclass_round_trips_through_split_and_merge():
    graphdef, state = vj.split({"w": Weight(jnp.ones(2)), "t": Tally(jnp.zeros(()))})
    assert sorted(state) == ["Tally", "weights"]
    back = vj.merge(graphdef, state)
    assert type(back["w"]) is Weight and type(back["t"]) is Tally


def test_subclass_is_its_own_class_inside_and_after_jit():
    w, seen = Weight(jnp.ones(2)), []

    @vj.jit
    def step(w):
        seen.append(type(w))
        w.value = w.value + 1
        return w
    out = step(w)
    assert seen == [Weight] and type(out) is Weight
    np.testing.assert_array_equal(w.value, [2.0, 2.0])


def test_grad_of_a_subclass_is_the_subclass():
    g = vj.grad(lambda w: jnp.sum(w.value ** 2))(Weight(jnp.array([1.0, 2.0])))
    assert type(g) is Weight
    np.testing.assert_allclose(g.value, [2.0, 4.0])
