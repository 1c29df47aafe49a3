"""``vj.split`` / ``vj.merge`` / ``vj.state``: a node as a hashable graphdef and states in the
variables-dict layout, sorted by filters (first match wins)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from object_models import MLP, assert_tree_close, bound

import varjax as vj


def _shapes(tree):
    return jax.tree.map(jnp.shape, tree)


@pytest.fixture(scope="module")
def mlp():
    return bound(MLP(), mutable=["batch_stats"])


def test_split_without_filters_gives_the_bound_modules_variables_dict(mlp):
    model, variables = mlp
    graphdef, state = vj.split(model)
    assert_tree_close(state, variables)
    assert vj.state(model).keys() == variables.keys()


def test_merge_gives_a_bound_module_of_the_same_class_holding_the_state(mlp):
    model, variables = mlp
    graphdef, params, rest = vj.split(model, "params", ...)
    assert list(params) == ["params"] and list(rest) == ["batch_stats"]
    new = vj.merge(graphdef, jax.tree.map(lambda a: a + 1, params), rest)
    assert type(new) is MLP and new is not model
    assert_tree_close(new.variables["params"], jax.tree.map(lambda a: a + 1, variables["params"]))
    assert_tree_close(new.variables["batch_stats"], variables["batch_stats"])
    x = jnp.ones((2, 3))
    np.testing.assert_allclose(
        new(x), MLP().apply({**variables, "params": jax.tree.map(lambda a: a + 1,
                                                                 variables["params"])},
                            x, mutable=["batch_stats"])[0], atol=1e-5)


def test_variables_dict_is_its_own_state(mlp):
    _, variables = mlp
    graphdef, stats, params = vj.split(variables, "batch_stats", True)
    assert _shapes(stats) == _shapes({"batch_stats": variables["batch_stats"]})
    assert _shapes(params) == _shapes({"params": variables["params"]})
    merged = vj.merge(graphdef, stats, params)
    assert type(merged) is dict
    assert_tree_close(merged, variables)


def test_state_of_a_pytree_of_nodes_is_prefixed_by_the_key_path():
    tree = {"a": vj.Variable(jnp.ones(2)), "b": [vj.Variable(jnp.zeros(()), collection="c")]}
    assert _shapes(vj.state(tree)) == {"params": {"a": (2,)}, "c": {"b": {"0": ()}}}
    _, picked, _ = vj.split(tree, lambda path, v: path == ("c", "b", "0"), ...)
    assert _shapes(picked) == {"c": {"b": {"0": ()}}}
    model, _ = bound(MLP())
    assert _shapes(vj.state({"enc": model}, "batch_stats")) == {
        "batch_stats": {"enc": {"BatchNorm_0": {"mean": (4,), "var": (4,)}}}}


def test_bare_variable_state_sits_at_its_collection():
    v = vj.Variable(jnp.arange(2.0), collection="stats", out_sharding=("a",))
    graphdef, state = vj.split(v)
    assert _shapes(state) == {"stats": (2,)}
    back = vj.merge(graphdef, {"stats": jnp.zeros(2)})
    assert type(back) is vj.Variable and back is not v
    assert back.collection == "stats" and back.out_sharding == ("a",)
    np.testing.assert_array_equal(back.value, [0.0, 0.0])


def test_collection_list_true_false_and_ellipsis_filters(mlp):
    model, _ = mlp
    _, a, b = vj.split(model, ["batch_stats", "nothing"], True)
    assert list(a) == ["batch_stats"] and list(b) == ["params"]
    _, none, everything = vj.split(model, False, ...)
    assert none == {} and sorted(everything) == ["batch_stats", "params"]
    _, t = vj.split(model, ("params", "batch_stats"))
    assert sorted(t) == ["batch_stats", "params"]


def test_deny_list_filter(mlp):
    model, _ = mlp
    _, not_params, params = vj.split(model, vj.DenyList("params"), ...)
    assert list(not_params) == ["batch_stats"] and list(params) == ["params"]


def test_predicate_filter_gets_collection_scope_and_name_path(mlp):
    model, _ = mlp
    seen = []

    def kernels(path, value):
        seen.append((path, value.shape))
        return path[-1] == "kernel"
    _, k, rest = vj.split(model, kernels, ...)
    assert (("params", "Dense_0", "kernel"), (3, 4)) in seen
    assert (("batch_stats", "BatchNorm_0", "mean"), (4,)) in seen
    assert _shapes(k) == {"params": {"Dense_0": {"kernel": (3, 4)}, "Dense_1": {"kernel": (4, 2)}}}
    assert "kernel" not in rest["params"]["Dense_0"]


def test_each_variable_goes_to_the_first_filter_that_matches(mlp):
    model, _ = mlp
    _, first, second = vj.split(model, "params", lambda path, v: path[-1] == "kernel" or True)
    assert list(first) == ["params"] and list(second) == ["batch_stats"]


def test_split_raises_naming_a_variable_no_filter_matches(mlp):
    model, _ = mlp
    with pytest.raises(vj.errors.TransformError) as info:
        vj.split(model, "params")
    assert info.value.collection == "batch_stats"
    assert info.value.path in {("BatchNorm_0", "mean"), ("BatchNorm_0", "var")}
    assert "batch_stats" in str(info.value)


def test_state_with_filters_gives_one_dict_or_a_tuple(mlp):
    model, variables = mlp
    params = vj.state(model, "params")
    assert_tree_close(params, {"params": variables["params"]})
    stats, params2 = vj.state(model, "batch_stats", "params")
    assert list(stats) == ["batch_stats"] and list(params2) == ["params"]


def test_graphdef_is_hashable_and_equal_for_equal_structures(mlp):
    model, variables = mlp
    gd1, _ = vj.split(model)
    gd2, _ = vj.split(MLP().bind(jax.tree.map(lambda a: a * 3, variables), mutable=["batch_stats"]))
    assert isinstance(hash(gd1), int) and gd1 == gd2 and hash(gd1) == hash(gd2)


def test_graphdef_is_a_static_argument_of_raw_jit(mlp):
    model, variables = mlp
    graphdef, params, rest = vj.split(model, "params", ...)
    traces = []

    def forward(graphdef, params, rest, x):
        traces.append(1)
        return vj.merge(graphdef, params, rest)(x)
    forward = jax.jit(forward, static_argnums=0)
    x = jnp.ones((2, 3))
    out = forward(graphdef, params, rest, x)
    forward(vj.split(model, "params", ...)[0], params, rest, x)
    assert len(traces) == 1
    np.testing.assert_allclose(out, MLP().apply(variables, x, mutable=["batch_stats"])[0],
                               atol=1e-5)


def test_shared_variable_is_stored_once_and_merged_as_one_object():
    shared = vj.Variable(jnp.zeros(2))
    graphdef, state = vj.split([shared, shared])
    assert _shapes(state) == {"params": {"0": (2,)}}
    a, b = vj.merge(graphdef, state)
    assert a is b and a is not shared


def test_shared_bound_module_is_stored_once_and_merged_as_one_object(mlp):
    model, _ = mlp
    graphdef, state = vj.split({"x": model, "y": model})
    assert list(state["params"]) == ["x"]
    merged = vj.merge(graphdef, state)
    assert merged["x"] is merged["y"] and type(merged["x"]) is MLP


def test_rngs_split_and_merge_round_trip():
    rngs = vj.Rngs(0, dropout=1)
    rngs.dropout()
    graphdef, state = vj.split(rngs)
    assert sorted(state["rngs"]) == ["default", "dropout"]
    assert int(state["rngs"]["dropout"]["count"]) == 1
    back = vj.merge(graphdef, state)
    assert type(back) is vj.Rngs and back is not rngs
    np.testing.assert_array_equal(jax.random.key_data(back.dropout()),
                                  jax.random.key_data(rngs.dropout()))


def test_merge_raises_when_a_variable_is_missing():
    tree = {"x": vj.Variable(jnp.ones(2)), "y": vj.Variable(jnp.ones(2), collection="c")}
    graphdef, params, c = vj.split(tree, "params", "c")
    with pytest.raises(vj.errors.TransformError) as info:
        vj.merge(graphdef, params)
    assert info.value.collection == "c" and info.value.path == ("y",)


def test_merge_raises_when_a_variable_is_in_two_states():
    tree = {"x": vj.Variable(jnp.ones(2)), "y": vj.Variable(jnp.ones(2), collection="c")}
    graphdef, params, c = vj.split(tree, "params", "c")
    with pytest.raises(vj.errors.TransformError) as info:
        vj.merge(graphdef, params, c, params)
    assert info.value.collection == "params" and info.value.path == ("x",)


def test_merge_needs_a_graphdef():
    with pytest.raises(vj.errors.TransformError, match="needs the graphdef"):
        vj.merge({"params": {}}, {})
