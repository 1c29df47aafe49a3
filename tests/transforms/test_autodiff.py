"""Lifted autodiff: ``nn.vjp``, ``nn.jvp``, ``nn.grad``, ``nn.value_and_grad``,
``nn.custom_vjp`` (ported from flax.linen's docstrings and checked against flax.linen on
the same variables) and varjax's own ``vj.custom_jvp``.

Model source is written once in functions taking the ``nn`` namespace, so the identical
code runs on flax.linen and on varjax.nn.
"""
from __future__ import annotations

import functools

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as vj_nn

ATOL = 1e-5


def _data(shape, seed=0):
    # NumPy draws: no XLA compile per input shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _layout(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): (np.shape(x), jnp.result_type(x)) for p, x in flat}


def _close(a, b, atol=ATOL):
    a, b = jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b)
    assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a),
                                                            jax.tree.structure(b))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, atol=atol, rtol=atol)


def _plain(tree):
    """Nested dicts all the way down (Linen may return FrozenDicts)."""
    if hasattr(tree, "items"):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_plain(v) for v in tree)
    return tree


@functools.cache
def _program(nn):
    """The docstring examples of flax.linen's autodiff transforms, for one ``nn``."""

    class LearnScale(nn.Module):
        @nn.compact
        def __call__(self, x, y):
            p = self.param("scale", nn.initializers.zeros_init(), ())
            return p * x * y

    class VjpFoo(nn.Module):              # nn.vjp docstring
        @nn.compact
        def __call__(self, x, y):
            z, bwd = nn.vjp(lambda mdl, x, y: mdl(x, y), LearnScale(), x, y)
            params_grad, x_grad, y_grad = bwd(jnp.ones(z.shape))
            return z, params_grad, x_grad, y_grad

    class ValueAndGradFoo(nn.Module):     # nn.value_and_grad docstring (scalar output)
        @nn.compact
        def __call__(self, x, y):
            z, (x_grad, y_grad) = nn.value_and_grad(
                lambda mdl, x, y: mdl(x, y).sum(), LearnScale(), x, y)
            return z, x_grad, y_grad

    class ValueAndGradAuxFoo(nn.Module):
        @nn.compact
        def __call__(self, x, y):
            def f(mdl, x, y):
                z = mdl(x, y)
                return (z ** 2).sum(), {"z": z}
            (value, aux), (x_grad, y_grad) = nn.value_and_grad(f, LearnScale(), x, y, has_aux=True)
            return value, aux, x_grad, y_grad

    class GradFoo(nn.Module):             # nn.grad docstring (scalar output)
        @nn.compact
        def __call__(self, x, y):
            x_grad, y_grad = nn.grad(lambda mdl, x, y: mdl(x, y).sum(), LearnScale(), x, y)
            return x_grad, y_grad

    class GradAuxFoo(nn.Module):
        @nn.compact
        def __call__(self, x, y):
            def f(mdl, x, y):
                z = mdl(x, y)
                return jnp.sin(z).sum(), z * 2.0
            (x_grad, y_grad), aux = nn.grad(f, LearnScale(), x, y, has_aux=True)
            return x_grad, y_grad, aux

    class Scale(nn.Module):
        @nn.compact
        def __call__(self, x):
            p = self.param("test", nn.initializers.zeros_init(), ())
            return p * x

    class JvpFoo(nn.Module):              # nn.jvp docstring, with a primal tangent as well
        @nn.compact
        def __call__(self, x, x_t):
            scale = Scale()
            if self.is_initializing():
                return scale(x)
            vars_t = jax.tree_util.tree_map(jnp.ones_like, scale.variables.get("params", {}))
            out, out_t = nn.jvp(lambda mdl, x: mdl(x), scale, (x,), (x_t,),
                                variable_tangents={"params": vars_t})
            return out, out_t

    class SignGradFoo(nn.Module):         # nn.custom_vjp docstring, scaled output
        @nn.compact
        def __call__(self, x):
            def f(mdl, x):
                return mdl(x)

            def fwd(mdl, x):
                return nn.vjp(f, mdl, x)

            def bwd(vjp_fn, y_t):
                params_t, *inputs_t = vjp_fn(y_t)
                params_t = jax.tree_util.tree_map(jnp.sign, params_t)
                return (params_t, *inputs_t)

            sign_grad = nn.custom_vjp(f, forward_fn=fwd, backward_fn=bwd)
            return 3.0 * sign_grad(nn.Dense(1), x).reshape(())

    class LateBackward(nn.Module):        # vjp_fn kept and called after more module code
        @nn.compact
        def __call__(self, x):
            y, bwd = nn.vjp(lambda mdl, x: mdl(x), nn.Dense(3), x)
            ct = nn.Dense(3, name="head")(jnp.tanh(y))
            first = bwd(ct)
            second = bwd(2.0 * ct)
            return y, ct, first, second

    class BatchNormInVjp(nn.Module):      # a write inside the differentiated function
        @nn.compact
        def __call__(self, x):
            y, bwd = nn.vjp(lambda mdl, x: mdl(x), nn.BatchNorm(use_running_average=False), x)
            params_grad, x_grad = bwd(jnp.ones_like(y))
            return y, params_grad, x_grad

    return dict(VjpFoo=VjpFoo, ValueAndGradFoo=ValueAndGradFoo,
                ValueAndGradAuxFoo=ValueAndGradAuxFoo, GradFoo=GradFoo, GradAuxFoo=GradAuxFoo,
                JvpFoo=JvpFoo, SignGradFoo=SignGradFoo, LateBackward=LateBackward,
                BatchNormInVjp=BatchNormInVjp)


