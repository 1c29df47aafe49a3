"""``nnx.state``/``split``/``merge``/``update``/``clone`` and the filters, against flax.nnx:
the same paths and values (so checkpoints interchange), the same object semantics."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx


def _model(lib):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
            self.layers = lib.List([lib.Linear(2, 1, rngs=rngs)])
            self.arr = jnp.ones(2)
            self.rngs = rngs
    return Model(lib.Rngs(0))


def _plain(tree):
    return jax.tree.map(lambda a: jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
                        else a, tree)


def test_the_pure_state_has_flax_nnx_paths_and_values_both_ways():
    ours, theirs = _model(nnx), _model(flax_nnx)
    pure, want = nnx.to_pure_dict(nnx.state(ours)), flax_nnx.to_pure_dict(flax_nnx.state(theirs))
    assert jax.tree.structure(pure) == jax.tree.structure(want)
    assert jax.tree.all(jax.tree.map(np.array_equal, _plain(pure), _plain(want)))
    # a flax.nnx checkpoint restores into the varjax model, and the other way
    changed = jax.tree.map(lambda a: a + 1 if a.dtype == jnp.float32 else a, want)
    s = nnx.state(ours)
    nnx.replace_by_pure_dict(s, changed)
    nnx.update(ours, s)
    np.testing.assert_array_equal(ours.lin.kernel[...], theirs.lin.kernel[...] + 1)
    back = flax_nnx.state(theirs)
    flax_nnx.replace_by_pure_dict(back, nnx.to_pure_dict(nnx.state(ours)))
    flax_nnx.update(theirs, back)
    np.testing.assert_array_equal(theirs.layers[0].bias[...], ours.layers[0].bias[...])


def test_state_holds_the_objects_own_variables_and_merge_uses_them():
    model = _model(nnx)
    assert nnx.state(model)["lin"]["kernel"] is model.lin.kernel
    g, params, rest = nnx.split(model, nnx.Param, ...)
    assert set(params) == {"lin", "layers"} and set(rest) == {"arr", "rngs"}
    again = nnx.merge(g, params, rest)
    assert type(again) is type(model) and again is not model and again.lin.kernel is model.lin.kernel
    assert nnx.graphdef(model) == g and hash(g) == hash(nnx.graphdef(model))


def test_a_collection_name_selects_what_its_type_does():
    model = _model(nnx)
    by_type, by_name = nnx.state(model, nnx.Param), nnx.state(model, "params")
    assert by_type.flat().keys() == by_name.flat().keys() and len(by_type.flat()) == 4


@pytest.mark.parametrize("filt, n", [
    (nnx.Not(nnx.Param), 3), (nnx.All(nnx.Param, nnx.PathContains("lin")), 2),
    (nnx.Any(nnx.PathContains("arr"), nnx.PathContains("rngs")), 3), (nnx.OfType(nnx.Param), 4),
    (nnx.Everything(), 7), (nnx.Nothing(), 0), ([nnx.Param, "nothing"], 4),
    (lambda path, v: path[-1] == "bias", 2)])
def test_filters_select_by_type_name_path_and_predicate(filt, n):
    assert len(nnx.state(_model(nnx), filt).flat()) == n


def test_with_tag_selects_variables_by_their_tag_metadata():
    class Tagged(nnx.Module):
        def __init__(self):
            self.a, self.b = nnx.Param(jnp.ones(1), tag="x"), nnx.Param(jnp.ones(1))
    assert list(nnx.state(Tagged(), nnx.WithTag("x")).flat()) == [("a",)]


def test_update_writes_in_place_and_clone_makes_new_variables():
    model = _model(nnx)
    kernel = model.lin.kernel
    nnx.update(model, jax.tree.map(lambda v: v * 0, nnx.state(model, nnx.Param)))
    assert model.lin.kernel is kernel and float(jnp.sum(jnp.abs(kernel[...]))) == 0
    copy = nnx.clone(model)
    assert copy.lin.kernel is not kernel and type(copy.lin.kernel) is nnx.Param
    np.testing.assert_array_equal(copy.lin.kernel[...], kernel[...])


def test_split_and_merge_inside_jax_jit_as_the_tree_mode_note_writes_it():
    model = _model(nnx)
    g, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def step(params, rest, x):
        m = nnx.merge(g, params, rest)
        y = m.lin(x)
        return y, nnx.state(m, nnx.Param)
    y, new = step(params, rest, jnp.ones((1, 2)))
    np.testing.assert_allclose(y, model.lin(jnp.ones((1, 2))), rtol=1e-6)
    assert type(new["lin"]["kernel"]) is nnx.Param


def test_bad_filters_leftovers_and_missing_state_are_clear_errors():
    model = _model(nnx)
    with pytest.raises(errors.InvalidVariablesError, match="matches none of the filters"):
        nnx.split(model, nnx.Param)
    with pytest.raises(errors.InvalidVariablesError, match="not an nnx filter"):
        nnx.state(model, 3)
    g, params, rest = nnx.split(model, nnx.Param, ...)
    with pytest.raises(errors.MissingVariableError, match="no state gives the leaf"):
        nnx.merge(g, params)
    with pytest.raises(errors.MissingVariableError, match="has no leaf at"):
        nnx.update(model, {"nope": jnp.ones(1)})
