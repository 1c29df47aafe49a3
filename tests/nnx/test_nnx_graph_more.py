"""The one walk of an NNX object's children (``varjax.nnx.pytree.children``), graph mode's
shared objects and tree mode (``graph=False``), against flax.nnx."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.pytree import children
from varjax.nnx.state_ops import iter_graph


def _shared(lib):
    class Pair(lib.Module):
        def __init__(self, rngs):
            self.first = lib.Linear(2, 2, rngs=rngs)
            self.second = self.first
            self.rngs = lib.Rngs(z=1, a=2)
    return Pair(lib.Rngs(0))


def _tree(lib):
    class Tree(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 1, rngs=rngs)
            self.layers = lib.List([lib.Linear(1, 1, rngs=rngs), 3])
            self.count = jnp.zeros(())
    return Tree(lib.Rngs(0))


def _no_flax_internals(paths):
    return [p for p in paths if not any(str(k).startswith("_pytree__") for k in p)]


def test_iter_graph_and_state_list_an_rngs_streams_in_flax_nnx_order():
    ours, theirs = nnx.Rngs(z=0, a=1, default=3), flax_nnx.Rngs(z=0, a=1, default=3)
    assert [p for p, _ in iter_graph(ours)] == _no_flax_internals(
        [p for p, _ in flax_nnx.iter_graph(theirs)])
    s, t = nnx.state(ours), flax_nnx.state(theirs)
    assert list(s) == list(t) == ["a", "default", "z"] and list(s["a"]) == list(t["a"]) == ["count", "key"]
    assert nnx.graphdef(ours).paths == tuple(p for p, _ in flax_nnx.to_flat_state(t))


def test_children_are_named_and_ordered_as_flax_nnx_with_statics_on_request():
    model = _tree(nnx)
    assert [k for k, _ in children(model)] == ["count", "layers", "lin"]
    assert [k for k, _ in children(model.layers)] == [0]
    assert [k for k, _ in children(model.layers, static=True)] == [0, 1]
    stream = nnx.Rngs(0).default
    assert [k for k, _ in children(stream, static=True)] == ["count", "key", "tag"]
    assert children(model.lin.kernel) == [] and children(jnp.ones(2)) == []


def test_merge_keeps_a_shared_submodule_one_object_as_flax_nnx():
    for lib in (nnx, flax_nnx):
        model = _shared(lib)
        g, s = lib.split(model)
        again = lib.merge(g, s)
        assert again.first is again.second and again.first is not model.first
        assert again.first.kernel is model.first.kernel
        copy = lib.clone(model)
        assert copy.first is copy.second and copy.first.kernel is not model.first.kernel


@pytest.mark.parametrize("fn", ["split", "state", "graphdef", "clone", "iter_graph"])
def test_tree_mode_refuses_a_shared_variable_naming_both_paths_as_flax_nnx(fn):
    def call(lib):
        out = getattr(lib, fn)(_shared(lib), graph=False)
        return list(out) if fn == "iter_graph" else out
    with pytest.raises(ValueError, match="Duplicate"):
        call(flax_nnx)
    with pytest.raises(errors.InconsistentAliasError, match="first/bias and second/bias"):
        call(nnx)


def test_set_graph_mode_false_makes_tree_mode_the_default():
    with nnx.set_graph_mode(False), pytest.raises(errors.InconsistentAliasError):
        nnx.split(_shared(nnx))
    nnx.split(_shared(nnx))     # graph mode again


def test_tree_mode_equals_graph_mode_on_a_tree_as_flax_nnx():
    ours, theirs = _tree(nnx), _tree(flax_nnx)
    g, s = nnx.split(ours, graph=False)
    tg, ts = flax_nnx.split(theirs, graph=False)
    assert s.flat().keys() == nnx.state(ours).flat().keys()
    assert list(s.flat()) == [p for p, _ in flax_nnx.to_flat_state(ts)]
    back = nnx.merge(g, s)
    np.testing.assert_array_equal(back.layers[0].kernel[...], ours.layers[0].kernel[...])
    assert back.layers[1] == 3
    ours_tree = [p for p, _ in iter_graph(ours, graph=False)]
    assert ours_tree == _no_flax_internals([p for p, _ in flax_nnx.iter_graph(theirs, graph=False)])


def test_tree_mode_walks_a_repeated_object_without_variables_again_as_flax_nnx():
    for lib in (nnx, flax_nnx):
        class Holder(lib.Module):
            def __init__(self):
                self.x = jnp.ones(2)

        class Two(lib.Module):
            def __init__(self):
                self.a = Holder()
                self.b = self.a
        paths = [p for p, _ in lib.to_flat_state(lib.state(Two(), graph=False))]
        assert paths == [("a", "x"), ("b", "x")]
        assert [p for p, _ in lib.to_flat_state(lib.state(Two()))] == [("a", "x")]


def test_split_merge_round_trip_under_jax_jit_keeps_the_shared_submodule():
    model = _shared(nnx)
    g, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def step(params, rest):
        m = nnx.merge(g, params, rest)
        return m.first is m.second, nnx.state(m, nnx.Param)
    same, new = step(params, rest)
    assert same and new.flat().keys() == params.flat().keys()


def _stateful(lib):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 3, rngs=rngs)
            self.bn = lib.BatchNorm(3, rngs=rngs)
            self.calls = 0

        def __call__(self, x):
            self.calls += 1
            return self.bn(self.lin(x))
    return Model(lib.Rngs(0))


def _pure(state):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(state) if isinstance(state, nnx.State)
                        else flax_nnx.to_pure_dict(state))


def _same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert jax.tree.all(jax.tree.map(np.array_equal, a, b))


def test_unpack_carries_the_graphdef_and_merge_takes_graph_states_alone_as_flax_nnx():
    from varjax.nnx.graph import GraphState, merge, unpack
    for lib, unpack_, merge_, graph_state in ((nnx, unpack, merge, GraphState),
                                              (flax_nnx, flax_nnx.unpack, flax_nnx.merge,
                                               flax_nnx.GraphState)):
        model = _stateful(lib)
        params, rest = unpack_(model, lib.Param, ...)
        assert isinstance(params, graph_state) and sorted(params) == ["bn", "lin"]
        assert sorted(rest) == ["bn"] and params["lin"]["kernel"] is model.lin.kernel
        again = merge_(params, rest)
        assert type(again) is type(model) and again.bn.mean is model.bn.mean
        mapped = jax.tree.map(lambda v: v + 1, params)
        assert isinstance(mapped, graph_state) and len(jax.tree.leaves(mapped)) == 4
        assert isinstance(unpack_(model), graph_state)
    with pytest.raises(errors.InvalidVariablesError, match="GraphState"):
        merge(unpack(_stateful(nnx)), nnx.state(_stateful(nnx)))


def test_flatten_and_unflatten_round_trip_paths_and_plain_values_as_flax_nnx():
    from varjax.nnx.graph import flatten, unflatten
    ours, theirs = _stateful(nnx), _stateful(flax_nnx)
    g, flat = flatten(ours)
    tg, tflat = flax_nnx.graph.flatten(theirs)
    assert list(flat.paths) == [p for p, _ in tflat]
    g, values = flatten(ours, with_paths=False)
    _, tvalues = flax_nnx.graph.flatten(theirs, with_paths=False)
    assert all(isinstance(v, jax.Array) for v in values)
    _same([np.asarray(v) for v in values], [np.asarray(v) for v in tvalues])
    back = unflatten(g, values)
    assert type(back.lin.kernel) is nnx.Param and back.lin.kernel is not ours.lin.kernel
    assert back.bn.mean.collection == "batch_stats"
    assert unflatten(g, flat).lin.kernel is ours.lin.kernel
    assert unflatten(g, flat, copy_variables=True).lin.kernel is not ours.lin.kernel
    with pytest.raises(errors.VariableStructureError, match="6 leaves, the list 5"):
        unflatten(g, values[:5])


def test_graphdef_apply_calls_the_merged_object_and_returns_its_new_state_as_flax_nnx():
    x = jnp.ones((1, 2))
    results = []
    for lib in (nnx, flax_nnx):
        model = _stateful(lib)
        g, s = lib.split(model)
        y, (g2, s2) = g.apply(s)(x)
        z, _ = g.apply(s).lin(x)
        assert lib.merge(g2, s2).calls == 1 and model.calls == 0 and z.shape == (1, 3)
        results.append((np.asarray(y), _pure(s2)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    _same(results[0][1], results[1][1])


def test_merge_copy_makes_new_variables_and_a_plain_state_becomes_variables_again():
    model = _stateful(nnx)
    g, s = nnx.split(model)
    copy = nnx.merge(g, s, copy=True)
    assert copy.lin.kernel is not model.lin.kernel and type(copy.lin.kernel) is nnx.Param
    pure = nnx.State(nnx.to_pure_dict(s))
    made = nnx.merge(g, pure)
    bare = nnx.merge(g, pure, recreate_variables=False)
    assert type(made.bn.mean) is nnx.BatchStat and isinstance(bare.bn.mean, jax.Array)
    tg, ts = flax_nnx.split(_stateful(flax_nnx))
    theirs = flax_nnx.merge(tg, flax_nnx.State(flax_nnx.to_pure_dict(ts)))
    assert type(theirs.bn.mean) is flax_nnx.BatchStat


def _mappable(lib, shared):
    class Holder(lib.Module):
        def __init__(self):
            self.lin = lib.Linear(1, 1, rngs=lib.Rngs(0))
            self.other = self.lin if shared else lib.Linear(1, 1, rngs=lib.Rngs(1))
            self.n = 3
            self.arr = jnp.ones(1)
            self.d = lib.data({"a": jnp.ones(1)})
    return Holder()


def _bump(lib, seen):
    def f(path, x):
        if not any(str(k).startswith("_pytree__") for k in path):
            seen.append((path, type(x).__name__))
        if isinstance(x, int) and not isinstance(x, bool):
            return x + 1
        if isinstance(x, lib.Param):
            return lib.Param(x[...] * 2)
        return x + 10 if isinstance(x, jax.Array) else x
    return f


@pytest.mark.parametrize("shared", [True, False])
def test_recursive_map_maps_nodes_and_leaves_children_first_as_flax_nnx(shared):
    from varjax.nnx.state_ops import recursive_map
    got = {}
    for lib, rmap in ((nnx, recursive_map), (flax_nnx, flax_nnx.recursive_map)):
        model, seen = _mappable(lib, shared), []
        kernel = np.asarray(model.lin.kernel[...])
        out = rmap(_bump(lib, seen), model)
        nodes = [(p, t) for p, t in seen if len(p) < 2 or p[0] not in ("lin", "other")]
        got[lib] = (nodes, [p for p, t in seen if t == "Param"], out.n, model.n,
                    out.lin is out.other, out.lin is model.lin, float(out.arr[0]),
                    float(out.d["a"][0]), float(model.d["a"][0]))
        # a Variable f replaces takes the new value in place: the original sees it too
        np.testing.assert_array_equal(model.lin.kernel[...], kernel * 2)
    assert got[nnx] == got[flax_nnx]
    assert got[nnx][2:5] == (4, 3, shared)


def test_recursive_map_in_tree_mode_rebuilds_from_mapped_data_and_refuses_sharing():
    from varjax.nnx.state_ops import recursive_map

    def bump(path, x):
        return x + 1 if isinstance(x, jax.Array) else x
    outs = [rmap(bump, _mappable(lib, False), graph=False) for lib, rmap in
            ((nnx, recursive_map), (flax_nnx, flax_nnx.recursive_map))]
    for out in outs:
        assert float(out.arr[0]) == 2.0 and float(out.d["a"][0]) == 2.0 and out.n == 3
    with pytest.raises(errors.InconsistentAliasError, match="lin/bias and other/bias"):
        recursive_map(bump, _mappable(nnx, True), graph=False)


def test_recursive_map_refuses_to_replace_a_tuple_element_as_flax_nnx():
    from varjax.nnx.state_ops import recursive_map
    for lib, rmap, err in ((nnx, recursive_map, errors.InvalidVariablesError),
                           (flax_nnx, flax_nnx.recursive_map, ValueError)):
        class Holder(lib.Module):
            def __init__(self):
                self.t = lib.data((jnp.ones(1),))
        with pytest.raises(err, match="0"):
            rmap(lambda p, x: x + 1 if isinstance(x, jax.Array) else x, Holder())


def test_as_pure_replaces_variables_by_their_values_as_flax_nnx():
    from varjax.nnx.state_ops import as_pure, pure
    ours = as_pure(nnx.state(_stateful(nnx)))
    theirs = flax_nnx.as_pure(flax_nnx.state(_stateful(flax_nnx)))
    assert type(ours) is nnx.State and not any(isinstance(v, nnx.Variable) for v in jax.tree.leaves(ours))
    _same(jax.tree.map(np.asarray, ours.to_pure_dict()),
          jax.tree.map(np.asarray, flax_nnx.to_pure_dict(theirs)))
    assert as_pure(nnx.Param(1.0)) == 1.0
    with pytest.warns(DeprecationWarning, match="as_pure"):
        assert pure(nnx.Param(2.0)) == 2.0


def test_split_and_merge_rebuild_a_module_that_holds_itself_as_flax_nnx():
    for lib in (nnx, flax_nnx):
        class Loop(lib.Module):
            def __init__(self):
                self.x = lib.Param(jnp.ones(1))
        loop = Loop()
        loop.me = loop
        g, s = lib.split(loop)
        again = lib.merge(g, s)
        assert again.me is again and again is not loop and sorted(s) == ["x"]
        assert [p for p, _ in lib.iter_graph(loop) if "_pytree" not in str(p)] == [("x",), ()]


def test_a_bare_variable_splits_into_itself_and_merges_back_as_flax_nnx():
    for lib in (nnx, flax_nnx):
        v = lib.Param(jnp.ones(1))
        g, s = lib.split(v)
        assert s is v and lib.merge(g, s) is v
        lib.update(v, lib.Param(jnp.zeros(1)))
        np.testing.assert_array_equal(v[...], [0.0])


def test_traversals_flatten_and_unflatten_nested_mappings_as_flax_nnx():
    from flax.nnx import traversals as theirs

    from varjax.nnx import traversals as ours
    x = {"a": 1, "b": {"c": 2, "d": {}}, "e": {}}
    for kw in ({}, {"keep_empty_nodes": True}, {"sep": "/"}):
        got, want = ours.flatten_mapping(x, **kw), theirs.flatten_mapping(x, **kw)
        assert list(got) == list(want)
        sep = kw.get("sep")
        assert ours.unflatten_mapping(got, sep=sep) == theirs.unflatten_mapping(want, sep=sep)
    leaf = lambda p, v: p == ("b",)   # noqa: E731
    assert ours.flatten_to_sequence(x, is_leaf=leaf) == theirs.flatten_to_sequence(x, is_leaf=leaf)
    assert ours.unflatten_mapping([(("a", "b"), 1)]) == {"a": {"b": 1}}
    with pytest.raises(errors.InvalidVariablesError, match="takes a mapping"):
        ours.flatten_mapping([1])


def test_clone_keeps_or_copies_variables_and_arrays_as_flax_nnx():
    for lib in (nnx, flax_nnx):
        model = lib.Linear(1, 1, rngs=lib.Rngs(0))
        same = lib.clone(model, variables=False)
        assert same is not model and same.kernel is model.kernel
        deep = lib.clone(model, arrays=True)
        assert deep.kernel is not model.kernel and deep.kernel[...] is not model.kernel[...]
        np.testing.assert_array_equal(deep.kernel[...], model.kernel[...])
        with pytest.raises(ValueError, match="variables"):
            lib.clone(model, variables=False, arrays=True)


def test_with_vars_in_the_modes_varjax_variables_have_keeps_them_as_flax_nnx():
    from varjax.nnx.state_ops import vars_as, with_vars
    for lib, with_vars_, vars_as_ in ((nnx, with_vars, vars_as),
                                      (flax_nnx, flax_nnx.with_vars, flax_nnx.vars_as)):
        model = lib.Linear(1, 1, rngs=lib.Rngs(0))
        out = with_vars_(model, hijax=False, ref=False)   # flax.nnx's mutable= needs a Ref
        assert out is not model and out.kernel is model.kernel
        with pytest.warns(DeprecationWarning, match="with_vars"):
            assert vars_as_(model, ref=False).kernel is model.kernel
    model = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
    assert with_vars(model, mutable=True).kernel is model.kernel
    with pytest.raises(errors.NotProvidedError, match="ref=True"):
        with_vars(model, ref=True)
    with pytest.raises(errors.NotProvidedError, match="mutable=False"):
        with_vars(model, mutable=False)
