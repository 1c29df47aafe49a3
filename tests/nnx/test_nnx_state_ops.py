"""The rest of graph and state (``pop``, flat states, ``merge_state``/``map_state``/
``split_state``/``filter_state``, ``State``'s methods, ``iter_graph``, ``find_duplicates``)
against flax.nnx 0.12.8: the same paths, in the same order, with the same values."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.rng_variables import plain_type
from varjax.nnx.state_ops import (
    filter_state,
    find_duplicates,
    from_flat_state,
    iter_graph,
    map_state,
    merge_state,
    pop,
    restore_int_paths,
    split_state,
    to_flat_state,
)
from varjax.nnx.state_ops import map as map_node
from varjax.nnx.statelib import FlatState


def _model(lib):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 3, rngs=rngs)
            self.norm = lib.BatchNorm(3, rngs=rngs)
            self.layers = lib.List([lib.Linear(3, 1, rngs=rngs)])
            self.extra = lib.Dict(b=lib.BatchStat(jnp.ones(2)), a=lib.Param(jnp.zeros(1)))
            self.arr = jnp.arange(2.0)
            self.rngs = lib.Rngs(0, dropout=1)

        def __call__(self, x):
            h = self.norm(self.lin(x))
            self.hidden = lib.Intermediate(h)
            return self.layers[0](h)
    return Model(lib.Rngs(0))


def _value(leaf):
    v = leaf.get_value() if isinstance(leaf, (nnx.Variable, flax_nnx.Variable)) else leaf
    return np.asarray(jax.random.key_data(v) if jnp.issubdtype(v.dtype, jax.dtypes.prng_key) else v)


_their_flat = flax_nnx.to_flat_state


def _same_flat(ours, theirs):
    """Two flat states: the same paths in the same order, bitwise the same values."""
    assert list(ours.paths) == list(theirs.paths)
    for (_, a), (_, b) in zip(ours, theirs):
        np.testing.assert_array_equal(_value(a), _value(b))
        assert _value(a).dtype == _value(b).dtype


def test_to_flat_state_has_flax_nnx_paths_order_and_values():
    ours, theirs = to_flat_state(nnx.state(_model(nnx))), _their_flat(flax_nnx.state(_model(flax_nnx)))
    assert isinstance(ours, FlatState) and len(ours) == len(theirs) == 15
    _same_flat(ours, theirs)


def test_from_flat_state_nests_pairs_and_mappings_back():
    s = nnx.state(_model(nnx))
    flat = to_flat_state(s)
    for given in (flat, dict(flat), list(flat)):
        again = from_flat_state(given)
        assert again.flat_state().paths == flat.paths
        assert all(x is y for x, y in zip(again.flat_state().leaves, flat.leaves))


def test_flat_state_indexes_slices_and_is_a_pytree_as_flax_nnx_does():
    ours = to_flat_state(nnx.state(_model(nnx), nnx.Param))
    theirs = flax_nnx.to_flat_state(flax_nnx.state(_model(flax_nnx), flax_nnx.Param))
    assert ours[0][0] == theirs[0][0] == ("extra", "a")
    _same_flat(ours[1:3], theirs[1:3])
    assert isinstance(ours[1:3], FlatState) and ours.leaves[0] is ours[0][1]
    doubled = jax.tree.map(lambda v: v * 2, ours)
    assert isinstance(doubled, FlatState) and doubled.paths == ours.paths
    np.testing.assert_array_equal(doubled[1][1].value, ours[1][1].value * 2)
    assert jax.tree.structure(ours.to_nested_state()) == jax.tree.structure(nnx.state(_model(nnx), nnx.Param))


@pytest.mark.parametrize("names", [("Param", "BatchStat", "ellipsis"), ("BatchStat", "ellipsis")])
def test_split_state_and_filter_state_part_the_leaves_as_flax_nnx(names):
    def filters(lib):
        return [... if n == "ellipsis" else getattr(lib, n) for n in names]
    s, t = nnx.state(_model(nnx)), flax_nnx.state(_model(flax_nnx))
    mine, flaxs = filters(nnx), filters(flax_nnx)
    for ours, theirs in ((split_state(s, *mine), flax_nnx.split_state(t, *flaxs)),
                         (filter_state(s, *mine[:-1]), flax_nnx.filter_state(t, *flaxs[:-1]))):
        ours = ours if isinstance(ours, tuple) else (ours,)
        theirs = theirs if isinstance(theirs, tuple) else (theirs,)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            _same_flat(to_flat_state(a), _their_flat(b))


def test_split_state_refuses_a_leaf_no_filter_matches_naming_it():
    with pytest.raises(errors.InvalidVariablesError, match="at arr"):
        split_state(nnx.state(_model(nnx)), nnx.Param)
    with pytest.raises(ValueError):
        flax_nnx.split_state(flax_nnx.state(_model(flax_nnx)), flax_nnx.Param)


def test_ellipsis_before_another_filter_is_refused_as_flax_nnx_refuses_it():
    with pytest.raises(errors.ConfigError, match="last filters") as info:
        filter_state(nnx.state(_model(nnx)), ..., nnx.Param)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError):
        flax_nnx.filter_state(flax_nnx.state(_model(flax_nnx)), ..., flax_nnx.Param)


def test_merge_state_joins_states_and_a_later_one_wins():
    model, theirs = _model(nnx), _model(flax_nnx)
    params, rest = nnx.state(model, nnx.Param, ...)
    tparams, trest = flax_nnx.state(theirs, flax_nnx.Param, ...)
    _same_flat(to_flat_state(merge_state(params, rest)), _their_flat(flax_nnx.merge_state(tparams, trest)))
    assert merge_state(params) is params
    newer = merge_state(params, {"lin": {"bias": jnp.full(3, 7.0)}})
    np.testing.assert_array_equal(newer["lin"]["bias"], jnp.full(3, 7.0))
    assert newer["lin"]["kernel"] is model.lin.kernel
    nnx.update(model, newer)
    np.testing.assert_array_equal(model.lin.bias[...], jnp.full(3, 7.0))


def test_map_state_maps_each_path_and_leaf_as_flax_nnx():
    def f(path, leaf):
        v = leaf.get_value() if hasattr(leaf, "get_value") else leaf
        return v + len(path) if v.dtype == jnp.float32 else v
    ours = map_state(f, nnx.state(_model(nnx)))
    theirs = flax_nnx.map_state(f, flax_nnx.state(_model(flax_nnx)))
    _same_flat(to_flat_state(ours), _their_flat(theirs))


def test_state_methods_are_the_functions_as_in_flax_nnx():
    s, t = nnx.state(_model(nnx)), flax_nnx.state(_model(flax_nnx))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # flax.nnx deprecates the methods
        _same_flat(s.flat_state(), t.flat_state())
        _same_flat(nnx.State.from_flat_path(s.flat_state()).flat_state(),
                   flax_nnx.State.from_flat_path(t.flat_state()).flat_state())
        for a, b in zip(s.split(nnx.Param, ...), t.split(flax_nnx.Param, ...)):
            _same_flat(a.flat_state(), b.flat_state())
        _same_flat(s.filter(nnx.BatchStat).flat_state(), t.filter(flax_nnx.BatchStat).flat_state())
        _same_flat(s.map(lambda p, v: v).flat_state(), t.map(lambda p, v: v).flat_state())
        params, rest = s.split(nnx.Param, ...)
        tparams, trest = t.split(flax_nnx.Param, ...)
        _same_flat(nnx.State.merge(params, rest).flat_state(),
                   flax_nnx.State.merge(tparams, trest).flat_state())
        _same_flat((params | rest).flat_state(), (tparams | trest).flat_state())
        _same_flat((s - params).flat_state(), (t - tparams).flat_state())
    assert (params | {}) is params and (s - {}) is s


def test_flat_state_split_filter_and_merge_as_flax_nnx():
    ours, theirs = nnx.state(_model(nnx)).flat_state(), _their_flat(flax_nnx.state(_model(flax_nnx)))
    for a, b in zip(ours.split(nnx.Param, ...), theirs.split(flax_nnx.Param, ...)):
        _same_flat(a, b)
    _same_flat(ours.filter(nnx.BatchStat), theirs.filter(flax_nnx.BatchStat))
    p, r = ours.split(nnx.Param, ...)
    _same_flat(FlatState.merge(r, p), flax_nnx.FlatState.merge(*reversed(theirs.split(flax_nnx.Param, ...))))
    assert FlatState.merge(p) is p
    with pytest.raises(errors.InvalidVariablesError):
        ours.split(nnx.Param)


def test_pop_removes_the_selected_variables_and_returns_them_as_flax_nnx():
    model, theirs = _model(nnx), _model(flax_nnx)
    x = jnp.ones((1, 2))
    model(x), theirs(x)
    ours, want = pop(model, nnx.Intermediate), flax_nnx.pop(theirs, flax_nnx.Intermediate)
    _same_flat(to_flat_state(ours), _their_flat(want))
    assert not hasattr(model, "hidden") and not hasattr(theirs, "hidden")
    assert "hidden" not in nnx.state(model)


def test_pop_with_several_filters_returns_one_state_each_from_dicts_too():
    model, theirs = _model(nnx), _model(flax_nnx)
    ours = pop(model, nnx.BatchStat, nnx.PathContains("a"))
    want = flax_nnx.pop(theirs, flax_nnx.BatchStat, flax_nnx.PathContains("a"))
    for a, b in zip(ours, want):
        _same_flat(to_flat_state(a), _their_flat(b))
    assert list(model.extra) == list(theirs.extra) == []
    assert sorted(nnx.state(model).flat()) == sorted(_their_flat(flax_nnx.state(theirs)).paths)


def test_pop_takes_a_shared_variable_at_its_first_path_only_as_flax_nnx():
    def shared(lib):
        class Shared(lib.Module):
            def __init__(self):
                self.a = lib.BatchStat(jnp.ones(1))
                self.b = self.a
        return Shared()
    model, theirs = shared(nnx), shared(flax_nnx)
    popped = list(_their_flat(flax_nnx.pop(theirs, flax_nnx.BatchStat)).paths)
    assert list(pop(model, nnx.BatchStat).flat()) == popped == [("a",)]
    for obj in (model, theirs):
        assert (hasattr(obj, "a"), hasattr(obj, "b")) == (False, True)


def test_pop_refuses_no_filter_and_a_list_element():
    with pytest.raises(errors.ConfigError, match="no filter"):
        pop(_model(nnx))
    held = nnx.List([nnx.Param(jnp.ones(1)), nnx.BatchStat(jnp.ones(1))])
    with pytest.raises(errors.NotProvidedError, match="variable:   1"):
        pop(held, nnx.BatchStat)
    assert len(held) == 2


def _kind(v):
    return isinstance(v, (nnx.Pytree, nnx.Rngs, nnx.RngStream, nnx.Variable, flax_nnx.Pytree,
                          flax_nnx.Rngs, flax_nnx.RngStream, flax_nnx.Variable, jax.Array))


def test_iter_graph_walks_nodes_and_leaves_in_flax_nnx_order():
    ours = [(p, v) for p, v in iter_graph(_model(nnx)) if _kind(v)]
    theirs = [(p, v) for p, v in flax_nnx.iter_graph(_model(flax_nnx)) if _kind(v)]
    assert [p for p, _ in ours] == [p for p, _ in theirs]
    def name(v):   # a stream's key and count: RngKey/RngCount Variables (views here)
        return "array" if isinstance(v, jax.Array) else plain_type(v).__name__
    assert [name(v) for _, v in ours] == [name(v) for _, v in theirs]
    assert ours[-1][0] == () and type(ours[-1][1]).__name__ == "Model"


def test_iter_graph_yields_static_attributes_and_each_object_once():
    model = _model(nnx)
    model.zz = model.lin
    got = dict(iter_graph(model))
    assert got[("lin", "in_features")] == 2 and got[("rngs", "dropout", "tag")] == "dropout"
    assert not any(p[:1] == ("zz",) for p in got)
    with pytest.raises(errors.InconsistentAliasError, match="lin/bias and zz/bias"):
        list(iter_graph(model, graph=False))


@pytest.mark.parametrize("only", ["everything", "param"])
def test_find_duplicates_lists_the_paths_of_shared_objects_and_variables(only):
    def shared(lib):
        class Shared(lib.Module):
            def __init__(self, rngs):
                self.a = lib.Linear(1, 1, rngs=rngs)
                self.b = lib.Linear(1, 1, rngs=rngs)
                self.c = self.a
                self.w = self.b.kernel
                self.z = lib.Dict(k=self.b.bias)
        return Shared(lib.Rngs(0))
    def kw(lib):
        return {} if only == "everything" else {"only": lib.Param}
    ours = find_duplicates(shared(nnx), **kw(nnx))
    want = flax_nnx.find_duplicates(shared(flax_nnx), **kw(flax_nnx))
    assert ours == want and len(want) == (3 if only == "everything" else 2)


def test_map_builds_a_new_object_of_mapped_leaves_as_flax_nnx():
    model, theirs = _model(nnx), _model(flax_nnx)

    def double(path, leaf):
        return leaf * 2 if isinstance(leaf, (nnx.Param, flax_nnx.Param)) else leaf
    ours, want = map_node(double, model), flax_nnx.map(double, theirs)
    _same_flat(to_flat_state(nnx.state(ours)), _their_flat(flax_nnx.state(want)))
    assert type(ours.lin.kernel) is nnx.Param and ours.lin.kernel is not model.lin.kernel
    assert ours.norm.mean is model.norm.mean and want.norm.mean is theirs.norm.mean
    bare = map_node(double, model, recreate_variables=False)
    bare_theirs = flax_nnx.map(double, theirs, recreate_variables=False)
    assert isinstance(bare.lin.kernel, jax.Array) and isinstance(bare_theirs.lin.kernel, jax.Array)
    tree, tree_theirs = map_node(double, model, graph=False), flax_nnx.map(double, theirs, graph=False)
    _same_flat(to_flat_state(nnx.state(tree)), _their_flat(flax_nnx.state(tree_theirs)))


def test_restore_int_paths_turns_checkpoint_string_indices_back_into_ints():
    model = nnx.List([nnx.Linear(1, 1, rngs=nnx.Rngs(0)) for _ in range(2)])
    pure = nnx.to_pure_dict(nnx.state(model))
    stored = {str(k): layer for k, layer in pure.items()}
    assert jax.tree.structure(restore_int_paths(stored)) == jax.tree.structure(pure)
    given = {"0": {"a": 1, "1x": 2}, "b": {"2": 3}, "c": 4}
    want = {0: {"a": 1, "1x": 2}, "b": {2: 3}, "c": 4}
    assert restore_int_paths(given) == flax_nnx.restore_int_paths(given) == want


def _plain_containers(lib):
    class Held(lib.Module):
        def __init__(self):
            p = lib.Param(jnp.ones(1))
            self.stuff = lib.data({"x": [p, jnp.zeros(1)], "y": (p,)})
    return Held()


def test_the_walks_enter_plain_containers_held_as_data_as_flax_nnx():
    ours, theirs = _plain_containers(nnx), _plain_containers(flax_nnx)
    def walk(it):
        return [(p, type(v).__name__) for p, v in it if "_pytree" not in str(p)]
    assert walk(iter_graph(ours)) == walk(flax_nnx.iter_graph(theirs))
    shared = [[("stuff", "x", 0), ("stuff", "y", 0)]]
    assert find_duplicates(ours) == flax_nnx.find_duplicates(theirs) == shared


def test_pop_refuses_a_variable_inside_a_plain_container():
    with pytest.raises(errors.NotProvidedError, match="stuff/x/0"):
        pop(_plain_containers(nnx), nnx.Param)
    with pytest.raises(ValueError):
        flax_nnx.pop(_plain_containers(flax_nnx), flax_nnx.Param)
