"""``varjax.ir.axis_metadata`` against Flax's ``flax.core.meta`` / ``flax.linen.spmd``: the
boxes, their pytree structure, Linen's logical-to-mesh resolution and every error path."""
from __future__ import annotations

import dataclasses

import flax.core.meta as flax_meta
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from varjax import errors
from varjax.ir import axis_metadata as am

U = P.UNCONSTRAINED

# (names, rules): Linen's resolution cases, from its docstring's example to the corners.
RESOLUTION = [
    (("batch", "length", "heads", "features"),
     (("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z"))),
    (("batch", "embed"), (("batch", "data"), ("embed", "model"))),
    (("batch", "embed"), (("batch", "data"),)),                       # unassigned: not sharded
    (("embed", "mlp"), (("embed", "model"), ("mlp", "model"))),       # one mesh axis used once
    (("embed", "mlp"), (("embed", None), ("embed", "model"), ("mlp", "model"))),  # None assigns
    (("batch", None, "embed"), (("batch", ("data", "replica")), ("embed", "data"))),
    (("batch", U, "heads"), (("batch", "data"), ("heads", "model"))),
    ((), (("batch", "data"),)),
    (("a", "b"), ()),
    (("layers", "embed"), [["layers", "stage"], ["embed", "model"]]),
]


@pytest.mark.parametrize("names, rules", RESOLUTION)
def test_logical_to_mesh_axes_equals_linen(names, rules):
    ours = am.logical_to_mesh_axes(names, rules)
    assert ours == linen.logical_to_mesh_axes(names, rules)
    with am.logical_axis_rules(rules), linen.logical_axis_rules(rules):
        assert am.logical_to_mesh_axes(names) == linen.logical_to_mesh_axes(names) == ours
    assert am.logical_to_mesh_axes(None, rules) is linen.logical_to_mesh_axes(None, rules) is None


def test_logical_axis_rules_state():
    assert am.get_logical_axis_rules() == ()
    with am.logical_axis_rules((("a", "x"),)):
        assert am.get_logical_axis_rules() == (("a", "x"),)
        with am.logical_axis_rules(()):
            assert am.get_logical_axis_rules() == ()
        assert am.get_logical_axis_rules() == (("a", "x"),)
    am.set_logical_axis_rules((("b", "y"),))
    try:
        assert am.get_logical_axis_rules() == (("b", "y"),)
    finally:
        am.set_logical_axis_rules(())


def test_repeated_logical_name_is_an_error():
    with pytest.raises(ValueError):
        linen.logical_to_mesh_axes(("embed", "embed"), (("embed", "x"),))
    with pytest.raises(errors.PartitioningError, match=r"\('embed',\) occur more than once"):
        am.logical_to_mesh_axes(("embed", "embed"), (("embed", "x"),))


def test_rules_of_another_type_are_an_error():
    with pytest.raises(ValueError):
        linen.logical_to_mesh_axes(("embed",), {"embed": "x"})
    with pytest.raises(errors.PartitioningError, match="must be a tuple or list .* not a dict"):
        am.logical_to_mesh_axes(("embed",), {"embed": "x"})


def _boxes(lib):
    value = jnp.arange(6.0).reshape(2, 3)
    plain = lib.Partitioned(value, ("data", None))
    logical = lib.LogicallyPartitioned(value, ["embed", "mlp"], rules=[("embed", "data")])
    return plain, logical


@pytest.mark.parametrize("which", [0, 1])
def test_boxes_are_linen_s_pytrees(which):
    ours, theirs = _boxes(am)[which], _boxes(linen)[which]
    assert type(ours).__name__ == type(theirs).__name__
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]
    (path, leaf), = jax.tree_util.tree_flatten_with_path(ours)[0]
    assert jax.tree_util.keystr(path) == jax.tree_util.keystr(
        jax.tree_util.tree_flatten_with_path(theirs)[0][0][0]) == ".value"
    assert leaf is ours.value
    tree = jax.tree.structure(ours)
    hash(tree)                                   # lists in names and rules: still hashable
    again = jax.tree.unflatten(tree, [jnp.zeros((2, 3))])
    assert type(again) is type(ours) and again.names == theirs.names and again.names is ours.names
    assert ours.get_partition_spec() == theirs.get_partition_spec()
    assert ours.replace(names=("x", "y")).names == ("x", "y")
    np.testing.assert_array_equal(ours.unbox(), theirs.unbox())


