"""The layers added for Linen parity (issue 18), against flax.linen on the same variables:
ConvLocal, Einsum, PReLU, InstanceNorm, WeightNorm, SpectralNorm, BatchApply.

Each test initializes both libraries (same variable layout: paths, shapes, dtypes; values
are not compared, since the RNG derivation is another piece of work), then applies both to
the *same* perturbed variables and compares outputs, updated collections and gradients.
"""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import assert_close, check_parity

import varjax.nn as nn
from varjax import errors
from varjax.errors import NotProvidedError


def _x(shape, seed=0):
    # NumPy draws: no XLA compile per input shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def check_grads(vj_layer, flax_layer, variables, *inputs, atol=1e-5, **kwargs):
    """d(sum of outputs)/d(params) agree when both libraries run on ``variables``."""
    def loss(layer):
        def f(params):
            out = layer.apply({**variables, "params": params}, *inputs, **kwargs)
            return sum(jnp.sum(y) for y in jax.tree.leaves(out))
        return f
    assert_close(jax.grad(loss(vj_layer))(variables["params"]),
                 jax.grad(loss(flax_layer))(variables["params"]), atol)


@pytest.mark.parametrize("kwargs, shape, grads", [
    ({"kernel_size": (3,), "padding": "VALID"}, (2, 8, 3), True),
    ({"kernel_size": (3, 3), "strides": 2, "padding": "CIRCULAR"}, (1, 6, 5, 2), False),
    ({"kernel_size": (2,), "strides": 2, "use_bias": False, "kernel_dilation": 2}, (2, 8, 3), False),
    ({"kernel_size": (3,), "padding": "CAUSAL"}, (3, 2, 7, 2), False),   # two batch axes
    ({"kernel_size": (3,)}, (8, 3), False),                              # no batch axis
])
def test_conv_local_matches_linen(kwargs, shape, grads):
    x = _x(shape)
    variables, _, _ = check_parity(nn.ConvLocal(4, **kwargs), flax_nn.ConvLocal(4, **kwargs), x)
    if grads:
        check_grads(nn.ConvLocal(4, **kwargs), flax_nn.ConvLocal(4, **kwargs), variables, x)


def test_conv_local_parameter_layout_is_linen_s():
    variables = nn.ConvLocal(4, (3,), padding="VALID").init(jax.random.key(0), jnp.ones((1, 8, 3)))
    assert jax.tree.map(jnp.shape, variables) == {"params": {"bias": (6, 4), "kernel": (6, 9, 4)}}


def test_conv_local_with_mask_matches_linen():
    mask = jnp.tril(jnp.ones((6, 9, 4)))
    kw = {"kernel_size": (3,), "padding": "VALID", "mask": mask}
    check_parity(nn.ConvLocal(4, **kw), flax_nn.ConvLocal(4, **kw), _x((2, 8, 3)))


def test_conv_local_feature_groups_are_not_provided():
    with pytest.raises(NotProvidedError, match="feature_group_count") as info:
        nn.ConvLocal(4, (3,), feature_group_count=3).init(jax.random.key(0), jnp.ones((1, 8, 3)))
    assert isinstance(info.value, NotImplementedError) and "test_linen_layers.py" in info.value.source


@pytest.mark.parametrize("shape, equation, grads", [
    ((5, 6, 7), "abc,cde->abde", True),
    ((5, 6), "...c,cd->...d", False),
    ((4, 5, 6), "...bc,bcd->...d", False),
    ((3, 5, 6), "abc,acd->bad", True),
    ((5, 2), "ab c , c d -> a d b", False),                             # spaces are ignored
])
def test_einsum_matches_linen(shape, equation, grads):
    x = _x((3, 4, 5))
    variables, _, _ = check_parity(nn.Einsum(shape, equation), flax_nn.Einsum(shape, equation), x)
    if grads:
        check_grads(nn.Einsum(shape, equation), flax_nn.Einsum(shape, equation), variables, x)


def test_einsum_equation_as_call_argument_and_without_bias_matches_linen():
    x = _x((3, 4, 5))
    check_parity(nn.Einsum((5, 6), use_bias=False), flax_nn.Einsum((5, 6), use_bias=False), x,
                 init_kwargs={"einsum_str": "abc,cd->abd"}, apply_kwargs={"einsum_str": "abc,cd->abd"})


@pytest.mark.parametrize("equation", ["abc,cd", "abc,cd,de->abe", "abc->ab"])
def test_einsum_rejects_an_equation_without_two_operands_and_an_output(equation):
    with pytest.raises(errors.ConfigError, match="exactly two operands") as info:
        nn.Einsum((5, 6), equation).init(jax.random.key(0), jnp.ones((3, 4, 5)))
    assert "test_linen_layers.py" in info.value.source and info.value.module == "Einsum"


