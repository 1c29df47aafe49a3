"""NNX's sharding helpers (``varjax/nnx/spmd.py``) against flax.nnx 0.12.8, on a 1x1 CPU
mesh: the metadata ``with_partitioning`` gives, and the ``PartitionSpec``/
``NamedSharding`` trees read from it, with and without logical axis rules."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as fnnx
from jax.sharding import NamedSharding, PartitionSpec

import varjax.nn as vnn
from varjax import errors, nnx
from varjax.nnx import spmd

MESH = jax.make_mesh((1, 1), ("data", "model"))
RULES = (("embed", "model"), ("hidden", "data"))


def _build(lib, with_partitioning, bias_axis="embed"):
    """A Linear whose kernel has mesh axes and whose bias has a logical name."""
    return lib.Linear(
        2, 3, kernel_init=with_partitioning(lib.initializers.lecun_normal(), (None, "model")),
        bias_init=with_partitioning(lib.initializers.zeros, (bias_axis,)), rngs=lib.Rngs(0))


@pytest.fixture(scope="module")
def models():
    with jax.set_mesh(MESH), fnnx.logical_axis_rules(RULES):   # flax.nnx shards eagerly
        theirs = _build(fnnx, fnnx.with_partitioning)
    return _build(nnx, spmd.with_partitioning), theirs


def _specs(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))


def test_partition_name_and_the_rule_context_are_flax_nnx_and_varjax_nn():
    assert spmd.PARTITION_NAME == fnnx.PARTITION_NAME == "partition_name"
    assert spmd.logical_axis_rules is vnn.logical_axis_rules      # one rule context


def test_with_partitioning_puts_out_sharding_and_mesh_metadata_as_flax_nnx(models):
    ours, theirs = models
    for a, b in ((ours.kernel, theirs.kernel), (ours.bias, theirs.bias)):
        expected = {k: v for k, v in b.get_metadata().items()
                    if k not in ("hijax", "ref", "eager_sharding")}
        assert a.get_metadata() == expected
        np.testing.assert_array_equal(a[...], b[...])


def test_get_partition_spec_of_a_state_is_flax_nnxs_under_logical_rules(models):
    ours, theirs = models
    with spmd.logical_axis_rules(RULES):
        mine = spmd.get_partition_spec(nnx.state(ours))
        with fnnx.logical_axis_rules(RULES):
            flax_ = fnnx.get_partition_spec(fnnx.state(theirs))
    assert nnx.to_pure_dict(mine) == fnnx.to_pure_dict(flax_) == {
        "bias": PartitionSpec("model"), "kernel": PartitionSpec(None, "model")}
    assert type(mine["kernel"]) is nnx.Param
    assert mine["kernel"].get_metadata() == ours.kernel.get_metadata()


def test_a_logical_name_no_rule_maps_stays_as_flax_nnx_keeps_it(models):
    ours, theirs = models
    assert spmd.get_partition_spec(ours).bias.get_value() == \
        fnnx.get_partition_spec(theirs).bias.get_value() == PartitionSpec("embed")


def test_a_variables_sharding_rules_compose_with_the_context_rules_as_flax_nnx():
    def make(lib):
        return lib.Param(jnp.ones((2, 2)), out_sharding=("hidden", "embed"),
                         sharding_rules=(("hidden", "data"),))
    with spmd.logical_axis_rules(RULES[:1]):
        mine = spmd.get_partition_spec(make(nnx)).get_value()
    with jax.set_mesh(MESH), fnnx.logical_axis_rules(RULES[:1]):
        flax_ = fnnx.get_partition_spec(make(fnnx)).get_value()
    assert mine == flax_ == PartitionSpec("data", "model")


def test_a_logical_name_mapped_two_ways_raises_naming_the_collection():
    v = nnx.Param(jnp.ones(2), out_sharding=("embed",), sharding_rules=(("embed", "data"),))
    with spmd.logical_axis_rules(RULES), pytest.raises(errors.PartitioningError,
                                                         match="'embed' of a Param") as e:
        spmd.get_partition_spec(v)
    assert isinstance(e.value, ValueError) and e.value.collection == "params"
    assert "test_nnx_spmd.py" in str(e.value)


def test_unannotated_variables_and_arrays_get_an_empty_spec_and_others_none_as_flax_nnx():
    tree = {"v": nnx.Param(jnp.ones(2)), "x": jnp.ones(3), "n": 3}
    ftree = {"v": fnnx.Param(jnp.ones(2)), "x": jnp.ones(3), "n": 3}
    mine, flax_ = spmd.get_partition_spec(tree), fnnx.get_partition_spec(ftree)
    assert mine["v"].get_value() == flax_["v"].get_value() == PartitionSpec()
    assert mine["x"] == flax_["x"] == PartitionSpec() and mine["n"] is flax_["n"] is None


def test_get_named_sharding_places_a_state_with_jax_device_put(models):
    ours, theirs = models
    state = nnx.state(ours)
    with spmd.logical_axis_rules(RULES):
        shardings = spmd.get_named_sharding(state, MESH)
        with fnnx.logical_axis_rules(RULES):
            flax_ = fnnx.get_named_sharding(fnnx.state(theirs), MESH)
    assert nnx.to_pure_dict(shardings) == fnnx.to_pure_dict(flax_)
    assert isinstance(shardings["kernel"].get_value(), NamedSharding)
    placed = jax.device_put(state, shardings)
    assert placed["kernel"][...].sharding.spec == PartitionSpec(None, "model")
    np.testing.assert_array_equal(placed["kernel"][...], ours.kernel[...])


def test_a_model_placed_by_its_named_shardings_runs_under_jit_on_the_mesh_as_flax_nnx():
    """flax.nnx places each Variable when it is made (eager sharding); varjax.nnx does not,
    so a model runs on an Explicit mesh once its state is placed by these helpers.  (Mesh
    axis names only: under a transform varjax reads out_sharding as mesh axes.)"""
    x = jnp.ones((1, 2))
    ours = _build(nnx, spmd.with_partitioning, "model")
    with jax.set_mesh(MESH):
        theirs = _build(fnnx, fnnx.with_partitioning, "model")
        state = nnx.state(ours)
        nnx.update(ours, jax.device_put(state, spmd.get_named_sharding(state, MESH)))
        out = nnx.jit(lambda m, x: m(x))(ours, x)
        expected = fnnx.jit(lambda m, x: m(x))(theirs, x)
    np.testing.assert_array_equal(out, expected)
    assert ours.kernel[...].sharding.spec == theirs.kernel[...].sharding.spec
