"""Lifted call transforms: ``nn.jit``, ``nn.remat``/``nn.checkpoint``, ``nn.named_call`` and
``nn.map_variables``, checked against flax.linen on the same variables (layouts, hence
auto names; outputs; gradients) and against their IR.

Model source is written once in functions taking the ``nn`` namespace, so the identical
code runs on flax.linen and on varjax.nn.
"""
from __future__ import annotations

import functools

import flax.linen as flax_nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from transform_checks import close as _close
from transform_checks import data as _data
from transform_checks import layout as _layout
from transform_checks import plain as _plain

import varjax as vj
import varjax.nn as vj_nn
from varjax import errors


def _perturb(variables, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + 0.3 * rng.standard_normal(
        np.shape(x)), jnp.result_type(x)), _plain(variables))


def _eqn_names(closed):
    """Names (``name`` param) and primitive names of every equation, at any depth."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            found.append(eqn.primitive.name)
            if "name" in eqn.params:
                found.append(str(eqn.params["name"]))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)
    walk(closed.jaxpr)
    return found


@functools.cache
def _program(nn):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(jnp.tanh(nn.Dense(4)(x)))

    class Stack(nn.Module):
        """``n`` Dense layers (``n`` must be concrete), negated unless ``train``."""

        @nn.compact
        def __call__(self, x, n, train):
            for _ in range(int(n)):
                x = jnp.tanh(nn.Dense(3)(x))
            return x if train else -x

    class JitParent(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.jit(MLP)()(x)

    class JitMethod(nn.Module):
        @nn.jit
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.relu(nn.Dense(4)(x)))

    class JitStatic(nn.Module):
        @nn.compact
        def __call__(self, x):
            # Linen's positions count the module: 2 and 3 are n and train
            stack = nn.jit(Stack, static_argnums=(2, 3))()
            return stack(x, np.int32(2), True), stack(x, np.int32(2), False)

    class JitTwice(nn.Module):
        @nn.compact
        def __call__(self, x):
            mlp = nn.jit(MLP)()
            return mlp(x), mlp(2.0 * x)

    class RematParent(nn.Module):
        @nn.compact
        def __call__(self, x):
            a = nn.remat(MLP, policy=jax.checkpoint_policies.nothing_saveable)()(x)
            return nn.checkpoint(MLP)()(a)

    class PlainParent(nn.Module):       # RematParent without remat, same layout
        @nn.compact
        def __call__(self, x):
            return MLP(name="CheckpointMLP_1")(MLP(name="CheckpointMLP_0")(x))

    class RematStatic(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.remat(Stack, static_argnums=(2, 3))()
            return stack(x, np.int32(2), True), stack(x, np.int32(2), False)

    class NamedMethod(nn.Module):
        @nn.named_call
        @nn.compact
        def __call__(self, x):
            return MLP()(x)

    class CausalDense(nn.Module):       # nn.map_variables docstring
        """A dense layer that masks the weights such that the output is causal, i.e.
        output i only depends on input <= i."""
        features: int

        def apply_mask(self, variables):
            return (jax.tree_util.tree_map(jnp.triu, variables)
                    if not self.is_initializing() else variables)

        def setup(self):
            # temporary class
            _CausalDense = nn.map_variables(
                nn.Dense, "params", self.apply_mask, init=self.is_initializing())
            self.dense = _CausalDense(features=self.features, use_bias=False)

        def __call__(self, x):
            return self.dense(x)

    class DoubledDense(nn.Module):      # init=True: created, then mapped
        @nn.compact
        def __call__(self, x):
            def double(v):
                return jax.tree_util.tree_map(lambda p: 2.0 * p, v)
            dense = nn.map_variables(nn.Dense, "params", double, init=True)(
                3, kernel_init=nn.initializers.ones_init(), bias_init=nn.initializers.ones_init())
            return dense(x)

    def trans(variables):
        return jax.tree_util.tree_map(lambda x: x.T, variables)

    def tied_autoencoder(method_name, closure):
        """flax's linen_transforms_test ``TiedAutencoder``, its compact method named
        ``method_name`` (flax: ``_call``), its body closing over ``x`` (flax) or taking
        it as an argument."""

        @nn.compact
        def code(self, x, decode):
            def f(self, x):
                return nn.Dense(self.features if decode else self.latents, use_bias=False)(x)

            if decode:
                map_fn = trans
            else:
                def map_fn(x):
                    return x
            if closure:
                return nn.map_variables(lambda mdl: f(mdl, x), "params", map_fn, map_fn,
                                        mutable=True)(self)
            return nn.map_variables(f, "params", map_fn, map_fn, mutable=True)(self, x)

        def encode(self, x):
            return getattr(self, method_name)(x, False)

        def decode(self, x):
            return getattr(self, method_name)(x, True)

        def __call__(self, x):
            z = self.encode(x)
            return z, self.decode(z)

        return type("TiedAutoencoder", (nn.Module,), {
            "__annotations__": {"features": int, "latents": int}, method_name: code,
            "encode": encode, "decode": decode, "__call__": __call__})

    class Counter(nn.Module):
        @nn.compact
        def __call__(self, x):
            count = self.variable("counts", "n", lambda: jnp.zeros((), jnp.float32))
            count.value = count.value + 1.0
            return x * count.value

    class CounterParent(nn.Module):
        mutable_mapped: bool

        @nn.compact
        def __call__(self, x):
            return nn.map_variables(Counter, "counts", mutable=self.mutable_mapped,
                                    init=self.is_initializing())()(x)

    return dict(MLP=MLP, JitParent=JitParent, JitMethod=JitMethod, JitStatic=JitStatic,
                JitTwice=JitTwice, RematParent=RematParent, PlainParent=PlainParent,
                RematStatic=RematStatic, NamedMethod=NamedMethod, CausalDense=CausalDense,
                DoubledDense=DoubledDense, TiedAutoencoder=tied_autoencoder("code", False),
                TiedAutoencoderClosure=tied_autoencoder("code", True),
                TiedAutoencoderPrivate=tied_autoencoder("_call", False), CounterParent=CounterParent)


def _both(name, *args, **kwargs):
    return _program(flax_nn)[name](*args, **kwargs), _program(vj_nn)[name](*args, **kwargs)


def _init_both(name, *inputs, fields=(), method=None):
    """Both models, initialized with the same key; asserts equal layouts and returns
    ``(flax_model, vj_model, perturbed flax variables)``."""
    fx, vx = _both(name, *fields)
    kw = {} if method is None else {"method": method}
    f_vars = _plain(fx.init(jax.random.key(0), *inputs, **kw))
    v_vars = vx.init(jax.random.key(0), *inputs, **kw)
    assert _layout(v_vars) == _layout(f_vars)
    return fx, vx, _perturb(f_vars)


# ---------------------------------------------------------------------------------------
# jit


def test_jit_module_class_is_named_like_linen_and_computes_the_same():
    x = _data((2, 3))
    fx, vx, variables = _init_both("JitParent", x)
    assert list(variables["params"]) == ["JitMLP_0"]
    _close(vx.apply(variables, x), fx.apply(variables, x))


def test_jit_as_method_decorator_keeps_the_modules_own_layout():
    x = _data((2, 3))
    fx, vx, variables = _init_both("JitMethod", x)
    assert set(variables["params"]) == {"Dense_0", "Dense_1"}
    _close(vx.apply(variables, x), fx.apply(variables, x))


def test_jit_static_argnums_count_the_module_and_python_bool_gives_distinct_results():
    x = _data((2, 3))
    fx, vx, variables = _init_both("JitStatic", x)
    assert set(variables["params"]["JitStack_0"]) == {"Dense_0", "Dense_1"}
    got = vx.apply(variables, x)
    _close(got, fx.apply(variables, x))
    train, evaluate = got
    np.testing.assert_allclose(evaluate, -train, rtol=1e-6)
    assert not np.allclose(train, evaluate)


def test_jit_module_called_twice_shares_its_params():
    x = _data((2, 3))
    fx, vx, variables = _init_both("JitTwice", x)
    assert list(variables["params"]) == ["JitMLP_0"]
    got = vx.apply(variables, x)
    _close(got, fx.apply(variables, x))
    mlp = _program(vj_nn)["MLP"]()
    _close(got, (mlp.apply({"params": variables["params"]["JitMLP_0"]}, x),
                 mlp.apply({"params": variables["params"]["JitMLP_0"]}, 2.0 * x)))
    names = _eqn_names(vx.functionalize().jaxpr(x, variables=variables))
    assert names.count("jit(__call__)") == 2, names


def test_jit_of_a_plain_function_counts_its_own_parameters_and_rejects_traced_statics():
    def body(x, n):
        w = vj.param("w", jax.nn.initializers.normal(1.0), (3,))
        for _ in range(int(n)):              # needs a concrete n
            x = jnp.sin(w * x)
        return x

    f = vj.functionalize(lambda x: vj.jit(body, static_argnums=1)(x, np.int32(2)))
    x = _data((3,))
    variables = f.init(jax.random.key(0), x)
    w = variables["params"]["w"]
    np.testing.assert_allclose(f.apply(variables, x), jnp.sin(w * jnp.sin(w * x)), rtol=1e-6)
    bad = vj.functionalize(lambda x: vj.jit(body, static_argnums=(0, 1))(x, np.int32(2)))
    with pytest.raises(errors.TransformError, match="argument 0 is marked static"):
        bad.init(jax.random.key(0), x)


# ---------------------------------------------------------------------------------------
# remat / checkpoint


def test_remat_is_named_like_linen_and_its_gradients_equal_the_plain_modules():
    x = _data((2, 3))
    fx, vx, variables = _init_both("RematParent", x)
    assert list(variables["params"]) == ["CheckpointMLP_0", "CheckpointMLP_1"]
    _, plain = _both("PlainParent")

    def loss(model):
        return lambda v, x: (model.apply(v, x) ** 2).sum()
    grads = jax.grad(loss(vx), argnums=(0, 1))(variables, x)
    _close(grads, jax.grad(loss(fx), argnums=(0, 1))(variables, x))
    _close(grads, jax.grad(loss(plain), argnums=(0, 1))(variables, x))
    _close(vx.apply(variables, x), plain.apply(variables, x))


def test_remat_body_is_a_checkpoint_equation_with_the_policy():
    x = _data((2, 3))
    model = _program(vj_nn)["RematParent"]()
    variables = model.init(jax.random.key(0), x)
    closed = model.functionalize().jaxpr(x, variables=variables)
    names = _eqn_names(closed)
    assert names.count("remat(__call__)") == 2, names

    def policies(jaxpr):
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "remat2":          # jax.checkpoint's primitive
                found.append(eqn.params["policy"])
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                found += policies(sub)
        return found
    want = [jax.checkpoint_policies.nothing_saveable, None]
    assert policies(closed.jaxpr) == want
    # the apply, as JAX sees it after the passes, still checkpoints
    assert policies(jax.make_jaxpr(model.apply)(variables, x).jaxpr) == want


def test_remat_static_argnums_count_the_module_as_linen():
    x = _data((2, 3))
    fx, vx, variables = _init_both("RematStatic", x)
    assert set(variables["params"]["CheckpointStack_0"]) == {"Dense_0", "Dense_1"}

    def loss(model):
        return lambda v: sum((y ** 2).sum() for y in model.apply(v, x))
    _close(vx.apply(variables, x), fx.apply(variables, x))
    _close(jax.grad(loss(vx))(variables), jax.grad(loss(fx))(variables))


# ---------------------------------------------------------------------------------------
# named_call


def test_named_call_is_a_jit_equation_with_the_given_name():
    x = _data((2, 3))
    mlp = _program(vj_nn)["MLP"]

    class Parent(vj_nn.Module):
        @vj_nn.compact
        def __call__(self, x):
            return vj_nn.named_call(mlp, name="my_block")()(x)

    model = Parent()
    variables = model.init(jax.random.key(0), x)
    assert list(variables["params"]) == ["Named_callMLP_0"]
    names = _eqn_names(model.functionalize().jaxpr(x, variables=variables))
    assert "my_block" in names, names
    assert "my_block" in _eqn_names(jax.make_jaxpr(model.apply)(variables, x))
    _close(model.apply(variables, x),
           mlp().apply({"params": variables["params"]["Named_callMLP_0"]}, x))


def test_named_call_method_decorator_matches_linen():
    x = _data((2, 3))
    fx, vx, variables = _init_both("NamedMethod", x)
    _close(vx.apply(variables, x), fx.apply(variables, x))
    # named as Linen names its profiling scope: the module's name (else its class name)
    assert "NamedMethod" in _eqn_names(vx.functionalize().jaxpr(x, variables=variables))


# ---------------------------------------------------------------------------------------
# map_variables


def test_map_variables_docstring_causal_dense_masks_the_kernel_as_linen():
    x = _data((2, 5))
    fx, vx, variables = _init_both("CausalDense", x, fields=(5,))
    assert _layout(variables) == {"['params']['dense']['kernel']": ((5, 5), jnp.float32)}
    got = vx.apply(variables, x)
    _close(got, fx.apply(variables, x))
    kernel = variables["params"]["dense"]["kernel"]
    np.testing.assert_allclose(got, x @ jnp.triu(kernel), rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, x @ kernel)
    # output i depends only on inputs <= i
    jac = jax.jacfwd(lambda x: vx.apply(variables, x))(x[0])
    np.testing.assert_array_equal(jac, jnp.triu(kernel).T)


def test_map_variables_init_creates_the_variables_then_maps_them():
    x = _data((2, 3))
    fx, vx = _both("DoubledDense")
    f_out, f_vars = fx.init_with_output(jax.random.key(0), x)
    v_out, v_vars = vx.init_with_output(jax.random.key(0), x)
    _close(v_vars, f_vars)                        # deterministic initializers
    _close(v_out, f_out)
    # created as ones, seen doubled by the body, stored as seen (trans_out_fn is the identity)
    dense = v_vars["params"]["Map_variablesDense_0"]
    np.testing.assert_array_equal(dense["kernel"], 2.0 * np.ones((3, 3)))
    np.testing.assert_array_equal(dense["bias"], 2.0 * np.ones((3,)))
    np.testing.assert_allclose(v_out, x @ dense["kernel"] + dense["bias"][None], rtol=1e-5)
    variables = _perturb(f_vars)
    got = vx.apply(variables, x)
    _close(got, fx.apply(variables, x))
    dense = variables["params"]["Map_variablesDense_0"]
    np.testing.assert_allclose(got, x @ (2.0 * dense["kernel"]) + 2.0 * dense["bias"][None],
                               rtol=1e-5, atol=1e-6)


def test_map_variables_write_to_mapped_collection_needs_mutable():
    x = _data((3,))
    fx, vx = _both("CounterParent", True)
    variables = vx.init(jax.random.key(0), x)
    f_vars = _plain(fx.init(jax.random.key(0), x))
    _close(variables, f_vars)              # init=True ran the body twice in both libraries
    out, updated = vx.apply(variables, x, mutable=["counts"])
    _close((out, updated), fx.apply(variables, x, mutable=["counts"]))
    assert float(updated["counts"]["Map_variablesCounter_0"]["n"]) == 3.0
    _, immutable = _both("CounterParent", False)
    with pytest.raises(errors.TransformError, match="mutable") as info:
        immutable.apply(variables, x, mutable=["counts"])
    assert "'n'" in str(info.value) or "/n" in str(info.value) or " n " in str(info.value)


def test_map_variables_tied_autoencoder_has_one_kernel_used_by_both_directions():
    x = _data((2, 4))
    fx, vx, variables = _init_both("TiedAutoencoder", x, fields=(4, 5))
    assert _layout(variables) == {"['params']['Dense_0']['kernel']": ((4, 5), jnp.float32)}
    got = vx.apply(variables, x)
    _close(got, fx.apply(variables, x))
    kernel = variables["params"]["Dense_0"]["kernel"]
    z, recon = got
    np.testing.assert_allclose(z, x @ kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(recon, x @ kernel @ kernel.T, rtol=1e-5, atol=1e-5)

    # the kernel's gradient collects both uses
    def loss(v):
        return vx.apply(v, x)[1].sum()
    grad = jax.grad(loss)(variables)["params"]["Dense_0"]["kernel"]
    want = jax.grad(lambda k: (x @ k @ k.T).sum())(kernel)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


def test_map_variables_tied_autoencoder_with_a_private_compact_method_as_in_flax():
    x = _data((2, 4))
    _init_both("TiedAutoencoderPrivate", x, fields=(4, 5))


def test_map_variables_tied_autoencoder_body_closing_over_the_input_as_in_flax():
    x = _data((2, 4))
    fx, vx, variables = _init_both("TiedAutoencoderClosure", x, fields=(4, 5))
    assert _layout(variables) == {"['params']['Dense_0']['kernel']": ((4, 5), jnp.float32)}
    got = vx.apply(variables, x)
    _close(got, fx.apply(variables, x))
    kernel = variables["params"]["Dense_0"]["kernel"]
    np.testing.assert_allclose(got[1], x @ kernel @ kernel.T, rtol=1e-5, atol=1e-5)
