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
from transform_checks import close as _close
from transform_checks import data as _data
from transform_checks import layout as _layout
from transform_checks import plain as _plain

import varjax as vj
import varjax.nn as vj_nn


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


@functools.cache
def _nondiff_program(nn):
    """Linen's ``lift.custom_vjp`` docstring example (``bwd(features, vjp_fn, y_t)`` with
    ``nondiff_argnums=(2,)``), as a module: positions count the module as 0."""

    class ScaledSignGrad(nn.Module):
        @nn.compact
        def __call__(self, x):
            def f(mdl, x, k):
                return mdl(x) * k

            def fwd(mdl, x, k):
                y, vjp_fn = nn.vjp(lambda m, x: m(x), mdl, x)
                return y * k, vjp_fn

            def bwd(k, vjp_fn, y_t):
                params_t, *inputs_t = vjp_fn(y_t * k)
                return (jax.tree_util.tree_map(jnp.sign, params_t), *inputs_t)

            sign_grad = nn.custom_vjp(f, forward_fn=fwd, backward_fn=bwd, nondiff_argnums=(2,))
            return sign_grad(nn.Dense(1), x, -3.0).reshape(())
    return ScaledSignGrad


def test_custom_vjp_passes_nondiff_args_first_to_backward_fn_as_linen():
    x = jnp.asarray([-0.5, 2.0, 0.25], jnp.float32)
    fx, vx = _nondiff_program(flax_nn)(), _nondiff_program(vj_nn)()
    assert _layout(vx.init(jax.random.key(0), x)) == _layout(_plain(fx.init(jax.random.key(0), x)))
    variables = {"params": {"Dense_0": {"kernel": _data((3, 1), 2), "bias": _data((1,), 3)}}}
    got = jax.grad(vx.apply, argnums=(0, 1))(variables, x)
    _close(_plain(got), _plain(jax.grad(fx.apply, argnums=(0, 1))(variables, x)))
    params_grad, x_grad = got
    np.testing.assert_array_equal(params_grad["params"]["Dense_0"]["kernel"][:, 0], -jnp.sign(x))
    np.testing.assert_allclose(x_grad, -3.0 * variables["params"]["Dense_0"]["kernel"][:, 0],
                               rtol=1e-6)


# ---------------------------------------------------------------------------------------
# plain functions (mdl=None) under vj.functionalize


def test_plain_function_forms_with_mdl_none_differentiate_vj_params():
    def fn(x):
        w = vj.param("w", jax.nn.initializers.normal(1.0), (3,))
        return jnp.sin(w * x)

    def loss(x):
        return fn(x).sum()

    def program(x, t):
        y, bwd = vj.vjp(fn, None, x)
        var_grads, x_grad = bwd(jnp.ones_like(y))
        ones = {"params": {"w": jnp.ones((3,), jnp.float32)}}
        y2, y_t = vj.jvp(fn, None, (x,), (t,), variable_tangents=ones)
        (g,) = vj.grad(loss, None, x)    # a tuple over the primals, as in Linen
        value, (g2,) = vj.value_and_grad(loss, None, x)
        return y, var_grads, x_grad, y2, y_t, g, value, g2

    f = vj.functionalize(program)
    x, t = _data((3,)), _data((3,), 1)
    variables = f.init(jax.random.key(0), x, t)
    assert _layout(variables) == {"['params']['w']": ((3,), jnp.float32)}
    w = variables["params"]["w"]
    y, var_grads, x_grad, y2, y_t, g, value, g2 = f.apply(variables, x, t)
    np.testing.assert_allclose(y, jnp.sin(w * x), rtol=1e-6)
    np.testing.assert_allclose(y2, y, rtol=1e-6)
    assert set(var_grads) == {"params"} and set(var_grads["params"]) == {"w"}
    np.testing.assert_allclose(var_grads["params"]["w"], x * jnp.cos(w * x), rtol=1e-5)
    np.testing.assert_allclose(x_grad, w * jnp.cos(w * x), rtol=1e-5)
    np.testing.assert_allclose(y_t, jnp.cos(w * x) * (x + w * t), rtol=1e-5)   # dw = 1
    np.testing.assert_allclose(g, w * jnp.cos(w * x), rtol=1e-5)
    np.testing.assert_allclose(g2, g, rtol=1e-6)
    np.testing.assert_allclose(value, jnp.sin(w * x).sum(), rtol=1e-5)