def test_einsum_equation_given_twice_or_never_is_a_config_error():
    with pytest.raises(errors.ConfigError, match="both"):
        nn.Einsum((5, 6), "abc,cd->abd").init(jax.random.key(0), jnp.ones((3, 4, 5)), "abc,cd->abd")
    with pytest.raises(errors.ConfigError, match="neither"):
        nn.Einsum((5, 6)).init(jax.random.key(0), jnp.ones((3, 4, 5)))


@pytest.mark.parametrize("kwargs", [{}, {"negative_slope_init": 0.3}])
def test_prelu_matches_linen(kwargs):
    x = _x((2, 5))
    variables, _, _ = check_parity(nn.PReLU(**kwargs), flax_nn.PReLU(**kwargs), x)
    assert jax.tree.map(jnp.shape, variables) == {"params": {"negative_slope": ()}}
    # No randomness in PReLU's initializer: the init values agree too.
    assert_close(nn.PReLU(**kwargs).init(jax.random.key(0), x),
                 flax_nn.PReLU(**kwargs).init(jax.random.key(0), x), 0)
    check_grads(nn.PReLU(**kwargs), flax_nn.PReLU(**kwargs), variables, x)


def test_normalize_is_standardize():
    assert nn.normalize is jax.nn.standardize is flax_nn.normalize


@pytest.mark.parametrize("kwargs", [{}, {"feature_axes": (1, 2)},
                                    {"use_bias": False, "use_fast_variance": False}])
def test_instance_norm_matches_linen(kwargs):
    x = 1.0 + 2.0 * _x((2, 5, 4, 3))
    variables, _, _ = check_parity(nn.InstanceNorm(**kwargs), flax_nn.InstanceNorm(**kwargs), x)
    check_grads(nn.InstanceNorm(**kwargs), flax_nn.InstanceNorm(**kwargs), variables, x)


def test_instance_norm_rejects_the_batch_axis_as_a_feature_axis():
    with pytest.raises(errors.ConfigError, match="batch axis") as info:
        nn.InstanceNorm(feature_axes=0).init(jax.random.key(0), jnp.ones((2, 3)))
    assert "test_linen_layers.py" in info.value.source


def _wrapped(lib, wrapper, **kwargs):
    """A Dense, then ``wrapper(Dense(4))``, as in Linen's docstrings: the wrapped Dense is
    built in the parent's compact method, so it is the parent's ``Dense_1``."""
    class Model(lib.Module):
        @lib.compact
        def __call__(self, x, **call_kwargs):
            x = lib.Dense(3)(x)
            return getattr(lib, wrapper)(lib.Dense(4), **kwargs)(x, **call_kwargs)
    return Model()


@pytest.mark.parametrize("kwargs", [
    {},
    {"variable_filter": None, "feature_axes": None},
    {"use_scale": False, "epsilon": 1e-3},
    {"variable_filter": {"bias"}},
])
def test_weight_norm_matches_linen(kwargs):
    x = _x((2, 5))
    vj, fl = _wrapped(nn, "WeightNorm", **kwargs), _wrapped(flax_nn, "WeightNorm", **kwargs)
    variables, _, _ = check_parity(vj, fl, x)
    check_grads(vj, fl, variables, x, atol=1e-4)  # a 1-D bias normalizes to its sign: noise-level grads


def test_weight_norm_over_nested_modules_names_scales_by_path_as_linen_does():
    def model(lib):
        class Baz(lib.Module):
            @lib.compact
            def __call__(self, x):
                return lib.Dense(2)(x)

        class Bar(lib.Module):
            @lib.compact
            def __call__(self, x):
                return lib.Dense(3)(Baz()(lib.Dense(3)(Baz()(x))))

        class Foo(lib.Module):
            @lib.compact
            def __call__(self, x):
                return lib.WeightNorm(Bar(), variable_filter={"kernel", "Baz"})(lib.Dense(5)(x))
        return Foo()
    variables, _, _ = check_parity(model(nn), model(flax_nn), _x((1, 2)))
    assert sorted(variables["params"]["WeightNorm_0"]) == [
        "Bar_0/Baz_0/Dense_0/bias/scale", "Bar_0/Baz_0/Dense_0/kernel/scale",
        "Bar_0/Baz_1/Dense_0/bias/scale", "Bar_0/Baz_1/Dense_0/kernel/scale",
        "Bar_0/Dense_0/kernel/scale", "Bar_0/Dense_1/kernel/scale"]


def test_weight_norm_scale_is_named_after_the_wrapped_variable():
    variables = _wrapped(nn, "WeightNorm").init(jax.random.key(0), jnp.ones((2, 5)))
    assert jax.tree.map(jnp.shape, variables["params"]["WeightNorm_0"]) == {"Dense_1/kernel/scale": (4,)}


