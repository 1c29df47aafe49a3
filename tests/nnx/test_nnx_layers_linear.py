"""``nnx.LinearGeneral``, ``Einsum``, ``ConvTranspose``, ``Linear``'s options and
``Embed.attend``: flax.nnx 0.12.8's parameters (paths, values bit for bit from the same
seed, metadata), outputs and errors, side by side."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.convolution import Conv, ConvTranspose
from varjax.nnx.einsum import Einsum
from varjax.nnx.embedding import Embed
from varjax.nnx.linear import Linear, LinearGeneral


def same(a, b):
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def close(a, b):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def standard(fn):
    """flax.nnx mixes dtypes implicitly (a float16 product plus a float32 bias), so the
    oracle runs under standard promotion; ours runs under the suite's strict promotion."""
    def call(*args, **kwargs):
        with jax.numpy_dtype_promotion("standard"):
            return fn(*args, **kwargs)
    return call


def both(cls, flax_cls, *args, seed=0, **kwargs):
    return (cls(*args, rngs=nnx.Rngs(seed), **kwargs),
            flax_cls(*args, rngs=flax_nnx.Rngs(seed), **kwargs))


def same_state(ours, theirs):
    """The same paths, Variable types and values as flax.nnx's ``nnx.state``."""
    got = nnx.to_flat_state(nnx.state(ours))
    want = flax_nnx.to_flat_state(flax_nnx.state(theirs))
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want):
        assert type(a).__name__ == type(b).__name__, path
        same(a[...], b[...])


X = jax.random.normal(jax.random.key(1), (2, 3, 4))
# flax.nnx shards a Variable with out_sharding metadata eagerly, so it needs a mesh.
MESH = jax.make_mesh((1, 1), ("din", "dout"))


# -- LinearGeneral ------------------------------------------------------------------------

@pytest.mark.parametrize("args, kwargs, x_shape", [
    ((4, (3, 2)), {}, (2, 4)),
    (((3, 4), (2, 5)), {"axis": (1, -1), "param_dtype": jnp.bfloat16,
                        "bias_init": flax_nnx.initializers.ones}, (2, 3, 4)),
    ((4, 5), {"batch_axis": {0: 2}}, (2, 3, 4)),
    ((3, (2, 2)), {"axis": 1, "batch_axis": {0: 2}, "use_bias": False}, (2, 3, 4)),
    ((4, 3), {"dtype": jnp.float16, "param_dtype": jnp.float32,
              "preferred_element_type": jnp.float32}, (2, 4)),
])
def test_linear_general_matches_flax_nnx(args, kwargs, x_shape):
    ours, theirs = both(LinearGeneral, flax_nnx.LinearGeneral, *args, **kwargs)
    same_state(ours, theirs)
    for name in ("in_features", "out_features", "axis", "use_bias"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert dict(ours.batch_axis) == dict(theirs.batch_axis)
    x = jax.random.normal(jax.random.key(2), x_shape)
    close(ours(x), standard(theirs)(x))


def test_linear_general_initializers_see_the_flattened_kernel_as_flax_nnx():
    seen, flax_seen = [], []

    def recording(log):
        def init(key, shape, dtype):
            log.append(shape)
            return jnp.ones(shape, dtype)
        return init
    LinearGeneral((2, 3), (4, 5), axis=(1, 2), batch_axis={0: 6}, kernel_init=recording(seen),
                  bias_init=recording(seen), rngs=nnx.Rngs(0))
    flax_nnx.LinearGeneral((2, 3), (4, 5), axis=(1, 2), batch_axis={0: 6},
                           kernel_init=recording(flax_seen), bias_init=recording(flax_seen),
                           rngs=flax_nnx.Rngs(0))
    assert seen == flax_seen == [(36, 20), (120,)]


def test_linear_general_dot_general_cls_and_dot_general_are_used_as_in_flax_nnx():
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs.get("preferred_element_type"))
        return jax.lax.dot_general(*args, **kwargs)
    ours = LinearGeneral(4, 3, dot_general=counting, rngs=nnx.Rngs(0))
    ours(X)
    ours = LinearGeneral(4, 3, dot_general_cls=lambda: counting,
                         preferred_element_type=jnp.float32, rngs=nnx.Rngs(0))
    ours(X)
    assert calls == [None, jnp.float32]