# ---------------------------------------------------------------------------------------
# custom_jvp (beyond Flax)


class SinScale(vj_nn.Module):
    @vj_nn.compact
    def __call__(self, x):
        p = self.param("p", vj_nn.initializers.ones_init(), (3,))
        return p * jnp.sin(x)


def _double_rule(mdl, primals, tangents):
    """Twice the true tangent of ``p * sin(x)``."""
    (x,), (t,) = primals, tangents
    y = mdl(x)
    return y, 2.0 * mdl.variables["params"]["p"] * jnp.cos(x) * t


class DoubledSin(vj_nn.Module):
    @vj_nn.compact
    def __call__(self, x):
        return vj.custom_jvp(lambda mdl, x: mdl(x), _double_rule)(SinScale(), x)


P = jnp.asarray([1.5, -0.5, 2.0], jnp.float32)


def test_custom_jvp_rule_drives_jvp_and_grad_of_the_apply_wrt_inputs():
    model = DoubledSin()
    x, t = jnp.asarray([0.1, 0.5, -1.0], jnp.float32), _data((3,), 1)
    variables = model.init(jax.random.key(0), x)
    assert _layout(variables) == {"['params']['SinScale_0']['p']": ((3,), jnp.float32)}
    variables = {"params": {"SinScale_0": {"p": P}}}
    true_t = P * jnp.cos(x) * t
    out, out_t = jax.jvp(lambda x: model.apply(variables, x), (x,), (t,))
    np.testing.assert_allclose(out, P * jnp.sin(x), rtol=1e-6)       # primal unchanged
    np.testing.assert_allclose(out_t, 2.0 * true_t, rtol=1e-5)
    grad_x = jax.jit(jax.grad(lambda v, x: model.apply(v, x).sum(), argnums=1))(variables, x)
    np.testing.assert_allclose(grad_x, 2.0 * P * jnp.cos(x), rtol=1e-5)
    np.testing.assert_allclose(jax.jit(model.apply)(variables, x), out, rtol=1e-6)


def test_custom_jvp_differentiates_variables_through_fn():
    model = DoubledSin()
    x = jnp.asarray([0.1, 0.5, -1.0], jnp.float32)
    variables = {"params": {"SinScale_0": {"p": P}}}
    grads = jax.grad(lambda v: model.apply(v, x).sum())(variables)
    np.testing.assert_allclose(grads["params"]["SinScale_0"]["p"], jnp.sin(x), rtol=1e-5)


class PowerMask(vj_nn.Module):
    """``fn(mdl, x, mask, power)`` with the mask (an array) and the power nondiff."""

    @vj_nn.compact
    def __call__(self, x):
        def fn(mdl, x, mask, power):
            return mdl(x) ** power * mask

        def rule(mdl, mask, power, primals, tangents):
            (x,), (t,) = primals, tangents
            s = mdl(x)
            p = mdl.variables["params"]["p"]
            true_t = power * s ** (power - 1) * p * jnp.cos(x) * t * mask
            return s ** power * mask, 3.0 * true_t

        mask = jnp.asarray([1.0, 0.0, 2.0], jnp.float32)
        return vj.custom_jvp(fn, rule, nondiff_argnums=(2, 3))(SinScale(), x, mask, 2)


def test_custom_jvp_passes_nondiff_args_before_primals_and_tangents():
    model = PowerMask()
    x, t = jnp.asarray([0.1, 0.5, -1.0], jnp.float32), _data((3,), 1)
    model.init(jax.random.key(0), x)
    variables = {"params": {"SinScale_0": {"p": P}}}
    mask = jnp.asarray([1.0, 0.0, 2.0], jnp.float32)
    s = P * jnp.sin(x)
    out, out_t = jax.jvp(lambda x: model.apply(variables, x), (x,), (t,))
    np.testing.assert_allclose(out, s ** 2 * mask, rtol=1e-5)
    np.testing.assert_allclose(out_t, 3.0 * 2 * s * P * jnp.cos(x) * t * mask, rtol=1e-5)


class Tally(vj_nn.Module):
    @vj_nn.compact
    def __call__(self, x):
        calls = self.variable("stats", "calls", lambda: jnp.zeros((), jnp.float32))
        calls.value = calls.value + 1.0
        return SinScale(name="inner")(x)


