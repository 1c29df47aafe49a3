"""shard-variables: reads and writes of partitioned variables are constrained in the IR.

The partition names ride on the ``var_get``/``var_set`` equations (their treedef), the pass
places Linen's constraint under the active mesh and logical rules, and the lifted
``nn.scan``/``nn.vmap`` move the names with ``metadata_params`` exactly as Linen does.
"""
from __future__ import annotations

import flax.errors
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import varjax as vj
from varjax import errors, nn

X = jnp.ones((2, 3))
RULES = (("batch", None), ("embed", None), ("mlp", "model"), ("layers", None))


def _mesh(axis_types=AxisType.Auto):
    return jax.make_mesh((2,), ("model",), axis_types=(axis_types,))


def _logical(lib):
    class Net(lib.Module):
        @lib.compact
        def __call__(self, x):
            h = lib.Dense(4, kernel_init=lib.with_logical_partitioning(
                lib.initializers.lecun_normal(), ("embed", "mlp")))(x)
            count = self.variable("stats", "seen", lib.with_logical_partitioning(
                jnp.zeros, ("mlp",)), (4,))
            if self.is_mutable_collection("stats"):
                count.value = count.value + h.sum(0)
            return h
    return Net()


def _constraints(jaxpr):
    return [e.params["sharding"].spec for e in jaxpr.jaxpr.eqns if e.primitive.name == "sharding_constraint"]


def test_partition_names_are_printed_on_the_variable_equations():
    variables = _logical(nn).init(jax.random.key(0), X)
    text = vj.pretty(_logical(nn).functionalize().jaxpr(X, variables=variables, mutable=["stats"]),
                     color=False)
    assert "var_get[params:Dense_0/kernel ('embed', 'mlp')]" in text
    assert "var_get[stats:seen ('mlp',)]" in text


def test_without_a_mesh_the_pass_changes_nothing():
    variables = _logical(nn).init(jax.random.key(0), X)
    traced = _logical(nn).functionalize().traced(X, variables=variables, mutable=["stats"])
    assert _constraints(traced.pure) == []
    assert "shard-variables.constrained" not in traced.stats


def test_reads_and_writes_are_constrained_to_the_rules_under_the_mesh():
    variables = _logical(nn).init(jax.random.key(0), X)
    with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES):
        traced = _logical(nn).functionalize().traced(X, variables=variables, mutable=["stats"])
    # the kernel read, the stats read and the stats write
    assert _constraints(traced.pure) == [P(None, "model"), P("model"), P("model")]
    assert traced.stats["shard-variables.constrained"] == 3


def test_a_jitted_apply_equals_linen_and_its_constrained_write_comes_out_sharded():
    lv = _logical(linen).init(jax.random.key(0), X)
    vv = _logical(nn).init(jax.random.key(0), X)
    with jax.set_mesh(_mesh()), nn.logical_axis_rules(RULES), linen.logical_axis_rules(RULES):
        want, wstate = jax.jit(lambda v: _logical(linen).apply(v, X, mutable=["stats"]))(lv)
        got, gstate = jax.jit(lambda v: _logical(nn).apply(v, X, mutable=["stats"]))(vv)
    np.testing.assert_array_equal(got, want)
    seen = gstate["stats"]["seen"]
    np.testing.assert_array_equal(seen.value, wstate["stats"]["seen"].value)
    assert seen.names == ("mlp",) and seen.value.sharding.spec == P("model")


def test_changing_the_rules_retraces():
    variables = _logical(nn).init(jax.random.key(0), X)
    fz = _logical(nn).functionalize()
    with jax.set_mesh(_mesh()):
        with nn.logical_axis_rules(RULES):
            first = _constraints(fz.traced(X, variables=variables).pure)
        with nn.logical_axis_rules((("embed", "model"), ("mlp", None))):
            second = _constraints(fz.traced(X, variables=variables).pure)
    assert first == [P(None, "model")] and second == [P("model", None)]


def test_a_box_with_its_own_mesh_is_constrained_without_an_active_one():
    mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Auto,))
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, kernel_init=nn.with_partitioning(
                nn.initializers.lecun_normal(), (None, "model"), mesh=mesh))(x)
    variables = Net().init(jax.random.key(0), X)
    (sharding,) = [e.params["sharding"] for e in Net().functionalize().functional_jaxpr(
        X, variables=variables).jaxpr.eqns if e.primitive.name == "sharding_constraint"]
    assert sharding == NamedSharding(mesh, P(None, "model"))


