"""``nnx.PReLU``, ``identity``, ``Sequential``, ``LoRA``, ``LoRALinear``, ``EMA`` and the
``nnx.nn`` namespace: flax.nnx 0.12.8's parameters (paths, types, values bit for bit from
the same seed), outputs and errors, side by side."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx as flax_nnx

import varjax.nnx.nn as nnx_nn
from varjax import errors, nnx
from varjax.nnx.activation_layers import PReLU, identity
from varjax.nnx.combinators import Sequential
from varjax.nnx.ema import EMA
from varjax.nnx.lora import LoRA, LoRALinear

X = jax.random.normal(jax.random.key(1), (2, 3))


class _WithOurs(types.SimpleNamespace):
    """``varjax.nnx`` with this file's layers, until the package exports them."""

    def __getattr__(self, name):
        return getattr(nnx, name)


OURS = _WithOurs(PReLU=PReLU, identity=identity, Sequential=Sequential, LoRA=LoRA,
                 LoRALinear=LoRALinear, EMA=EMA)


def standard():
    """flax.nnx mixes dtypes implicitly, so the oracle runs under standard promotion;
    ours runs under the suite's strict promotion."""
    return jax.numpy_dtype_promotion("standard")


def same(a, b):
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def same_state(ours, theirs):
    """The same paths, Variable types and values as flax.nnx's ``nnx.state``."""
    got = nnx.to_flat_state(nnx.state(ours))
    want = flax_nnx.to_flat_state(flax_nnx.state(theirs))
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want):
        # a stream's key and count are views of the RngKey/RngCount type (rng_variables.py)
        assert type(b).__name__ in {c.__name__ for c in type(a).__mro__}, path
        a, b = a[...], b[...]
        if jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        same(a, b)


# -- PReLU and identity ------------------------------------------------------------------

@pytest.mark.parametrize("dtype, param_dtype, x_dtype", [
    (None, jnp.float32, jnp.float32),
    (None, jnp.float32, jnp.bfloat16),       # the slope is cast to the input's dtype
    (jnp.float16, jnp.float32, jnp.float32),  # both promoted to dtype
    (None, jnp.bfloat16, jnp.float32),
])
def test_prelu_slope_and_outputs_are_flax_nnx_s(dtype, param_dtype, x_dtype):
    ours = PReLU(0.2, dtype=dtype, param_dtype=param_dtype)
    theirs = flax_nnx.PReLU(0.2, dtype=dtype, param_dtype=param_dtype)
    same_state(ours, theirs)
    x = jnp.linspace(-2, 2, 6, dtype=x_dtype)
    with standard():
        want = theirs(x)
    same(ours(x), want)


def test_prelu_negative_slope_metadata_is_on_the_param_as_flax_nnx():
    ours = PReLU(negative_slope_metadata={"out_sharding": ()})
    with flax_nnx.use_eager_sharding(False):
        theirs = flax_nnx.PReLU(negative_slope_metadata={"out_sharding": ()})
    assert ours.negative_slope.out_sharding == theirs.negative_slope.out_sharding == ()
    assert type(ours.negative_slope) is nnx.Param


def test_identity_is_flax_nnx_s_and_every_activation_is_the_same_function():
    assert identity is flax_nnx.identity
    names = [n for n in flax_nnx.nn.activations.__all__ if n not in ("PReLU", "identity")]
    assert names and all(getattr(nnx, n) is getattr(flax_nnx, n) for n in names)


# -- Sequential ---------------------------------------------------------------------------

def _mlps():
    def make(lib, rngs):
        return lib.Sequential(lib.Linear(3, 4, rngs=rngs), lib.relu,
                              lib.Dropout(0.5, rngs=rngs), lib.Linear(4, 2, rngs=rngs))
    ours = make(OURS, nnx.Rngs(0))
    assert isinstance(ours, Sequential)
    return ours, make(flax_nnx, flax_nnx.Rngs(0))