def test_tree_helpers_equal_linen():
    tree = {"a": am.Partitioned(jnp.ones((2, 3)), ("x", None)), "b": jnp.zeros((4,)),
            "c": am.Partitioned(am.Partitioned(jnp.ones(2), ("y",)), ("z",))}
    flax_tree = {"a": flax_meta.Partitioned(jnp.ones((2, 3)), ("x", None)), "b": jnp.zeros((4,)),
                 "c": flax_meta.Partitioned(flax_meta.Partitioned(jnp.ones(2), ("y",)), ("z",))}
    assert jax.tree.structure(am.unbox(tree)) == jax.tree.structure(flax_meta.unbox(flax_tree))
    assert am.get_partition_spec(tree) == flax_meta.get_partition_spec(flax_tree)
    mesh = jax.make_mesh((2, 1, 1), ("x", "y", "z"))
    assert am.get_sharding(tree, mesh) == flax_meta.get_sharding(flax_tree, mesh)
    assert am.is_axis_metadata(tree["a"]) and not am.is_axis_metadata(tree["b"])
    params = {am.PARTITION_NAME: "layers"}
    for index in (0, 1, 4):
        added, flax_added = am.add_axis(tree, index, params), flax_meta.add_axis(flax_tree, index, params)
        assert am.get_partition_spec(added) == flax_meta.get_partition_spec(flax_added)
        assert am.get_partition_spec(am.remove_axis(added, index, params)) == \
            flax_meta.get_partition_spec(flax_meta.remove_axis(flax_added, index, params))
    updated = am.replace_boxed(tree, jax.tree.map(lambda x: x + 1, am.unbox(tree)))
    assert am.get_partition_spec(updated) == am.get_partition_spec(tree)
    np.testing.assert_array_equal(updated["a"].value, 2.0)


def test_add_axis_without_partition_name_is_an_error():
    box = am.Partitioned(jnp.ones(2), ("x",))
    with pytest.raises(errors.PartitioningError, match="'partition_name' is not specified"):
        box.add_axis(0, {})
    with pytest.raises(errors.PartitioningError, match="'partition_name' is not specified"):
        box.remove_axis(0, {})


def test_remove_axis_of_another_name_is_an_error():
    box = am.Partitioned(jnp.ones((3, 2)), ("layers", "x"))
    with pytest.raises(errors.PartitioningError, match="axis 0 .* named 'layers'.* named 'stage'"):
        box.remove_axis(0, {am.PARTITION_NAME: "stage"})


def test_unboxed_structure_strips_boxes_only():
    boxed = jax.tree.structure({"k": am.Partitioned(jnp.ones(2), ("x",)), "b": (1, 2)})
    plain = jax.tree.structure({"k": jnp.ones(2), "b": (1, 2)})
    assert am.unboxed_structure(boxed) == plain == am.unboxed_structure(plain)


def test_partition_spec_and_constraint_of_a_box():
    value = jnp.ones((2, 4))
    logical = am.LogicallyPartitioned(value, ("batch", "embed"))
    assert am.partition_spec_of(logical) is None               # no rules: Linen constrains nothing
    rules = (("batch", "x"), ("embed", "x"))
    with am.logical_axis_rules(rules):
        assert am.partition_spec_of(logical) == P("x", None)
        assert am.constraint_of(logical) is None                # no mesh
        mesh = jax.make_mesh((2,), ("x",))
        with jax.set_mesh(mesh):
            assert am.global_mesh() == mesh.abstract_mesh
            assert am.constraint_of(logical) == P("x", None)
        assert am.constraint_of(logical.replace(mesh=mesh)) == jax.sharding.NamedSharding(mesh, P("x", None))
    assert am.partition_spec_of(logical.replace(rules=(("embed", "x"),))) == P(None, "x")
    assert am.partition_spec_of(am.Partitioned(value, (None, "y"))) == P(None, "y")
    assert am.partition_spec_of(value) is None and am.global_mesh() is None


def test_unbox_constrains_as_linen_does_under_a_mesh():
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rules = (("embed", "x"),)

    def sharding(lib, box):
        @jax.jit
        def f(v):
            return lib.unbox(box.replace_boxed(v)) * 2
        return f(box.value).sharding

    for lib in (am, linen):                    # outside a mesh: the value itself
        box = lib.Partitioned(jnp.ones((4, 2)), ("x", None))
        assert box.unbox() is box.value
    with jax.set_mesh(mesh), am.logical_axis_rules(rules), linen.logical_axis_rules(rules):
        for make in (lambda lib: lib.Partitioned(jnp.ones((4, 2)), ("x", None)),
                     lambda lib: lib.LogicallyPartitioned(jnp.ones((4, 2)), ("embed", None))):
            ours, theirs = sharding(am, make(am)), sharding(linen, make(linen))
            assert ours.spec == theirs.spec == P("x")