def test_a_mismatched_sharding_under_explicit_axes_names_the_variable():
    variables = _logical(nn).init(jax.random.key(0), X)
    with jax.set_mesh(_mesh(AxisType.Explicit)), nn.logical_axis_rules(RULES):
        with pytest.raises(errors.PartitioningError, match=r"Dense_0/kernel.*'params'") as info:
            _logical(nn).apply(variables, X)
    assert "test_shard_variables.py" in str(info.value)


def _stack(lib, transform, **meta):
    class Block(lib.Module):
        @lib.compact
        def __call__(self, c, _=None):
            c = lib.Dense(3, kernel_init=lib.with_partitioning(
                lib.initializers.lecun_normal(), ("embed", "mlp")))(c)
            return (c, None) if transform == "scan" else c

    class Net(lib.Module):
        @lib.compact
        def __call__(self, x):
            if transform == "scan":
                return lib.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                                length=3, **meta)()(x, None)[0]
            return lib.vmap(Block, variable_axes={"params": 1}, split_rngs={"params": True},
                            in_axes=0, out_axes=0, **meta)()(x)
    return Net()


@pytest.mark.parametrize("transform", ["scan", "vmap"])
def test_metadata_params_insert_the_axis_name_as_linen_does(transform):
    meta = {"metadata_params": {linen.PARTITION_NAME: "layers"}}
    want = _stack(linen, transform, **meta).init(jax.random.key(0), X)
    got = _stack(nn, transform, **meta).init(jax.random.key(0), X)
    assert nn.get_partition_spec(got) == linen.get_partition_spec(want)
    for a, b in zip(jax.tree.leaves(nn.unbox(got)), jax.tree.leaves(linen.unbox(want))):
        np.testing.assert_array_equal(a, b)
    spec = nn.get_partition_spec(got)["params"]
    (block,) = spec.values()
    axis = ("layers", "embed", "mlp") if transform == "scan" else ("embed", "layers", "mlp")
    assert block["Dense_0"]["kernel"] == P(*axis)
    out = _stack(nn, transform, **meta).apply(got, X)          # boxed params go back in
    np.testing.assert_allclose(out, _stack(linen, transform, **meta).apply(want, X), rtol=1e-6)


def test_a_partitioned_variable_crossing_a_scan_without_metadata_params_is_an_error():
    with pytest.raises(errors.PartitioningError, match="metadata_params"):
        _stack(nn, "scan").init(jax.random.key(0), X)
    with pytest.raises(flax.errors.PartitioningUnspecifiedError):     # Linen's error
        _stack(linen, "scan").init(jax.random.key(0), X)


def _named(lib):
    class Net(lib.Module):
        @lib.compact
        def __call__(self, x):
            return lib.Dense(4, kernel_init=lib.with_partitioning(
                lib.initializers.lecun_normal(), ("embed", "model")))(x)
    return Net()


def test_a_name_off_the_mesh_is_an_error_naming_the_variable_where_linen_raises_jaxs():
    lv, vv = _named(linen).init(jax.random.key(0), X), _named(nn).init(jax.random.key(0), X)
    with jax.set_mesh(_mesh()):
        with pytest.raises(ValueError, match="embed"):
            _named(linen).apply(lv, X)
        with pytest.raises(errors.PartitioningError,
                           match=r"Dense_0/kernel of collection 'params'.*'embed' is no axis"
                           ) as info:
            _named(nn).apply(vv, X)
    assert isinstance(info.value, ValueError) and "test_shard_variables.py" in str(info.value)


def test_a_name_off_the_mesh_is_read_through_the_active_rules():
    """What flax.nnx does with a Variable's out_sharding; Linen's own unbox would raise."""
    variables = _named(nn).init(jax.random.key(0), X)
    with jax.set_mesh(_mesh()), nn.logical_axis_rules((("embed", None), ("model", "x"))):
        traced = _named(nn).functionalize().traced(X, variables=variables)
    assert _constraints(traced.pure) == [P(None, "model")]      # a mesh axis is kept