def _both(name, **kwargs):
    return _program(flax_nn)[name](**kwargs), _program(vj_nn)[name](**kwargs)


def _init_both(name, *args, mutable=None):
    """Both models, initialized with the same key; asserts the layouts agree and returns
    ``(flax_model, vj_model, flax_variables)``."""
    fx, vx = _both(name)
    kw = {} if mutable is None else {"mutable": mutable}
    f_vars = _plain(fx.init(jax.random.key(0), *args, **kw))
    v_vars = vx.init(jax.random.key(0), *args, **kw)
    assert _layout(v_vars) == _layout(f_vars)
    return fx, vx, f_vars


SCALE = {"params": {"LearnScale_0": {"scale": jnp.float32(0.7)}}}


# ---------------------------------------------------------------------------------------
# vjp / grad / value_and_grad / jvp: the Linen docstring examples


def test_vjp_docstring_example_gives_params_and_input_grads_as_linen():
    x, y = _data((2, 3)), _data((2, 3), 1)
    fx, vx, _ = _init_both("VjpFoo", x, y)
    want = fx.apply(SCALE, x, y)
    got = vx.apply(SCALE, x, y)
    _close(_plain(got), _plain(want))
    z, params_grad, x_grad, y_grad = got
    # params grads are nested {'params': {...}} relative to the differentiated module
    assert _plain(params_grad) == {"params": {"scale": params_grad["params"]["scale"]}}
    np.testing.assert_allclose(params_grad["params"]["scale"], (x * y).sum(), rtol=1e-5)
    np.testing.assert_allclose(z, 0.7 * x * y, rtol=1e-6)
    np.testing.assert_allclose(x_grad, 0.7 * y, rtol=1e-6)
    np.testing.assert_allclose(y_grad, 0.7 * x, rtol=1e-6)


def test_value_and_grad_docstring_example_differentiates_primals_only():
    x, y = _data((2, 3)), _data((2, 3), 1)
    fx, vx, _ = _init_both("ValueAndGradFoo", x, y)
    got = vx.apply(SCALE, x, y)
    _close(got, fx.apply(SCALE, x, y))
    z, x_grad, y_grad = got
    np.testing.assert_allclose(z, (0.7 * x * y).sum(), rtol=1e-5)
    np.testing.assert_allclose(x_grad, 0.7 * y, rtol=1e-6)
    np.testing.assert_allclose(y_grad, 0.7 * x, rtol=1e-6)