def test_linear_general_with_partitioning_keeps_the_out_sharding_as_flax_nnx():
    """The initializers see flattened shapes; the metadata survives the reshape."""
    sharding = (None, "din", "dout")
    inits = {"kernel_init": nnx.with_partitioning(nnx.initializers.lecun_normal(), sharding),
             "bias_init": nnx.with_partitioning(nnx.initializers.ones, sharding[1:])}
    flax_inits = {
        "kernel_init": flax_nnx.with_partitioning(flax_nnx.initializers.lecun_normal(),
                                                  sharding),
        "bias_init": flax_nnx.with_partitioning(flax_nnx.initializers.ones, sharding[1:])}
    ours = LinearGeneral(4, (3, 2), **inits, rngs=nnx.Rngs(0))
    with jax.set_mesh(MESH):
        theirs = flax_nnx.LinearGeneral(4, (3, 2), **flax_inits, rngs=flax_nnx.Rngs(0))
    assert ours.kernel.out_sharding == tuple(theirs.kernel.out_sharding) == sharding
    assert ours.bias.out_sharding == tuple(theirs.bias.out_sharding) == sharding[1:]
    same_state(ours, theirs)


@pytest.mark.parametrize("kwargs, match, path", [
    ({"in_features": (2, 3), "out_features": 4}, "same length", ("in_features",)),
    ({"in_features": 3, "out_features": 4, "batch_axis": {1: 2}}, "consecutive",
     ("batch_axis",)),
])
def test_linear_general_bad_arguments_are_config_errors_as_flax_nnx_value_errors(
        kwargs, match, path):
    with pytest.raises(ValueError):
        flax_nnx.LinearGeneral(**kwargs, rngs=flax_nnx.Rngs(0))
    with pytest.raises(errors.ConfigError, match=match) as info:
        LinearGeneral(**kwargs, rngs=nnx.Rngs(0))
    assert info.value.path == path
    assert "test_nnx_layers_linear.py" in info.value.source


# -- Linear's flax.nnx 0.12.8 options ------------------------------------------------------

def test_linear_preferred_element_type_and_metadata_match_flax_nnx():
    kwargs = dict(dtype=jnp.float16, preferred_element_type=jnp.float32,
                  kernel_metadata={"tag": "k"}, bias_metadata={"tag": "b"})
    ours, theirs = both(Linear, flax_nnx.Linear, 4, 3, **kwargs)
    same_state(ours, theirs)
    assert ours.kernel.tag == theirs.kernel.tag == "k"
    assert ours.bias.tag == theirs.bias.tag == "b"
    got = ours(X)
    assert got.dtype == jnp.float32
    close(got, standard(theirs)(X))


def test_layers_built_with_other_initializers_have_one_graphdef_as_in_flax_nnx():
    zeros, ones = nnx.initializers.zeros, nnx.initializers.ones
    for cls, args in ((Linear, (2, 4)), (LinearGeneral, (2, (3, 4))),
                      (Einsum, ("ik,kj->ij", (5, 4), (4,))), (ConvTranspose, (2, 4, 3))):
        one = cls(*args, kernel_init=zeros, bias_init=zeros, rngs=nnx.Rngs(0))
        other = cls(*args, kernel_init=ones, bias_init=ones, rngs=nnx.Rngs(0))
        assert nnx.graphdef(one) == nnx.graphdef(other), cls.__name__


@pytest.mark.parametrize("cls, args", [
    (Linear, (2, 4)), (LinearGeneral, (2, (3, 4))), (Einsum, ("ik,kj->ij", (2, 4), (4,))),
    (ConvTranspose, (2, 4, 3)),
])
def test_metadata_arguments_reach_the_variables_as_in_flax_nnx(cls, args):
    kwargs = {"kernel_metadata": {"out_sharding": ("din", "dout")},
              "bias_metadata": {"out_sharding": ("dout",)}}
    ours = cls(*args, rngs=nnx.Rngs(0), **kwargs)
    with jax.set_mesh(MESH):
        theirs = getattr(flax_nnx, cls.__name__)(*args, rngs=flax_nnx.Rngs(0), **kwargs)
    assert ours.kernel.out_sharding == theirs.kernel.out_sharding == ("din", "dout")
    assert ours.bias.out_sharding == theirs.bias.out_sharding == ("dout",)


