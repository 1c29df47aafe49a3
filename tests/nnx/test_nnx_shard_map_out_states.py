"""``nnx.StateSharding`` in ``nnx.shard_map``'s ``out_specs``, against flax.nnx 0.12.8 on the
2 CPU devices of tests/conftest.py: a module made inside comes out with each filter's part
concatenated along its spec, as flax.nnx gives it (same shapes, shardings and values)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax.sharding import PartitionSpec as P

from varjax import nnx
from varjax.nnx.filter_maps import StateSharding
from varjax.nnx.sharding_transforms import shard_map

MESH = jax.sharding.Mesh(jax.local_devices(), ("model",))
LIBS = [(nnx, shard_map, StateSharding),
        (flax_nnx, flax_nnx.shard_map, flax_nnx.StateSharding)]


def _made(lib, shard_map_, sharding):
    """A Linear made in every shard (the same Rngs seed), its kernel split by columns and
    returned with an array split by rows."""
    def init(x):
        return lib.Linear(3, 4, rngs=lib.Rngs(0)), x * 2
    spec = sharding({lib.PathContains("kernel"): P(None, "model"), ...: P()})
    return shard_map_(init, mesh=MESH, in_specs=(P("model"),), out_specs=(spec, P("model")))(
        jnp.arange(4.0))


@pytest.fixture(scope="module")
def made():
    return [_made(*libs) for libs in LIBS]


def test_state_sharding_out_specs_concatenates_each_filters_part_as_flax_nnx(made):
    (ours, y), (theirs, fy) = made
    assert type(ours) is nnx.Linear
    assert ours.kernel[...].shape == theirs.kernel[...].shape == (3, 8)
    assert ours.bias[...].shape == theirs.bias[...].shape == (4,)
    assert ours.kernel[...].sharding.spec == theirs.kernel[...].sharding.spec == P(None, "model")
    np.testing.assert_array_equal(ours.kernel[...], theirs.kernel[...])
    np.testing.assert_array_equal(ours.bias[...], theirs.bias[...])
    np.testing.assert_array_equal(y, fy)


def test_state_sharding_out_specs_in_tree_mode_is_a_value_error_as_flax_nnx():
    for lib, shard_map_, sharding in LIBS:
        with pytest.raises(ValueError, match="cannot contain `StateSharding`"):
            shard_map_(lambda: 0.0, mesh=MESH, in_specs=(), graph=False,
                       out_specs=sharding({...: P()}))
