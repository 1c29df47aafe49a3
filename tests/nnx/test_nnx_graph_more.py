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