def test_out_sharding_is_not_provided():
    for call in (lambda: Linear(4, 3, rngs=nnx.Rngs(0))(X, out_sharding="x"),
                 lambda: LinearGeneral(4, 3, rngs=nnx.Rngs(0))(X, out_sharding="x"),
                 lambda: Einsum("abc,cd->abd", (4, 2), rngs=nnx.Rngs(0))(X, out_sharding="x")):
        with pytest.raises(errors.NotProvidedError, match="out_sharding"):
            call()


# -- Einsum -------------------------------------------------------------------------------

EINSUM_X = jax.random.normal(jax.random.key(3), (2, 3, 2, 3, 4))


@pytest.mark.parametrize("einsum_str, bias_shape, kwargs", [
    ("defab,bcef->adefc", (3, 2, 5), {}),
    ("d...ab,bc...->ad...c", (3, 2, 5), {"dtype": jnp.float16, "param_dtype": jnp.float32,
                                         "preferred_element_type": jnp.float32}),
    ("defab, bcef -> adefc", None, {"param_dtype": jnp.float16}),   # spaces are dropped
])
def test_einsum_matches_flax_nnx(einsum_str, bias_shape, kwargs):
    ours, theirs = both(Einsum, flax_nnx.Einsum, einsum_str, (4, 5, 3, 2), bias_shape,
                        **kwargs)
    same_state(ours, theirs)
    assert ours.einsum_str == theirs.einsum_str
    assert ours.kernel_shape == theirs.kernel_shape and ours.bias_shape == theirs.bias_shape
    close(ours(EINSUM_X), standard(theirs)(EINSUM_X))


def test_einsum_equation_at_the_call_replaces_the_layers_as_in_flax_nnx():
    ours, theirs = both(Einsum, flax_nnx.Einsum, "abc,cd->abd", (4, 5), (5,))
    close(ours(X, "abc,cd->bad"), theirs(X, "abc,cd->bad"))


def test_einsum_without_an_equation_at_either_place_is_a_config_error():
    layer = Einsum(None, (4, 5), rngs=nnx.Rngs(0))
    close(layer(X, "abc,cd->abd"), jnp.einsum("abc,cd->abd", X, layer.kernel[...]))
    with pytest.raises(errors.ConfigError, match="einsum_str"):
        layer(X)


def test_einsum_op_replaces_jnp_einsum_as_in_flax_nnx():
    def custom_einsum(*args, **kwargs):
        out = jnp.einsum(*args, **kwargs)
        return out.reshape((1, *out.shape))
    layer = Einsum("ab,bc->ac", (3, 4), einsum_op=custom_einsum, rngs=nnx.Rngs(42))
    assert layer(jnp.ones((2, 3))).shape == (1, 2, 4)


@pytest.mark.parametrize("einsum_str, match", [
    ("abc,cd", "explicit"), ("abc,cd,de->abe", "exactly two operands"),
])
def test_einsum_bad_equations_are_config_errors_as_flax_nnx_value_errors(einsum_str, match):
    with pytest.raises(ValueError):
        flax_nnx.Einsum(einsum_str, (4, 5), rngs=flax_nnx.Rngs(0))
    with pytest.raises(errors.ConfigError, match=match) as info:
        Einsum(einsum_str, (4, 5), rngs=nnx.Rngs(0))
    assert "test_nnx_layers_linear.py" in info.value.source
    layer = Einsum("abc,cd->abd", (4, 5), rngs=nnx.Rngs(0))
    with pytest.raises(errors.ConfigError, match=match):
        layer(X, einsum_str)


# -- ConvTranspose ------------------------------------------------------------------------

