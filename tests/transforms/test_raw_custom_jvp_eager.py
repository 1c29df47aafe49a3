"""Raw ``jax.custom_jvp`` / ``jax.custom_vjp`` whose function closes over a value traced in
the stateful function (a ``vj.param`` read, or a value computed from one).

The rules close over the same Python tracer as the function, and JAX traces them only when
it differentiates, after the functionalize trace has ended.  ``discharge`` passes the value
in (it is one of the call's leading operands), so the rule works under eager ``jax.grad``,
``jax.jvp``, ``jax.vjp`` and under ``jax.jit``.  A custom rule has no term for the values its
function closes over, so differentiating with respect to one is a ``TransformError`` (JAX
itself rejects it eagerly, and drops it silently under ``jit``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from varjax import errors, nn

X = jnp.float32(0.5)
W = jnp.float32(3.0)
HERE = "test_raw_custom_jvp_eager.py:"


def _sin_scaled_by(w):
    """``w * sin(x)`` whose rule gives *twice* the true tangent, so a test can tell the rule
    ran; the rule calls the function, as usual."""
    @jax.custom_jvp
    def g(x):
        return w * jnp.sin(x)

    @g.defjvp
    def g_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return g(x), 2.0 * w * jnp.cos(x) * t
    return g


def _sin_scaled_by_vjp(w):
    """The same with ``jax.custom_vjp``; the forward rule saves the input itself (JAX then
    forwards it instead of storing a residual) and ``bwd`` closes over ``w``."""
    @jax.custom_vjp
    def g(x):
        return w * jnp.sin(x)

    def fwd(x):
        return g(x), (x,)

    def bwd(res, ct):
        (x,) = res
        return (2.0 * w * jnp.cos(x) * ct,)
    g.defvjp(fwd, bwd)
    return g


RULE = 2.0 * W * jnp.cos(X)      # what the rules say d/dx is


@vj.functionalize
def closes_over_param(x):
    return _sin_scaled_by(vj.param("w", nn.initializers.ones, ()))(x)


@vj.functionalize
def vjp_closes_over_param(x):
    return _sin_scaled_by_vjp(vj.param("w", nn.initializers.ones, ()))(x)


class ClosesOverParam(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _sin_scaled_by(self.param("w", nn.initializers.ones, ()))(x)


WAYS = {
    "eager grad": lambda f: jax.grad(f)(X),
    "jit of grad": lambda f: jax.jit(jax.grad(f))(X),
    "eager jvp": lambda f: jax.jvp(f, (X,), (jnp.ones_like(X),))[1],
    "eager vjp": lambda f: jax.vjp(f, X)[1](jnp.ones_like(X))[0],
}
TARGETS = {
    "function": lambda x: closes_over_param.apply({"params": {"w": W}}, x),
    "module": lambda x: ClosesOverParam().apply({"params": {"w": W}}, x),
}


@pytest.mark.parametrize("way", list(WAYS), ids=list(WAYS))
@pytest.mark.parametrize("target", list(TARGETS), ids=list(TARGETS))
def test_custom_jvp_closing_over_a_param_uses_its_rule_eagerly_and_under_jit(way, target):
    np.testing.assert_allclose(WAYS[way](TARGETS[target]), RULE, rtol=1e-6)


@pytest.mark.parametrize("way", ["eager grad", "jit of grad", "eager vjp"])
def test_custom_vjp_closing_over_a_param_uses_its_rule_eagerly_and_under_jit(way):
    f = lambda x: vjp_closes_over_param.apply({"params": {"w": W}}, x)   # noqa: E731
    np.testing.assert_allclose(WAYS[way](f), RULE, rtol=1e-6)


def test_closure_over_a_value_computed_from_a_param_inside_a_jitted_helper():
    @vj.functionalize
    def f(x):
        w = vj.param("w", nn.initializers.ones, ())
        return jax.jit(lambda x: _sin_scaled_by(2.0 * w)(x))(x)
    g = jax.grad(lambda x: f.apply({"params": {"w": W}}, x))(X)
    np.testing.assert_allclose(g, 2.0 * RULE, rtol=1e-6)


def test_closure_inside_a_scan_body_over_a_param_read_outside_it():
    @vj.functionalize
    def f(xs):
        g = _sin_scaled_by(vj.param("w", nn.initializers.ones, ()))
        return jax.lax.scan(lambda c, x: (c, g(x)), 0.0, xs)[1]
    xs = jnp.array([0.5, 1.0])
    grads = jax.grad(lambda xs: jnp.sum(f.apply({"params": {"w": W}}, xs)))(xs)
    np.testing.assert_allclose(grads, 2.0 * W * jnp.cos(xs), rtol=1e-6)


def test_closure_survives_a_pass_that_re_traces_the_call():
    # A draw inside a scan body makes lower-rng re-trace the top level, which re-binds
    # the custom call: its closed-over operand becomes an ordinary argument.
    @vj.functionalize
    def f(x):
        g = _sin_scaled_by(vj.param("w", nn.initializers.ones, ()))
        noise = jax.lax.scan(lambda c, _: (c + jax.random.uniform(vj.make_rng("noise")), None),
                             0.0, length=2)[0]
        return g(x) + 0.0 * noise
    grad = jax.grad(lambda x: f.apply({"params": {"w": W}}, x, rngs={"noise": jax.random.key(1)}))
    np.testing.assert_allclose(grad(X), RULE, rtol=1e-6)


def test_closure_over_a_second_read_of_the_same_param():
    # forward-stores turns the second read into the first one's value.
    @vj.functionalize
    def f(x):
        a = vj.param("w", nn.initializers.ones, ())
        b = vj.param("w", nn.initializers.ones, ())
        return _sin_scaled_by(b)(x) + a
    np.testing.assert_allclose(jax.grad(lambda x: f.apply({"params": {"w": W}}, x))(X), RULE,
                               rtol=1e-6)


# --- what a custom rule cannot give -----------------------------------------------------------

def _assert_names(exc, collection, path, words):
    assert (exc.collection, exc.path) == (collection, path), exc
    assert exc.source is not None and HERE in exc.source, exc
    for w in words:
        assert w in str(exc), exc


@pytest.mark.parametrize("fn", [closes_over_param, vjp_closes_over_param],
                         ids=["custom_jvp", "custom_vjp"])
def test_gradient_wrt_a_closed_over_param_raises_instead_of_silently_zero(fn):
    name = "jax.custom_jvp" if fn is closes_over_param else "jax.custom_vjp"
    for grad in (jax.grad, lambda f: jax.jit(jax.grad(f))):
        with pytest.raises(errors.TransformError) as info:
            grad(lambda v: fn.apply({"params": {"w": v}}, X))(W)
        _assert_names(info.value, "params", ("w",), [name, "closes over", "silently"])


def test_gradient_wrt_an_argument_the_function_closes_over_raises():
    @vj.functionalize
    def f(x):
        return _sin_scaled_by(vj.param("w", nn.initializers.ones, ()) * x)(X)
    with pytest.raises(errors.TransformError) as info:
        jax.grad(lambda x: f.apply({"params": {"w": W}}, x))(X)
    _assert_names(info.value, "params", ("w",), ["closes over", "argument"])


def test_rule_closing_over_a_value_its_function_does_not_use_raises():
    @vj.functionalize
    def f(x):
        w = vj.param("w", nn.initializers.ones, ())

        @jax.custom_jvp
        def g(x):                       # closes over nothing traced
            return jnp.sin(x)

        @g.defjvp
        def g_jvp(primals, tangents):
            return g(primals[0]), w * jnp.cos(primals[0]) * tangents[0]
        return g(x) + w
    with pytest.raises(errors.TransformError) as info:
        jax.grad(lambda x: f.apply({"params": {"w": W}}, x))(X)
    _assert_names(info.value, "params", ("w",), ["does not use"])


def test_rule_closing_over_one_more_value_than_its_function_raises():
    @vj.functionalize
    def f(x):
        w = vj.param("w", nn.initializers.ones, ())
        u = vj.param("u", nn.initializers.ones, ())

        @jax.custom_jvp
        def g(x):                       # closes over w only
            return w * jnp.sin(x)

        @g.defjvp
        def g_jvp(primals, tangents):
            return g(primals[0]), u * jnp.cos(primals[0]) * tangents[0]
        return g(x)
    with pytest.raises(errors.TransformError) as info:
        jax.grad(lambda x: f.apply({"params": {"w": W, "u": W}}, x))(X)
    _assert_names(info.value, "params", ("u",), ["does not use"])


def test_rule_of_a_rebuilt_call_reading_a_variable_its_function_does_not_raises():
    @vj.functionalize
    def f(x):
        w = vj.param("w", nn.initializers.ones, ())

        @jax.custom_jvp
        def g(x):
            return w * jnp.sin(x)

        @g.defjvp
        def g_jvp(primals, tangents):
            u = vj.param("u", nn.initializers.ones, ())
            return g(primals[0]), u * jnp.cos(primals[0]) * tangents[0]
        return g(x) + vj.param("u", nn.initializers.ones, ())
    with pytest.raises(errors.TransformError) as info:
        jax.grad(lambda x: f.apply({"params": {"w": W, "u": W}}, x))(X)
    _assert_names(info.value, "params", ("u",), ["touches variables"])


def test_calls_of_one_custom_function_closing_over_a_value_in_different_positions_raise():
    def make(a, b, swap):
        @jax.custom_jvp
        def g(x):                       # swap changes the order the closure is met in
            return b * x + a if swap else a * x + b

        @g.defjvp
        def g_jvp(primals, tangents):
            return g(primals[0]), a * tangents[0]
        return g

    @vj.functionalize
    def f(x):
        w = vj.param("w", nn.initializers.ones, ())
        u = vj.param("u", nn.initializers.ones, ())
        return make(w, u, False)(x) + make(w, u, True)(x)
    with pytest.raises(errors.TransformError) as info:
        jax.grad(lambda x: f.apply({"params": {"w": W, "u": W}}, x))(X)
    _assert_names(info.value, "params", ("w",), ["different positions"])