def test_sequential_state_and_outputs_are_flax_nnx_s_with_call_rngs_for_dropout():
    ours, theirs = _mlps()
    same_state(ours, theirs)
    assert [type(f).__name__ for f in ours.layers] == [type(f).__name__ for f in theirs.layers]
    same(ours(X), theirs(X))                      # the layer's own stream
    same(ours(X, rngs=nnx.Rngs(dropout=3)), theirs(X, rngs=flax_nnx.Rngs(dropout=3)))
    same_state(ours, theirs)                      # counts advanced alike


def test_sequential_spreads_a_tuple_as_arguments_and_a_dict_as_keywords():
    def pair(x):
        return x, 2 * x

    def keywords(a, b):
        return {"u": a, "v": b}

    def last(*, u, v):
        return u - v

    for lib in (OURS, flax_nnx):
        assert lib.Sequential(pair, keywords, last)(3) == -3


def test_empty_sequential_returns_its_input_as_flax_nnx():
    for lib in (OURS, flax_nnx):
        model = lib.Sequential()
        assert model(12) == 12
        assert model(12, 23) == (12, 23)
        assert model() is None
        assert model(k=2) == {"k": 2}


def test_sequential_of_a_non_callable_is_a_type_error_naming_the_layer():
    with pytest.raises(TypeError):
        flax_nnx.Sequential(flax_nnx.relu, 3)(X)
    with pytest.raises(errors.InvalidVariablesError, match="layer 1 is not callable") as info:
        Sequential(nnx.relu, 3)(X)
    assert info.value.path == ("layers", "1")
    assert __file__ in info.value.source


# -- LoRA ---------------------------------------------------------------------------------

class CustomLinear:
    """A base module taking a keyword argument (flax's lora_test)."""

    def __init__(self, lib):
        class Custom(lib.Module):
            def __init__(self):
                self.kernel = lib.Param(jnp.zeros((3, 4)))

            def __call__(self, x, w=None):
                return x @ (self.kernel[...] if w is None else w)
        self.module = Custom()


def test_lora_params_and_outputs_are_flax_nnx_s():
    init = dict(b_initializer=nnx.initializers.normal())
    ours = LoRA(3, 2, 4, rngs=nnx.Rngs(0), **init)
    theirs = flax_nnx.LoRA(3, 2, 4, rngs=flax_nnx.Rngs(0), **init)
    same_state(ours, theirs)
    same(ours(X), theirs(X))
    assert type(ours.lora_a) is nnx.LoRAParam


def test_lora_adds_its_base_module_called_with_the_keyword_arguments():
    w = jnp.ones((3, 4))
    ours = LoRA(3, 2, 4, base_module=CustomLinear(nnx).module, rngs=nnx.Rngs(0),
                b_initializer=nnx.initializers.normal())
    theirs = flax_nnx.LoRA(3, 2, 4, base_module=CustomLinear(flax_nnx).module,
                           rngs=flax_nnx.Rngs(0), b_initializer=nnx.initializers.normal())
    same_state(ours, theirs)                      # base_module/kernel, lora_a, lora_b
    same(ours(X, w=w), theirs(X, w=w))
    same(ours(X), theirs(X))


def test_lora_around_a_linear_and_swapped_in_as_flax_nnx():
    def model(lib):
        rngs = lib.Rngs(0)
        linear = lib.Linear(3, 4, use_bias=False, rngs=rngs)
        return lib.LoRA(3, 2, 4, base_module=linear, rngs=rngs,
                        b_initializer=lib.initializers.ones)
    ours, theirs = model(OURS), model(flax_nnx)
    assert isinstance(ours, LoRA)
    same_state(ours, theirs)
    same(ours(X), theirs(X))


def test_lora_param_type_sets_the_adapters_type_and_collection():
    lora, params = nnx.split(LoRA(3, 4, 2, rngs=nnx.Rngs(0)), nnx.LoRAParam, nnx.Param)[1:]
    assert sorted(lora) == ["lora_a", "lora_b"] and len(params) == 0
    plain = LoRA(3, 4, 2, lora_param_type=nnx.Param, rngs=nnx.Rngs(0))
    params, lora = nnx.split(plain, nnx.Param, nnx.LoRAParam)[1:]
    assert sorted(params) == ["lora_a", "lora_b"] and len(lora) == 0
    assert sorted(nnx.state(LoRA(3, 4, 2, rngs=nnx.Rngs(0)), "LoRAParam")) == ["lora_a", "lora_b"]