@pytest.mark.parametrize("rule_calls_module", [True, False])
def test_custom_jvp_keeps_writes_of_fn_under_differentiation(rule_calls_module):
    def rule(mdl, primals, tangents):
        (x,), (t,) = primals, tangents
        p = mdl.variables["params"]["inner"]["p"]
        y = mdl(x) if rule_calls_module else p * jnp.sin(x)   # the rule need not write
        return y, 2.0 * p * jnp.cos(x) * t

    class Outer(vj_nn.Module):
        @vj_nn.compact
        def __call__(self, x):
            return vj.custom_jvp(lambda mdl, x: mdl(x), rule)(Tally(), x)

    model = Outer()
    x, t = jnp.asarray([0.1, 0.5, -1.0], jnp.float32), _data((3,), 1)
    variables = model.init(jax.random.key(0), x)
    assert _layout(variables) == {"['params']['Tally_0']['inner']['p']": ((3,), jnp.float32),
                                  "['stats']['Tally_0']['calls']": ((), jnp.float32)}
    variables = {"params": {"Tally_0": {"inner": {"p": P}}},
                 "stats": {"Tally_0": {"calls": jnp.float32(5.0)}}}
    (out, updated), (out_t, _) = jax.jvp(
        lambda x: model.apply(variables, x, mutable=["stats"]), (x,), (t,))
    assert float(updated["stats"]["Tally_0"]["calls"]) == 6.0
    np.testing.assert_allclose(out, P * jnp.sin(x), rtol=1e-6)
    np.testing.assert_allclose(out_t, 2.0 * P * jnp.cos(x) * t, rtol=1e-5)


def test_custom_rules_of_plain_functions_with_mdl_none_count_their_own_parameters():
    def fn(x, k):
        w = vj.param("w", jax.nn.initializers.normal(1.0), (3,))
        return k * jnp.sin(w * x)

    def jvp_rule(k, primals, tangents):          # nondiff k first, no module
        (x,), (t,) = primals, tangents
        return fn(x, k), 10.0 * t

    def fwd(x, k):
        return fn(x, k), x

    def bwd(k, x, ct):                           # nondiff k first, then residuals
        return {"params": {"w": jnp.full((3,), k, jnp.float32)}}, -ct

    def program(x):
        a = vj.custom_jvp(fn, jvp_rule, nondiff_argnums=(1,))(None, x, 2.0)
        b = vj.custom_vjp(fn, fwd, bwd, nondiff_argnums=(1,))(None, x, 3.0)
        return (a + b).sum()

    f = vj.functionalize(program)
    x = _data((3,))
    variables = f.init(jax.random.key(0), x)
    w = variables["params"]["w"]
    np.testing.assert_allclose(f.apply(variables, x), (5.0 * jnp.sin(w * x)).sum(), rtol=1e-5)
    # jax.grad runs both custom rules: 10 (custom_jvp) - 1 (custom_vjp) per input
    np.testing.assert_allclose(jax.grad(f.apply, argnums=1)(variables, x), np.full((3,), 9.0),
                               rtol=1e-6)
    # params: true derivative through the custom_jvp's fn, backward_fn's value for custom_vjp
    grads = jax.grad(f.apply)(variables, x)["params"]["w"]
    np.testing.assert_allclose(grads, 2.0 * x * jnp.cos(w * x) + 3.0, rtol=1e-5)


def test_custom_vjp_backward_returning_too_few_gradients_raises():
    class Foo(vj_nn.Module):
        @vj_nn.compact
        def __call__(self, x):
            def f(mdl, x):
                return mdl(x)

            def fwd(mdl, x):
                return vj_nn.vjp(f, mdl, x)

            def bwd(vjp_fn, y_t):
                params_t, *_ = vjp_fn(y_t)
                return (params_t,)                   # the gradient of x is missing
            return vj_nn.custom_vjp(f, fwd, bwd)(vj_nn.Dense(1), x).reshape(())

    x = jnp.ones((2,), jnp.float32)
    variables = Foo().init(jax.random.key(0), x)
    with pytest.raises(vj.errors.TransformError, match="0 argument gradients for 1"):
        jax.grad(Foo().apply)(variables, x)
