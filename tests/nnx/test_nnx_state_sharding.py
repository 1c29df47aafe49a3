"""``nnx.StateSharding`` in ``nnx.shard_map``'s ``in_specs``, against flax.nnx 0.12.8: the two
tensor-parallel examples of flax.nnx's ``shard_map`` docstring (filters, and a ``State`` of
specs) run as written, over the CPU's devices (two, from tests/conftest.py): the same
outputs, the same shard shapes inside, and Variable updates written back; what is not built
is named."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax.sharding import PartitionSpec as P

from varjax import nnx
from varjax.nnx.filter_maps import StateSharding
from varjax.nnx.sharding_transforms import shard_map

MESH = jax.sharding.Mesh(jax.local_devices(), ('model',))
N = len(jax.local_devices())


def _lib(lib):
    if lib is nnx:
        return shard_map, StateSharding
    return flax_nnx.shard_map, flax_nnx.StateSharding


def _mlp(lib):
    class MLP(lib.Module):
        def __init__(self, din, dhidden, dout, *, rngs):
            self.linear1 = lib.Linear(din, dhidden, use_bias=False, rngs=rngs)
            self.linear2 = lib.Linear(dhidden, dout, use_bias=False, rngs=rngs)

        def __call__(self, x):
            return self.linear2(jax.nn.relu(self.linear1(x)))
    return MLP(2, 64, 3, rngs=lib.Rngs(0))


def _docstring(lib, by_state):
    """The docstring's example with filters (``by_state``: with a ``State`` of specs),
    returning y and the kernels' shard shapes seen inside."""
    shard_map_, state_sharding = _lib(lib)
    m = _mlp(lib)
    x = jnp.ones((32, 2))

    def path_ends_with(*path_suffix):  # custom filter
        return lambda path, value: path[-len(path_suffix):] == path_suffix

    model_spec = state_sharding(lib.State({
        'linear1': {'kernel': P(None, 'model')},
        'linear2': {'kernel': P('model', None)},
    }) if by_state else {
        path_ends_with('linear1', 'kernel'): P(None, 'model'),
        path_ends_with('linear2', 'kernel'): P('model', None),
    })
    seen = []

    @shard_map_(mesh=MESH, in_specs=(model_spec, P(None)), out_specs=P(None))
    def f(m, x):
        seen.append((m.linear1.kernel[...].shape, m.linear2.kernel[...].shape))
        y = m(x)
        return jax.lax.psum(y, 'model')
    return f(m, x), seen


@pytest.mark.parametrize("by_state", [False, True])
def test_state_sharding_docstring_tensor_parallel_mlp_matches_flax(by_state):
    y, seen = _docstring(nnx, by_state)
    fy, fseen = _docstring(flax_nnx, by_state)
    np.testing.assert_allclose(y, fy, rtol=1e-5)
    assert seen == fseen == [((2, 64 // N), (64 // N, 3))]


def _counting(lib, spec):
    """A Linear with a counter, its kernel split by columns, the rest (bias, counter)
    replicated; the counter written inside comes back."""
    shard_map_, state_sharding = _lib(lib)

    class Counting(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 4, rngs=rngs)
            self.calls = lib.BatchStat(jnp.zeros(()))
    m = Counting(lib.Rngs(0))
    axes = state_sharding({spec: P(None, 'model'), ...: P()})

    @shard_map_(mesh=MESH, in_specs=(axes, P()), out_specs=P(None, 'model'))
    def f(m, x):
        m.calls[...] += 1
        return x @ m.lin.kernel[...]
    return f(m, jnp.ones((1, 2))), m


def test_state_sharding_writes_updates_back_as_flax():
    kernel = lambda path, v: path[-1] == "kernel"  # noqa: E731
    (y, m), (fy, fm) = _counting(nnx, kernel), _counting(flax_nnx, kernel)
    np.testing.assert_array_equal(y, fy)
    assert float(m.calls[...]) == float(fm.calls[...]) == 1.0
    np.testing.assert_array_equal(m.lin.kernel[...], fm.lin.kernel[...])


def test_state_sharding_is_a_mapping_of_filters_to_specs_as_flax():
    ours = StateSharding({nnx.Param: P('model'), ...: P()})
    theirs = flax_nnx.StateSharding({flax_nnx.Param: P('model'), ...: P()})
    assert ours.shardings == theirs.shardings == (P('model'), P())
    assert ours == StateSharding({nnx.Param: P('model'), ...: P()}) and len(ours) == 2
    assert hash(ours) == hash(StateSharding([(nnx.Param, P('model')), (..., P())]))
    assert ours[...] == P()


def test_state_sharding_errors_match_flax_and_what_is_not_built_is_named():
    """Tree mode and a Variable no filter matches are flax.nnx's ValueErrors."""
    for lib in (nnx, flax_nnx):
        shard_map_, state_sharding = _lib(lib)
        spec = state_sharding({lib.Param: P()})
        with pytest.raises(ValueError, match="cannot contain `StateSharding`"):
            shard_map_(lambda m: m, mesh=MESH, in_specs=(spec,), out_specs=P(), graph=False)
        m = _mlp(lib)
        m.extra = lib.BatchStat(jnp.zeros(()))
        with pytest.raises(ValueError, match="No axis found"):
            shard_map_(lambda m: 0.0, mesh=MESH, in_specs=(spec,), out_specs=P())(m)
