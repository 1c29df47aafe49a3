"""FrozenDict, freeze and unfreeze against flax.core's, which Linen exports."""
import pickle

import flax.core
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import pytest

import varjax.nn as nn
from varjax.nn.frozen_dict import copy, freeze, pop, pretty_repr, unfreeze

RAW = {"params": {"b": {"kernel": 1.0}, "a": 2.0}, "stats": {}}


def test_frozen_dict_reads_like_linen_s():
    ours, theirs = nn.FrozenDict(RAW), flax_nn.FrozenDict(RAW)
    assert isinstance(ours["params"], nn.FrozenDict) and ours["params"]["b"]["kernel"] == 1.0
    assert list(ours) == list(theirs) and len(ours) == len(theirs) and "params" in ours
    assert ours.get("missing", 3) == 3 and ours == nn.FrozenDict(RAW)
    assert repr(ours) == repr(theirs)
    assert pretty_repr(ours) == flax.core.pretty_repr(theirs)
    assert hash(ours) == hash(nn.FrozenDict(RAW))


def test_frozen_dict_is_immutable_and_copies_what_it_is_given():
    raw = {"a": {"b": 1}}
    frozen = freeze(raw)
    raw["a"]["b"] = 2
    assert frozen["a"]["b"] == 1
    with pytest.raises(ValueError, match="immutable"):
        frozen["a"] = 3
    thawed = frozen.unfreeze()
    thawed["a"]["b"] = 5
    assert frozen["a"]["b"] == 1 and unfreeze(frozen) == {"a": {"b": 1}}


def test_copy_and_pop_return_new_dicts_as_linen_s_do():
    frozen = nn.FrozenDict(RAW)
    updated = frozen.copy({"stats": {"n": 1}})
    assert updated["stats"]["n"] == 1 and frozen["stats"] == {}
    rest, params = frozen.pop("params")
    assert list(rest) == ["stats"] and params == nn.FrozenDict(RAW["params"])
    assert copy(RAW, {"x": 1})["x"] == 1 and "x" not in RAW
    assert pop(RAW, "stats") == ({"params": RAW["params"]}, {}) and "stats" in RAW


def test_frozen_dict_is_a_pytree_with_linen_s_leaf_order_and_pickles():
    tree = {"b": jnp.ones(2), "a": {"z": jnp.zeros(1), "y": jnp.ones(3)}}
    ours, theirs = nn.FrozenDict(tree), flax_nn.FrozenDict(tree)
    assert [x.shape for x in jax.tree.leaves(ours)] == [x.shape for x in jax.tree.leaves(theirs)]
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ours)[0]] == \
        [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(theirs)[0]]
    doubled = jax.tree.map(lambda x: 2 * x, ours)
    assert isinstance(doubled, nn.FrozenDict) and float(doubled["b"][0]) == 2.0
    assert pickle.loads(pickle.dumps(ours)).unfreeze().keys() == tree.keys()


def test_apply_takes_frozen_variables():
    layer = nn.Dense(2)
    variables = layer.init(jax.random.key(0), jnp.ones((1, 3)))
    assert jnp.array_equal(layer.apply(freeze(variables), jnp.ones((1, 3))),
                           layer.apply(variables, jnp.ones((1, 3))))
