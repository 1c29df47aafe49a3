"""Raw ``jax.grad`` / ``jax.jvp`` / ``jax.vjp`` over stateful code: a variable written and
then read inside the differentiated function is data flow, so the read carries the written
value's derivative; the stored value stays the primal.  Each case is checked against the
same computation written as pure JAX."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn

X = jnp.arange(3.0)
ONES = jnp.ones(3)


def _run(body, x=X):
    """``body(x)`` under init (everything mutable): returns (output, variables)."""
    return vj.functionalize(body).init_with_output(jax.random.key(0), x)


def _counter():
    return vj.variable("stats", "n", jnp.zeros, (3,))


def test_grad_through_a_write_then_read_sees_the_written_derivative():
    def body(x):
        n = _counter()

        def loss(x):
            n.value = 2 * x
            return jnp.sum(n.value * x)
        return jax.grad(loss)(x)

    g, variables = _run(body)
    np.testing.assert_allclose(g, 4 * X)
    np.testing.assert_allclose(variables["stats"]["n"], 2 * X)   # the primal is stored


def test_jvp_and_vjp_through_a_write_then_read():
    def body(x):
        n = _counter()

        def f(x):
            n.value = jnp.sin(x)
            return n.value * x
        _, tangent = jax.jvp(f, (x,), (ONES,))
        _, pullback = jax.vjp(f, x)
        return tangent, pullback(ONES)[0]

    (tangent, cotangent), _ = _run(body)
    expected = jax.jvp(lambda x: jnp.sin(x) * x, (X,), (ONES,))[1]
    np.testing.assert_allclose(tangent, expected, rtol=1e-6)
    np.testing.assert_allclose(cotangent, expected, rtol=1e-6)


@pytest.mark.parametrize("wrap", ["jit", "scan", "cond", "checkpoint"])
def test_write_then_read_inside_a_raw_transform_under_grad(wrap):
    def body(x):
        n = _counter()

        def inner(x):
            n.value = 2 * x
            return jnp.sum(n.value * x)
        region = {
            "jit": jax.jit(inner),
            "scan": lambda x: jax.lax.scan(lambda c, _: (c, inner(c)), x, None, length=1)[1][0],
            "cond": lambda x: jax.lax.cond(True, inner, inner, x),
            "checkpoint": jax.checkpoint(inner),
        }[wrap]
        return jax.grad(region)(x)

    g, _ = _run(body)
    np.testing.assert_allclose(g, 4 * X)


def test_nested_differentiation_reads_the_value_at_its_own_level():
    def body(x):
        n = vj.variable("stats", "n", jnp.zeros, ())

        def inner(y):
            n.value = 3 * y
            return y * y

        def outer(y):
            return jax.grad(inner)(y) + n.value * y   # d/dy (2y + 3y*y) = 2 + 6y
        return jax.grad(outer)(x[1])

    g, _ = _run(body)
    np.testing.assert_allclose(g, 2 + 6 * X[1])


def test_a_write_in_between_under_a_cached_jitted_helper_cuts_the_forwarding():
    @jax.jit
    def reset(z):
        vj.variable("stats", "n").value = jnp.full(3, 5.0)
        return z

    def body(x):
        n = _counter()

        def loss(x):
            n.value = 2 * x
            reset(x)          # traced before: a JAX cache hit runs no Python
            return jnp.sum(n.value * x)
        reset(x)
        return jax.grad(loss)(x)

    g, variables = _run(body)
    np.testing.assert_allclose(g, jnp.full(3, 5.0))
    np.testing.assert_allclose(variables["stats"]["n"], jnp.full(3, 5.0))


def test_a_value_written_before_the_differentiated_function_is_a_constant():
    def body(x):
        n = _counter()
        n.value = 2 * x

        def loss(x):
            return jnp.sum(n.value * x)
        return jax.grad(loss)(x)

    g, _ = _run(body)
    np.testing.assert_allclose(g, 2 * X)


def test_a_weakly_typed_write_reads_back_strongly_typed_under_jvp():
    def body(x):
        n = vj.variable("stats", "n", jnp.zeros, ())

        def f(y):
            n.value = 2.0
            return n.value * y
        return jax.jvp(f, (x[1],), (jnp.float32(1.0),))

    (primal, tangent), _ = _run(body)
    assert primal.dtype == jnp.float32 and not primal.weak_type
    np.testing.assert_allclose(tangent, 2.0)


def test_module_counter_under_raw_grad_in_apply():
    class Scaled(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = self.variable("stats", "h", jnp.zeros, x.shape)

            def loss(x):
                h.value = x * x
                return jnp.sum(h.value * x)     # x^3: derivative 3x^2
            return jax.grad(loss)(x)

    model = Scaled()
    variables = model.init(jax.random.key(0), X)
    g, updates = model.apply(variables, X, mutable=["stats"])
    np.testing.assert_allclose(g, 3 * X ** 2)
    np.testing.assert_allclose(updates["stats"]["h"], X ** 2)
    g_jit, _ = jax.jit(lambda v, x: model.apply(v, x, mutable=["stats"]))(variables, X)
    np.testing.assert_allclose(g_jit, 3 * X ** 2)