# One kernel size throughout: each new shape costs the initializers a compilation.
@pytest.mark.parametrize("x_shape, kwargs", [
    ((2, 5, 4, 3), {}),
    ((5, 4, 3), {"strides": (2, 1), "padding": "CIRCULAR"}),               # no batch axis
    ((2, 2, 5, 4, 3), {"strides": 2, "padding": "CIRCULAR", "transpose_kernel": True,
                       "use_bias": False}),                               # two batch axes
    ((2, 5, 4, 3), {"padding": (2, 1), "kernel_dilation": (2, 1), "dtype": jnp.bfloat16}),
    ((2, 5, 4, 3), {"strides": 2, "padding": "VALID", "mask": jnp.tril(jnp.ones((3, 2, 3, 4))),
                    "param_dtype": jnp.float16, "preferred_element_type": jnp.float32}),
])
def test_conv_transpose_matches_flax_nnx(x_shape, kwargs):
    ours, theirs = both(ConvTranspose, flax_nnx.ConvTranspose, 3, 4, (3, 2), **kwargs)
    same_state(ours, theirs)
    assert ours.kernel_shape == theirs.kernel_shape
    x = jax.random.normal(jax.random.key(2), x_shape)
    close(ours(x), standard(theirs)(x))


@pytest.mark.parametrize("cls", [ConvTranspose, Conv])
def test_conv_mask_of_another_shape_is_a_config_error_as_flax_nnx_value_error(cls):
    mask = jnp.ones((3, 2, 4, 3))
    x = jnp.ones((2, 5, 4, 3))
    with pytest.raises(ValueError, match="same shape"):
        getattr(flax_nnx, cls.__name__)(3, 4, (3, 2), mask=mask, rngs=flax_nnx.Rngs(0))(x)
    layer = cls(3, 4, (3, 2), mask=mask, rngs=nnx.Rngs(0))
    with pytest.raises(errors.ConfigError, match="Mask needs to have the same shape") as info:
        layer(x)
    assert info.value.path == ("mask",)
    assert "test_nnx_layers_linear.py" in info.value.source


# -- Embed --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"param_dtype": jnp.float16},
                                    {"dtype": jnp.float16, "param_dtype": jnp.float32}])
def test_embed_attend_and_sizes_match_flax_nnx(kwargs):
    ours, theirs = both(Embed, flax_nnx.Embed, 5, 4, **kwargs)
    assert (ours.num_embeddings, ours.features) == (theirs.num_embeddings, theirs.features)
    assert ours.dtype == theirs.dtype
    same_state(ours, theirs)
    got = ours.attend(X)
    assert got.shape == (2, 3, 5)
    close(got, standard(theirs.attend)(X))


# -- under transforms ---------------------------------------------------------------------

class Stack(nnx.Module):
    """One of each layer, so one jit, one grad and one vmap cover them all."""

    def __init__(self, rngs):
        self.general = LinearGeneral(4, (2, 3), rngs=rngs)
        self.einsum = Einsum("abcd,de->abce", (3, 4), (4,), rngs=rngs)
        self.up = ConvTranspose(4, 2, 2, strides=2, rngs=rngs)
        self.embed = Embed(5, 2, rngs=rngs)

    def __call__(self, x):
        return self.embed.attend(self.up(self.einsum(self.general(x))))


@pytest.fixture(scope="module")
def stacks():
    class FlaxStack(flax_nnx.Module):
        def __init__(self, rngs):
            self.general = flax_nnx.LinearGeneral(4, (2, 3), rngs=rngs)
            self.einsum = flax_nnx.Einsum("abcd,de->abce", (3, 4), (4,), rngs=rngs)
            self.up = flax_nnx.ConvTranspose(4, 2, 2, strides=2, rngs=rngs)
            self.embed = flax_nnx.Embed(5, 2, rngs=rngs)
        __call__ = Stack.__call__
    return Stack(nnx.Rngs(0)), FlaxStack(flax_nnx.Rngs(0))


def loss(model, x):
    return jnp.sum(model(x) ** 2)


def test_layers_under_jit_match_eager_flax_nnx(stacks):
    ours, theirs = stacks
    same_state(ours, theirs)
    close(nnx.jit(loss)(ours, X), loss(theirs, X))


def test_layers_under_grad_match_flax_nnx_grad(stacks):
    ours, theirs = stacks
    got, want = nnx.grad(loss)(ours, X), flax_nnx.grad(loss)(theirs, X)
    got, want = nnx.to_flat_state(got), flax_nnx.to_flat_state(want)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want):
        np.testing.assert_allclose(a[...], b[...], rtol=1e-5, atol=1e-6, err_msg=str(path))


def test_layers_under_vmap_over_the_input_match_flax_nnx(stacks):
    ours, theirs = stacks
    xs = jnp.stack([X, -X])
    got = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(ours, xs)
    want = flax_nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(theirs, xs)
    close(got, want)
