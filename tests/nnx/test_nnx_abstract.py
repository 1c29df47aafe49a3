"""``as_abstract``/``get_abstract_model``: abstract models carrying the shardings their
Variables' ``out_sharding`` metadata says, against flax.nnx (a one-device mesh)."""
import jax
import pytest
from flax import nnx as flax_nnx

from varjax import nnx
from varjax.nnx import abstract, spmd

MESH = jax.make_mesh((1,), ("a",), axis_types=(jax.sharding.AxisType.Auto,))
LIBS = [(nnx, spmd, abstract), (flax_nnx, flax_nnx, flax_nnx)]


def _make(lib, shard):
    return lambda: lib.Linear(4, 8, rngs=lib.Rngs(0), kernel_init=shard.with_partitioning(
        lib.initializers.lecun_normal(), (None, "a")))


@pytest.mark.parametrize("lib, shard, ab", LIBS)
def test_as_abstract_gives_abstract_variables_their_named_sharding_as_flax_nnx(lib, shard, ab):
    with jax.set_mesh(MESH):
        model = ab.as_abstract(lib.eval_shape(_make(lib, shard)))
    kernel = model.kernel.get_value()
    assert isinstance(kernel, jax.ShapeDtypeStruct) and kernel.shape == (4, 8)
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "a")
    assert type(model.kernel) is lib.Param
    with pytest.warns(DeprecationWarning, match="as_abstract"), jax.set_mesh(MESH):
        ab.abstract_with_sharding(lib.eval_shape(_make(lib, shard)))


def test_get_abstract_model_returns_the_graphdef_and_sharded_abstract_state_as_flax_nnx():
    got = []
    for lib, shard, ab in LIBS:
        g, state = ab.get_abstract_model(_make(lib, shard), MESH)
        assert isinstance(g, lib.GraphDef)
        got.append(jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding.spec),
                                lib.to_pure_dict(state)))
    assert got[0] == got[1]