@pytest.mark.parametrize("kwargs", [{}, {"n_steps": 3}])
def test_spectral_norm_matches_linen_and_updates_its_stats(kwargs):
    x = _x((2, 5))
    vj, fl = _wrapped(nn, "SpectralNorm", **kwargs), _wrapped(flax_nn, "SpectralNorm", **kwargs)
    variables, (_, vj_stats), _ = check_parity(vj, fl, x, init_kwargs={"update_stats": True},
                                               apply_kwargs={"update_stats": True}, mutable=["batch_stats"])
    assert jax.tree.map(jnp.shape, vj_stats) == {
        "batch_stats": {"SpectralNorm_0": {"Dense_1/kernel/sigma": (), "Dense_1/kernel/u": (1, 4)}}}
    # Evaluation: nothing mutable, the stored u is used as is.
    check_parity(vj, fl, x, init_kwargs={"update_stats": True}, apply_kwargs={"update_stats": False})
    check_grads(vj, fl, variables, x, update_stats=False)


def test_spectral_norm_flattens_or_rejects_higher_rank_kernels():
    x = _x((1, 6, 2))
    class Model(nn.Module):
        strict: bool

        @nn.compact
        def __call__(self, x):
            return nn.SpectralNorm(nn.Conv(3, (2,)), error_on_non_matrix=self.strict)(x, update_stats=False)
    variables = Model(False).init(jax.random.key(0), x)
    assert variables["batch_stats"]["SpectralNorm_0"]["Conv_0/kernel/u"].shape == (1, 3)
    with pytest.raises(errors.ConfigError, match="error_on_non_matrix") as info:
        Model(True).init(jax.random.key(0), x)
    assert "Conv_0/kernel" in str(info.value)


def test_batch_apply_merges_leading_axes_like_linen():
    a, b = _x((2, 3, 4)), _x((4,), seed=1)

    def matvec(a, b):
        assert a.ndim == 2 and b.ndim == 1
        return {"y": a @ b, "pair": (a, a[:, :1])}
    assert_close(nn.BatchApply(matvec)(a, b), flax_nn.BatchApply(matvec)(a, b), 0)
    assert nn.BatchApply(matvec)(a, b=b)["y"].shape == (2, 3)


def test_batch_apply_over_a_module_inside_a_model_matches_linen():
    x = _x((4, 2, 3))

    def model(lib):
        class M(lib.Module):
            @lib.compact
            def __call__(self, x):
                return lib.BatchApply(lib.Dense(5))(x)
        return M()
    variables, _, _ = check_parity(model(nn), model(flax_nn), x)
    assert list(variables["params"]) == ["Dense_0"]


def test_batch_apply_needs_an_input_with_enough_axes():
    with pytest.raises(errors.ConfigError, match="3 or more axes") as info:
        nn.BatchApply(lambda x: x, num_dims=3)(jnp.ones((2, 2)))
    assert "test_linen_layers.py" in info.value.source


@pytest.mark.parametrize("name", ["Fp8DotGeneralOp", "Fp8DirectDotGeneralOp", "NANOOFp8DotGeneralOp",
                                  "Fp8Einsum", "Fp8DotGeneral"])
def test_fp8_ops_exist_and_say_why_they_are_not_provided(name):
    cls = getattr(nn, name)
    assert getattr(nn.fp8_ops, name) is cls
    with pytest.raises(NotProvidedError, match="_overwrite_with_gradient") as info:
        cls()
    assert isinstance(info.value, NotImplementedError) and "test_linen_layers.py" in info.value.source


def test_fp8_op_as_dot_general_cls_fails_where_the_layer_runs():
    with pytest.raises(NotProvidedError, match="Fp8DotGeneralOp"):
        nn.Dense(3, dot_general_cls=nn.Fp8DotGeneralOp).init(jax.random.key(0), jnp.ones((1, 2)))


@pytest.mark.parametrize("make, shape", [
    (lambda lib: lib.ConvLocal(4, (3,), dtype=jnp.bfloat16), (2, 8, 3)),
    (lambda lib: lib.Einsum((5, 6), "abc,cd->abd", dtype=jnp.bfloat16), (3, 4, 5)),
    (lambda lib: lib.InstanceNorm(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16), (2, 5, 3)),
    (lambda lib: lib.PReLU(param_dtype=jnp.bfloat16), (2, 5)),
    (lambda lib: lib.WeightNorm(lib.Dense(3), param_dtype=jnp.bfloat16), (2, 5)),
    (lambda lib: lib.SpectralNorm(lib.Dense(3, param_dtype=jnp.bfloat16)), (2, 5)),
])
def test_low_precision_layers_run_under_strict_promotion_and_match_linen(make, shape):
    kw = {"update_stats": False} if "SpectralNorm" in type(make(nn)).__name__ else {}
    x = _x(shape)
    variables = make(nn).init(jax.random.key(0), x, **kw)
    out = make(nn).apply(variables, x, **kw)                           # strict promotion (conftest)
    with jax.numpy_dtype_promotion("standard"):                        # Linen mixes dtypes implicitly
        expected = make(flax_nn).apply(variables, x, **kw)
    assert out.dtype == expected.dtype
    assert_close(out, expected, 2e-2)
