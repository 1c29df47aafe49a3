"""``nnx.shard_map``, ``nnx.pmap`` and ``nnx.transform_metadata`` over NNX objects, against
flax.nnx, on the CPU's one device (a one-device ``Mesh``): the same outputs, Variable
updates written back to the caller's module, the note's ``transform_metadata`` example;
``use_eager_sharding``'s one position, off."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax.sharding import PartitionSpec as P

from varjax import errors, nnx
from varjax.nnx.eager_sharding import use_eager_sharding, using_eager_sharding
from varjax.nnx.sharding_transforms import pmap, shard_map, transform_metadata

X = jnp.arange(8.0).reshape(4, 2) / 7
MESH = jax.sharding.Mesh(jax.devices()[:1], ("data",))
SHARD_MAP = {nnx: shard_map, flax_nnx: flax_nnx.shard_map}
PMAP = {nnx: pmap, flax_nnx: flax_nnx.pmap}


def _model_class(lib):
    class Calls(lib.Variable):
        pass

    class Model(lib.Module):
        def __init__(self, rngs):
            self.linear = lib.Linear(2, 3, rngs=rngs)
            self.calls = Calls(jnp.array(0))

        def __call__(self, x):
            self.calls[...] += 1
            return self.linear(x)
    return Model


def _model(lib):
    return _model_class(lib)(lib.Rngs(0))


def test_shard_map_of_a_replicated_module_matches_flax_and_writes_back():
    outs = []
    for lib in (nnx, flax_nnx):
        model = _model(lib)
        f = SHARD_MAP[lib](lambda m, x: m(x), mesh=MESH, in_specs=(P(), P("data")),
                           out_specs=P("data"))
        f(model, X)
        outs.append((f(model, X), int(model.calls[...])))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    assert outs[0][1] == outs[1][1] == 2


def test_shard_map_decorator_form_updates_params_in_place_as_flax():
    kernels = []
    for lib in (nnx, flax_nnx):
        model = _model(lib)

        @SHARD_MAP[lib](mesh=MESH, in_specs=(P(), P("data")), out_specs=P())
        def sgd(m, x):
            grads = jax.grad(lambda k: jnp.sum(x @ k))(m.linear.kernel[...])
            m.linear.kernel[...] = m.linear.kernel[...] - 0.1 * jax.lax.psum(grads, "data")
            return jax.lax.psum(jnp.sum(x), "data")
        sgd(model, X)
        kernels.append(np.asarray(model.linear.kernel[...]))
    np.testing.assert_allclose(*kernels, rtol=1e-6)     # psum's order: an ulp


def test_shard_map_refuses_an_in_specs_entry_that_is_not_a_partition_spec():
    with pytest.raises(errors.NotProvidedError, match="in_specs entry other than a PartitionSpec"):
        shard_map(lambda m: m, mesh=MESH, in_specs=("data",), out_specs=P())


def test_pmap_of_a_broadcast_module_matches_flax_and_writes_back():
    outs = []
    for lib in (nnx, flax_nnx):
        model = _model(lib)
        f = PMAP[lib](lambda m, x: m(x), in_axes=(None, 0), axis_name="i")
        outs.append((f(model, X[None]), int(model.calls[...])))
    assert outs[0][0].shape == (1, 4, 3)
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    assert outs[0][1] == outs[1][1] == 1


def test_pmap_of_a_stacked_module_comes_back_stacked_as_flax():
    outs = []
    for lib in (nnx, flax_nnx):
        stack = lib.vmap(_model_class(lib))(lib.Rngs(0).split(1))
        f = PMAP[lib](lambda m, x: m(x), in_axes=(0, 0))
        outs.append((f(stack, X[None]), np.asarray(stack.calls[...])))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    assert outs[0][1].shape == (1,)


def _stack(lib, tm):
    @lib.split_rngs(splits=3)
    @lib.vmap(in_axes=0, out_axes=0)
    @tm(in_axes=0, out_axes=0, partition="din")
    def create_stack(rngs):
        return lib.Variable(rngs.uniform((4,)), out_sharding=("dout",))
    return create_stack(lib.Rngs(0))


def test_the_notes_transform_metadata_example_adds_the_partition_as_flax():
    ours = _stack(nnx, transform_metadata)
    with flax_nnx.use_eager_sharding(False):    # no mesh: flax would place it eagerly
        theirs = _stack(flax_nnx, flax_nnx.transform_metadata)
    assert ours.shape == (3, 4) and ours.out_sharding == theirs.out_sharding == ("din", "dout")
    np.testing.assert_array_equal(ours[...], theirs[...])


def test_transform_metadata_takes_keyword_arguments_at_their_positions():
    @transform_metadata(in_axes=(0, None), out_axes=0, partition="layers")
    def scale(v, factor):
        return nnx.Variable(v[...] * factor, out_sharding=("embed",))
    v = nnx.Variable(jnp.ones((2, 3)), out_sharding=("layers", "embed"))
    out = scale(v, factor=2.0)
    assert out.out_sharding == ("layers", "embed") and v.out_sharding == ("layers", "embed")


def test_use_eager_sharding_false_as_a_with_block_and_a_decorator_as_flax():
    with use_eager_sharding(False), flax_nnx.use_eager_sharding(False):
        assert using_eager_sharding() is flax_nnx.using_eager_sharding() is False
        v = nnx.Variable(jnp.ones(2), out_sharding=("data",))
    assert v.out_sharding == ("data",) and using_eager_sharding() is False

    @use_eager_sharding(False)
    def make():
        return nnx.Param(jnp.ones(2), out_sharding=("data",))
    assert make().out_sharding == ("data",)


def test_use_eager_sharding_true_is_not_provided():
    with pytest.raises(errors.NotProvidedError, match="shard-variables"):
        use_eager_sharding(True)


def test_pmap_maps_keyword_arguments_along_axis_0_as_jax_pmap():
    got = pmap(lambda m, x: m(x), in_axes=(None,))(_model(nnx), x=X[None])
    want = flax_nnx.pmap(lambda m, x: m(x), in_axes=(None, 0))(_model(flax_nnx), X[None])
    np.testing.assert_array_equal(got, want)
