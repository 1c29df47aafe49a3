"""NNX objects as pytrees of Variables, on varjax's object core (``notes/nnx.md``)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

import varjax as vj
from varjax import errors, nnx


class Clicks(nnx.Variable):
    pass


class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(2, 2, rngs=rngs)
        self.deterministic = False
        self.calls = Clicks(jnp.array(0))

    def __call__(self, x):
        self.calls[...] += 1
        return self.linear(x)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs), Block(rngs)])
        self.scale = jnp.float32(2.0)
        self.name = "model"

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.scale * x


X = jnp.ones((1, 2))


def test_data_attributes_are_the_pytree_children_in_name_order_as_in_flax_nnx():
    ours = Model(nnx.Rngs(0))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ours)[0]]
    assert paths == [
        ".blocks[0].calls.value", ".blocks[0].linear.bias.value", ".blocks[0].linear.kernel.value",
        ".blocks[1].calls.value", ".blocks[1].linear.bias.value", ".blocks[1].linear.kernel.value",
        ".scale"]
    copy = jax.tree.map(lambda a: a + 1, ours)
    assert type(copy) is Model and copy.name == "model" and copy.blocks[1].deterministic is False
    np.testing.assert_array_equal(copy.blocks[0].linear.kernel[...], ours.blocks[0].linear.kernel[...] + 1)


def test_variable_types_are_collections_named_as_flax_nnx_names_them():
    for ours, theirs in ((nnx.Param, flax_nnx.Param), (nnx.BatchStat, flax_nnx.BatchStat),
                         (nnx.Cache, flax_nnx.Cache), (nnx.Intermediate, flax_nnx.Intermediate),
                         (nnx.Perturbation, flax_nnx.Perturbation)):
        assert nnx.variable_name_from_type(ours) == flax_nnx.variable_name_from_type(theirs)
        assert ours(jnp.zeros(())).collection == nnx.variable_name_from_type(ours)
    assert nnx.variable_name_from_type(Clicks) == "Clicks"
    assert nnx.variable_type_from_name("params") is nnx.Param
    with pytest.raises(errors.InvalidVariablesError):
        nnx.variable_type_from_name("no_such_collection")
    made = nnx.variable_type_from_name("made_here", allow_register=True)
    assert issubclass(made, nnx.Variable) and made(jnp.zeros(())).collection == "made_here"


def test_variable_accessors_and_metadata():
    v = nnx.Param(jnp.ones(2), tag="t")
    assert v.tag == "t" and v.get_metadata() == {"tag": "t"}
    v.set_value(jnp.zeros(2))
    v[...] = v.get_value() + 3
    np.testing.assert_array_equal(v[...], [3.0, 3.0])
    v.set_metadata(other=1)
    assert v.has_metadata("other") and v.replace(jnp.ones(1)).other == 1
    with pytest.raises(errors.InvalidVariablesError, match="collection is its type"):
        nnx.Param(jnp.ones(1), collection="batch_stats")


def test_a_static_list_of_layers_is_refused_and_nnx_list_or_data_accepted():
    class Bad(nnx.Module):
        def __init__(self, rngs):
            self.layers = [nnx.Linear(2, 2, rngs=rngs)]

    with pytest.raises(errors.StaticDataError, match="'layers'") as info:
        Bad(nnx.Rngs(0))
    assert isinstance(info.value, ValueError) and __file__ in info.value.source

    class Good(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.data([nnx.Linear(2, 2, rngs=rngs)])
            self.table = nnx.Dict(a=nnx.Param(jnp.ones(1)), n=3)
            self.sizes = nnx.static((2, 2))
    good = Good(nnx.Rngs(0))
    assert len(jax.tree.leaves(good)) == 3 and good.table.n == 3 and good.table["a"].collection == "params"


def _walked(lib):
    """``iter_modules``/``iter_children`` of one model built with ``lib`` (varjax.nnx or
    flax.nnx), as (key, type name) pairs."""
    class Inner(lib.Module):
        def __init__(self, rngs):
            self.linear = lib.Linear(1, 1, rngs=rngs)

    class Outer(lib.Module):
        def __init__(self, rngs):
            self.z = Inner(rngs)
            self.blocks = lib.List([Inner(rngs), 3])
            self.table = lib.Dict(x=Inner(rngs))
            self.p = lib.Param(jnp.ones(1))
            self.rngs = rngs
            self.arr = jnp.ones(1)
            self.plain = lib.data([Inner(rngs)])

    model = Outer(lib.Rngs(0))

    def named(pairs):
        return [(k, type(v).__name__) for k, v in pairs]
    return (named(lib.iter_modules(model)), named(lib.iter_children(model)),
            named(lib.iter_children(model.blocks)), named(lib.iter_modules(model.blocks)))


def test_iter_modules_and_iter_children_list_what_flax_nnx_lists():
    # iter_children lists each direct child that is a graph node, a List/Dict itself (not
    # its elements); iter_modules walks into lists, Dicts and data lists, and lists the
    # List/Dict too (Modules in flax.nnx)
    ours = _walked(nnx)
    assert ours == _walked(flax_nnx)
    assert ours[1] == [("blocks", "List"), ("p", "Param"), ("rngs", "Rngs"), ("table", "Dict"),
                       ("z", "Inner")]


def test_module_iter_methods_warn_deprecated_as_flax_nnx():
    model = Model(nnx.Rngs(0))
    with pytest.warns(DeprecationWarning, match="nnx.iter_modules"):
        assert [p for p, _ in model.iter_modules()] == [p for p, _ in nnx.iter_modules(model)]
    with pytest.warns(DeprecationWarning, match="nnx.iter_children"):
        assert [k for k, _ in model.iter_children()] == ["blocks"]


def test_iter_children_refuses_a_leaf():
    with pytest.raises(errors.ConfigError, match="ArrayImpl") as info:
        list(nnx.iter_children(jnp.ones(1)))
    assert isinstance(info.value, ValueError) and __file__ in info.value.source


def test_iter_modules_train_eval_and_sow():
    model = Model(nnx.Rngs(0))
    model.eval()
    assert all(b.deterministic for b in model.blocks)
    model.train()
    assert not any(b.deterministic for b in model.blocks)
    with pytest.raises(errors.ModuleError, match="no_such"):
        model.set_attributes(no_such=1)
    block = model.blocks[0]
    block.sow(nnx.Intermediate, "seen", jnp.ones(1))
    block.sow(nnx.Intermediate, "seen", jnp.zeros(1))
    assert len(block.seen[...]) == 2 and block.seen.collection == "intermediates"
    with pytest.raises(errors.ModuleError, match="sow"):
        block.sow(nnx.Cache, "seen", jnp.ones(1))


def test_object_mode_transforms_take_an_nnx_module_and_write_its_variables_back():
    model = Model(nnx.Rngs(0))
    out = vj.jit(lambda m, x: m(x))(model, X)
    assert out.shape == (1, 2) and int(model.blocks[0].calls[...]) == 1
    grads = vj.grad(lambda m, x: jnp.sum(m(x)))(model, X)
    assert type(grads) is Model and int(model.blocks[1].calls[...]) == 2
    assert {"Clicks", "params"} <= set(vj.state(model))
    # the same computation by hand on the values
    k = [b.linear.kernel[...] for b in model.blocks]
    b = [b.linear.bias[...] for b in model.blocks]
    np.testing.assert_allclose(out, 2.0 * ((X @ k[0] + b[0][None]) @ k[1] + b[1][None]), rtol=1e-6)


def test_a_variable_computes_like_its_value_as_in_flax_nnx():
    a, b = nnx.Param(jnp.array([1.0, 2.0])), nnx.BatchStat(jnp.array(4.0))
    fa, fb = flax_nnx.Param(jnp.array([1.0, 2.0])), flax_nnx.BatchStat(jnp.array(4.0))
    for ours, theirs in ((a + 1, fa + 1), (1 - a, 1 - fa), (a * b, fa * fb), (b / 2, fb / 2),
                         (-a, -fa), (a @ a, fa @ fa), (a ** 2, fa ** 2)):
        np.testing.assert_array_equal(ours, theirs)
    assert float(b) == 4.0 and bool(a)        # truth is the object's, not the array's


def _held_variables(lib):
    class Holder(lib.Module):
        def __init__(self):
            self.vs = lib.List([lib.Param(jnp.arange(2.0)), 3, lib.BatchStat(jnp.zeros(2))])
            self.table = lib.Dict(a=lib.Param(jnp.ones(2)), name="s")
    return Holder()


def test_bare_variables_in_list_and_dict_under_nnx_jit_as_flax_nnx():
    # a List's elements keep their data/static classification through the placeholders
    # object mode flattens a module with (it failed with "Too few leaves for PyTreeDef")
    def run(lib):
        holder = _held_variables(lib)

        @lib.jit
        def step(h, x):
            h.vs[2].value = h.vs[2].value + x
            return h.vs[0].value * x + h.table["a"].value
        return step(holder, 2.0), holder.vs[2].value, holder.vs[1], holder.table["name"]
    ours, theirs = run(nnx), run(flax_nnx)
    for a, b in zip(ours[:2], theirs[:2]):
        np.testing.assert_array_equal(a, b)
    assert ours[2:] == theirs[2:] == (3, "s")


def test_bare_variable_in_list_under_nnx_vmap_as_flax_nnx():
    def run(lib):
        holder = _held_variables(lib)
        return lib.vmap(lambda h, x: h.vs[0].value * x, in_axes=(None, 0))(holder, jnp.arange(3.0))
    np.testing.assert_array_equal(run(nnx), run(flax_nnx))


def test_list_keeps_an_element_marked_data_or_static():
    held = nnx.List([nnx.data([nnx.Param(jnp.ones(1))]), 2])
    assert len(jax.tree.leaves(held)) == 1
    held[1] = nnx.Param(jnp.zeros(1))
    held.insert(0, "label")
    del held[0]
    assert [type(x).__name__ for x in jax.tree.leaves(held, is_leaf=lambda v: isinstance(
        v, nnx.Variable))] == ["Param", "Param"]
