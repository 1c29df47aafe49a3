"""vj.transform_metadata: the partition names of variables crossing an object-mode vmap.

NNX is the oracle for the ``out_sharding`` metadata of variables made inside a vmap; a
value boxed by ``nn.with_partitioning`` gets the same treatment.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import varjax as vj
from varjax import errors, nn

KEYS = jax.random.split(jax.random.key(0), 3)


def test_a_variable_made_inside_vmap_gets_the_partition_name_as_nnx_gives_it():
    @vj.vmap(in_axes=0, out_axes=0)
    @vj.transform_metadata(in_axes=0, out_axes=0, partition="layers")
    def make(key):
        return vj.Variable(jax.random.normal(key, (2, 4)), out_sharding=("embed", "mlp"))

    @nnx.vmap(in_axes=0, out_axes=0)
    @nnx.transform_metadata(in_axes=0, out_axes=0, partition="layers")
    def make_nnx(key):
        return nnx.Param(jax.random.normal(key, (2, 4)), out_sharding=("embed", "mlp"))

    mesh = jax.make_mesh((1, 1, 2), ("layers", "embed", "mlp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    with jax.set_mesh(mesh):         # NNX places a variable with out_sharding on creation
        want = make_nnx(KEYS)
    got = make(KEYS)
    assert got.get_metadata()["out_sharding"] == want.get_metadata()["out_sharding"] \
        == ("layers", "embed", "mlp")
    assert got.shape == (3, 2, 4)


def test_inside_the_body_an_argument_has_the_per_layer_names_and_keeps_its_own_after():
    w = vj.Variable(jnp.ones((3, 2, 4)), out_sharding=("layers", "embed", "mlp"))
    seen = []

    @vj.vmap(in_axes=(0, None))
    @vj.transform_metadata(in_axes=(0, None), partition="layers")
    def apply(w, x):
        seen.append(w.get_metadata()["out_sharding"])
        w.value = w.value * 2
        return x @ w.value

    y = apply(w, jnp.ones((1, 2)))
    assert seen == [("embed", "mlp")]
    assert w.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
    assert y.shape == (3, 1, 4) and float(w.value[0, 0, 0]) == 2.0


def test_a_boxed_value_gets_the_name_in_its_box():
    @vj.vmap
    @vj.transform_metadata(partition="layers")
    def make(key):
        return vj.Variable(nn.Partitioned(jax.random.normal(key, (2, 4)), ("embed", "mlp")))

    box = make(KEYS).value
    assert box.names == ("layers", "embed", "mlp") and box.value.shape == (3, 2, 4)


def test_removing_a_name_the_axis_does_not_carry_is_an_error():
    w = vj.Variable(jnp.ones((3, 2)), out_sharding=("embed", "mlp"))
    with pytest.raises(errors.PartitioningError, match="'embed', not 'layers'"):
        vj.transform_metadata(lambda w: w.value, partition="layers")(w)
    assert w.get_metadata()["out_sharding"] == ("embed", "mlp")     # left as it was


def test_a_bound_module_with_boxed_variables_is_refused():
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, kernel_init=nn.with_partitioning(
                nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
    model = Dense().bind(Dense().init(jax.random.key(0), jnp.ones((1, 3))))
    with pytest.raises(errors.NotProvidedError, match="metadata_params"):
        vj.transform_metadata(lambda m: 0, partition="layers")(model)


def test_one_variable_given_at_two_axes_is_refused_naming_its_collection():
    shared = vj.Variable(jnp.ones((2, 2)), collection="params", out_sharding=("a", "b"))
    body = vj.transform_metadata(lambda x, y: x.value, in_axes=(0, 1), out_axes=0,
                                 partition="a")
    with pytest.raises(errors.TransformError, match="two places with different axes") as caught:
        body(shared, shared)
    assert caught.value.collection == "params" and __file__ in str(caught.value)
    assert shared.get_metadata()["out_sharding"] == ("a", "b")     # nothing was changed