def test_value_and_grad_with_aux_returns_value_aux_pair_and_grads():
    x, y = _data((2, 3)), _data((2, 3), 1)
    fx, vx, _ = _init_both("ValueAndGradAuxFoo", x, y)
    got = vx.apply(SCALE, x, y)
    _close(_plain(got), _plain(fx.apply(SCALE, x, y)))
    value, aux, x_grad, y_grad = got
    z = 0.7 * x * y
    np.testing.assert_allclose(value, (z ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(aux["z"], z, rtol=1e-6)
    np.testing.assert_allclose(x_grad, 2 * z * 0.7 * y, rtol=1e-5)
    np.testing.assert_allclose(y_grad, 2 * z * 0.7 * x, rtol=1e-5)


def test_grad_docstring_example_differentiates_primals_only():
    x, y = _data((2, 3)), _data((2, 3), 1)
    fx, vx, _ = _init_both("GradFoo", x, y)
    got = vx.apply(SCALE, x, y)
    _close(got, fx.apply(SCALE, x, y))
    np.testing.assert_allclose(got[0], 0.7 * y, rtol=1e-6)
    np.testing.assert_allclose(got[1], 0.7 * x, rtol=1e-6)


def test_grad_with_aux_returns_grads_then_aux():
    x, y = _data((2, 3)), _data((2, 3), 1)
    fx, vx, _ = _init_both("GradAuxFoo", x, y)
    got = vx.apply(SCALE, x, y)
    _close(got, fx.apply(SCALE, x, y))
    x_grad, y_grad, aux = got
    z = 0.7 * x * y
    np.testing.assert_allclose(x_grad, jnp.cos(z) * 0.7 * y, rtol=1e-5)
    np.testing.assert_allclose(y_grad, jnp.cos(z) * 0.7 * x, rtol=1e-5)
    np.testing.assert_allclose(aux, 2.0 * z, rtol=1e-6)


def test_jvp_docstring_example_uses_variable_tangents():
    x, x_t = _data((2, 3)), _data((2, 3), 1)
    fx, vx, _ = _init_both("JvpFoo", x, x_t)
    variables = {"params": {"Scale_0": {"test": jnp.float32(0.7)}}}
    got = vx.apply(variables, x, x_t)
    _close(got, fx.apply(variables, x, x_t))
    out, out_t = got
    np.testing.assert_allclose(out, 0.7 * x, rtol=1e-6)
    # d(p * x) = dp * x + p * dx with dp = 1
    np.testing.assert_allclose(out_t, x + 0.7 * x_t, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# custom_vjp: Linen's sign-gradient example


def test_custom_vjp_sign_gradient_example_gives_sign_of_true_param_gradient():
    x = jnp.asarray([-0.5, 2.0, 0.25], jnp.float32)
    fx, vx, f_vars = _init_both("SignGradFoo", x)
    variables = {"params": {"Dense_0": {"kernel": _data((3, 1), 2), "bias": _data((1,), 3)}}}
    want = jax.grad(fx.apply, argnums=(0, 1))(variables, x)
    got = jax.grad(vx.apply, argnums=(0, 1))(variables, x)
    _close(_plain(got), _plain(want))
    params_grad, x_grad = got
    # true gradient of 3 * (x @ k + b): kernel 3x, bias 3 -> their signs
    np.testing.assert_array_equal(params_grad["params"]["Dense_0"]["kernel"][:, 0], jnp.sign(x))
    np.testing.assert_array_equal(params_grad["params"]["Dense_0"]["bias"], [1.0])
    # input gradients are passed through unchanged
    np.testing.assert_allclose(x_grad, 3.0 * variables["params"]["Dense_0"]["kernel"][:, 0],
                               rtol=1e-6)
    # the forward value is the plain Dense output
    np.testing.assert_allclose(vx.apply(variables, x), fx.apply(variables, x), rtol=1e-6)


# ---------------------------------------------------------------------------------------
# vjp: the backward function outlives the transform; writes inside it are kept


def test_vjp_fn_called_after_the_transform_in_the_same_method():
    x = _data((2, 4))
    fx, vx, f_vars = _init_both("LateBackward", x)
    variables = jax.tree.map(lambda v: v + 0.1, f_vars)
    got = vx.apply(variables, x)
    _close(_plain(got), _plain(fx.apply(variables, x)))
    y, ct, (p1, x1), (p2, x2) = got
    kernel = variables["params"]["Dense_0"]["kernel"]
    assert set(p1["params"]) == {"kernel", "bias"}         # relative to the Dense
    np.testing.assert_allclose(x1, ct @ kernel.T, rtol=1e-5)
    np.testing.assert_allclose(p1["params"]["kernel"], x.T @ ct, rtol=1e-5)
    np.testing.assert_allclose(p1["params"]["bias"], ct.sum(0), rtol=1e-5)
    _close((p2, x2), jax.tree.map(lambda g: 2.0 * g, (p1, x1)))


def test_vjp_keeps_batch_stats_written_inside_the_differentiated_function():
    x = _data((4, 3)) + 2.0
    fx, vx, f_vars = _init_both("BatchNormInVjp", x)
    (f_out, f_upd) = fx.apply(f_vars, x, mutable=["batch_stats"])
    (v_out, v_upd) = vx.apply(f_vars, x, mutable=["batch_stats"])
    _close(_plain(v_out), _plain(f_out))
    _close(_plain(v_upd), _plain(f_upd))
    stats = v_upd["batch_stats"]["BatchNorm_0"]
    # momentum 0.99 from mean 0, var 1
    np.testing.assert_allclose(stats["mean"], 0.01 * x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(stats["var"], 0.99 + 0.01 * x.var(0), rtol=1e-5)
    assert not np.allclose(stats["mean"], 0.0)
    y, params_grad, x_grad = v_out
    assert set(params_grad["params"]) == {"scale", "bias"}
    np.testing.assert_allclose(params_grad["params"]["bias"], [4.0, 4.0, 4.0], rtol=1e-6)
    np.testing.assert_allclose(x_grad, np.zeros((4, 3)), atol=1e-5)   # sum of a normalized x