@pytest.mark.parametrize("dtype, param_dtype", [(jnp.float16, jnp.float32),
                                                (None, jnp.bfloat16)])
def test_lora_dtypes_are_flax_nnx_s(dtype, param_dtype):
    ours = LoRA(3, 4, 2, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0),
                b_initializer=nnx.initializers.normal())
    theirs = flax_nnx.LoRA(3, 4, 2, dtype=dtype, param_dtype=param_dtype,
                           rngs=flax_nnx.Rngs(0), b_initializer=nnx.initializers.normal())
    same_state(ours, theirs)
    with standard():
        want = theirs(X)
    same(ours(X), want)


def test_lora_metadata_reaches_the_adapters():
    ours = LoRA(3, 2, 4, rngs=nnx.Rngs(0),
                a_initializer=nnx.with_partitioning(nnx.initializers.he_uniform(), ("x", None)),
                b_metadata={"out_sharding": (None, "y")})
    mesh = jax.make_mesh((1, 1), ("x", "y"))
    with jax.set_mesh(mesh):
        theirs = flax_nnx.LoRA(
            3, 2, 4, rngs=flax_nnx.Rngs(0),
            a_initializer=flax_nnx.with_partitioning(flax_nnx.initializers.he_uniform(),
                                                     ("x", None)),
            b_metadata={"out_sharding": (None, "y")})
    assert ours.lora_a.out_sharding == tuple(theirs.lora_a.out_sharding) == ("x", None)
    same(ours.lora_a[...], theirs.lora_a[...])
    assert ours.lora_b.out_sharding == tuple(theirs.lora_b.out_sharding) == (None, "y")


def test_lora_with_a_base_module_that_is_not_callable_is_a_value_error():
    class NoCall(flax_nnx.Module):
        pass

    class OurNoCall(nnx.Module):
        pass

    with pytest.raises(ValueError, match="callable"):
        flax_nnx.LoRA(3, 2, 4, base_module=NoCall(), rngs=flax_nnx.Rngs(0))(X)
    with pytest.raises(errors.ConfigError, match="base_module must be callable") as info:
        LoRA(3, 2, 4, base_module=OurNoCall(), rngs=nnx.Rngs(0))(X)
    assert info.value.path == ("base_module",) and __file__ in info.value.source


def test_lora_linear_is_a_linear_plus_lora_as_flax_nnx():
    ours = LoRALinear(3, 4, lora_rank=2, rngs=nnx.Rngs(0),
                      b_initializer=nnx.initializers.normal())
    theirs = flax_nnx.LoRALinear(3, 4, lora_rank=2, rngs=flax_nnx.Rngs(0),
                                 b_initializer=nnx.initializers.normal())
    assert isinstance(ours, nnx.Linear)
    same_state(ours, theirs)                      # bias, kernel, lora/lora_a, lora/lora_b
    same(ours(X), theirs(X))


def test_lora_linear_options_go_to_linear_and_lora():
    # the adapters' shapes and dtype are test_lora_dtypes_are_flax_nnx_s's: no new compiles
    kwargs = dict(lora_rank=4, use_bias=False, dtype=jnp.bfloat16, lora_dtype=jnp.float16,
                  lora_param_dtype=jnp.bfloat16, b_initializer=nnx.initializers.normal())
    ours = LoRALinear(3, 2, rngs=nnx.Rngs(0), **kwargs)
    with standard():
        theirs = flax_nnx.LoRALinear(3, 2, rngs=flax_nnx.Rngs(0), **kwargs)
        want = theirs(X)
    same_state(ours, theirs)
    assert ours.bias is None and ours.lora.dtype == jnp.float16
    same(ours(X), want)                           # bfloat16 + float16 -> float32


def test_lora_linear_swapped_in_keeps_the_linear_state_as_flax_nnx():
    def swapped(lib):
        rngs = lib.Rngs(0)
        model = lib.Sequential(lib.Linear(3, 3, rngs=rngs), lib.Linear(3, 3, rngs=rngs))
        before = model(X)
        state = lib.state(model.layers[1])
        model.layers[1] = lib.LoRALinear(3, 3, lora_rank=4, rngs=rngs)
        lib.update(model.layers[1], state)
        return before, model
    before, ours = swapped(OURS)
    _, theirs = swapped(flax_nnx)
    same(ours(X), before)                         # lora_b starts at zero
    same_state(ours, theirs)


# -- the layers under transforms ----------------------------------------------------------

def _stack(lib):
    rngs = lib.Rngs(0, dropout=1)
    return lib.Sequential(
        lib.LoRALinear(3, 4, lora_rank=2, b_initializer=lib.initializers.normal(), rngs=rngs),
        lib.PReLU(), lib.Dropout(0.5, rngs=rngs), lib.Linear(4, 2, rngs=rngs))


def test_the_layers_under_jit_grad_and_vmap_are_flax_nnx_s():
    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    def step(lib):
        @lib.jit
        def train(model, x):
            grads = lib.grad(loss)(model, x)
            lib.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, lib.state(model, lib.Param),
                                           grads))
        return train

    ours, theirs = _stack(OURS), _stack(flax_nnx)
    for _ in range(2):
        step(OURS)(ours, X)
        step(flax_nnx)(theirs, X)
    assert ours.layers[0].lora.lora_a is not None
    same_state(ours, theirs)                      # params moved, dropout counts advanced
    ours.eval()
    theirs.eval()
    xs = X.reshape(2, 1, 3)
    mapped = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(ours, xs)
    want = flax_nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(theirs, xs)
    np.testing.assert_allclose(mapped, want, rtol=1e-6)


# -- EMA ----------------------------------------------------------------------------------

def _double(model, lib):
    jax.tree.map(lambda v: v.set_value(2.0 * v[...]), model,
                 is_leaf=lambda x: isinstance(x, lib.Variable))


def test_ema_starts_as_a_copy_and_blends_updates_as_flax_nnx():
    emas, models = [], []
    for lib in (OURS, flax_nnx):
        model = lib.Linear(2, 2, use_bias=False, rngs=lib.Rngs(0))
        ema = lib.EMA(model, decay=0.9)
        assert ema.params["kernel"] is not model.kernel
        same(ema.params["kernel"][...], model.kernel[...])
        _double(model, lib)
        ema.update(model)
        emas.append(ema)
        models.append(model)
    same_state(*emas)                             # params/kernel, bitwise
    expected = 0.9 * (models[0].kernel[...] / 2) + 0.1 * models[0].kernel[...]
    np.testing.assert_allclose(emas[0].params["kernel"][...], expected, rtol=1e-6)


def test_ema_in_a_jitted_train_step_and_its_model_view_are_flax_nnx_s():
    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    results = []
    for lib in (OURS, flax_nnx):
        model = lib.Linear(2, 2, rngs=lib.Rngs(0))
        optimizer = lib.Optimizer(model, optax.sgd(0.1), wrt=lib.Param)
        ema = lib.EMA(model, decay=0.9)
        view = ema.apply_to(model)

        @lib.jit
        def train(model, optimizer, ema, x, y):
            optimizer.update(model, lib.grad(loss)(model, x, y))
            ema.update(model)

        for _ in range(2):
            train(model, optimizer, ema, X[:, :2], X[:, 1:])
        assert view.kernel is ema.params["kernel"] and view.kernel is not model.kernel
        assert type(view.kernel) is lib.Param
        results.append((ema, view))
    same_state(results[0][0], results[1][0])
    same_state(results[0][1], results[1][1])


def test_ema_only_tracks_the_filtered_variables_and_apply_to_keeps_the_rest():
    emas = [lib.EMA(lib.BatchNorm(2, rngs=lib.Rngs(0)), decay=0.5, only=lib.Param)
            for lib in (OURS, flax_nnx)]
    same_state(*emas)                             # params/bias, params/scale only
    model = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
    ema = EMA(model, decay=0.5, only=nnx.Param)
    view = ema.apply_to(model)
    assert view.scale is ema.params["scale"] and view.mean is model.mean


class WithArray:
    def __init__(self, lib):
        class Holder(lib.Module):
            def __init__(self):
                self.w = lib.Param(jnp.ones(2))
                self.raw = jnp.zeros(2)
        self.module = Holder()


def test_ema_of_a_state_with_a_plain_array_is_a_type_error_naming_its_path():
    with pytest.raises(TypeError, match="raw"):
        flax_nnx.EMA(WithArray(flax_nnx).module, decay=0.9)
    with pytest.raises(errors.InvalidVariablesError, match="Variables only") as info:
        EMA(WithArray(nnx).module, decay=0.9)
    assert info.value.path == ("raw",) and __file__ in info.value.source
    assert sorted(EMA(WithArray(nnx).module, decay=0.9, only=nnx.Param).params) == ["w"]


def test_ema_update_from_another_structure_is_a_value_error_naming_the_variable():
    with pytest.raises(ValueError):
        ema = flax_nnx.EMA(flax_nnx.Linear(2, 2, rngs=flax_nnx.Rngs(0)), decay=0.9)
        ema.update(flax_nnx.Linear(2, 2, use_bias=False, rngs=flax_nnx.Rngs(0)))
    ema = EMA(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), decay=0.9)
    with pytest.raises(errors.ConfigError, match="'bias' is in only one") as info:
        ema.update(nnx.Linear(2, 2, use_bias=False, rngs=nnx.Rngs(0)))
    assert info.value.path == ("bias",) and __file__ in info.value.source


# -- the nnx.nn namespace -----------------------------------------------------------------

SUBMODULES = ["activations", "attention", "dtypes", "initializers", "linear", "lora",
              "normalization", "recurrent", "stochastic"]


def test_nnx_nn_has_flax_nnx_nn_s_submodules():
    assert sorted(n for n in dir(flax_nnx.nn) if not n.startswith("_")) == SUBMODULES
    assert sorted(nnx_nn.__all__) == SUBMODULES
    assert nnx.nn is nnx_nn and nnx_nn.initializers is nnx.initializers


@pytest.mark.parametrize("name", [n for n in SUBMODULES if n not in ("dtypes", "initializers")])
def test_each_nnx_nn_submodule_lists_the_flax_nnx_names_of_its_flax_namesake(name):
    theirs = getattr(flax_nnx.nn, name)
    # flax.nnx's own names there: its __all__, else the functions and classes it defines
    # that flax.nnx exports (not its TypeVars, nor what it imports)
    exported = set(getattr(theirs, "__all__", None) or (
        n for n in dir(flax_nnx) if callable(obj := getattr(theirs, n, None))
        and obj.__module__ == theirs.__name__))
    assert set(getattr(nnx_nn, name).__all__) == exported


def test_nnx_nn_names_are_varjax_nnx_s_own_objects():
    from varjax.nnx.nn.linear import Linear
    assert Linear is nnx.Linear and nnx_nn.linear.Conv is nnx.Conv
    assert nnx_nn.normalization.BatchNorm is nnx.BatchNorm
    assert nnx_nn.stochastic.Dropout is nnx.Dropout and nnx_nn.activations.relu is nnx.relu
    assert nnx_nn.lora.LoRAParam is nnx.LoRAParam
    assert "Linear" in dir(nnx_nn.linear)
    with pytest.raises(AttributeError):
        nnx_nn.linear.Dense


def test_nnx_nn_dtypes_promote_as_flax_nnx_nn_dtypes():
    args = (jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.float16), None)
    for kwargs in ({}, {"dtype": jnp.float16}):
        ours = nnx_nn.dtypes.promote_dtype(args, **kwargs)
        with standard():
            theirs = flax_nnx.nn.dtypes.promote_dtype(args, **kwargs)
        assert isinstance(ours, tuple) and ours[2] is None
        assert [a.dtype for a in ours[:2]] == [a.dtype for a in theirs[:2]]
    with standard():
        want = flax_nnx.nn.dtypes.canonicalize_dtype(*args)
    assert nnx_nn.dtypes.canonicalize_dtype(*args) == want == jnp.float32
    assert nnx_nn.dtypes.canonicalize_dtype(jnp.ones(1, jnp.int32)) == jnp.float32
