"""Object-mode ``vj.custom_vjp``: ``bwd(res, g)`` gets the output cotangent only and returns
one cotangent per positional argument, shaped like it; float variables may not be updated
inside the function, integer ones may.  (The design note's bound-module example is in
test_object_design_note.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj


def _sin_times(x, y):
    return jnp.sum(jnp.sin(x) * y)


def test_custom_vjp_of_two_variables_matches_jax_grad_of_the_formula():
    calls = []

    @vj.custom_vjp
    def f(x, y):
        return _sin_times(x.value, y.value)

    def f_fwd(x, y):
        return f(x, y), (jnp.cos(x.value), jnp.sin(x.value), y.value)

    def f_bwd(res, g):
        calls.append(g)
        cos_x, sin_x, y = res
        return vj.Variable(cos_x * g * y), vj.Variable(sin_x * g)
    f.defvjp(f_fwd, f_bwd)
    x, y = vj.Variable(jnp.array([0.5, 1.0])), vj.Variable(jnp.array([2.0, -1.0]))
    np.testing.assert_allclose(f(x, y), _sin_times(x.value, y.value))
    gx, gy = vj.grad(f, argnums=(0, 1))(x, y)
    ex, ey = jax.grad(_sin_times, argnums=(0, 1))(x.value, y.value)
    np.testing.assert_allclose(gx.value, ex, atol=1e-6)
    np.testing.assert_allclose(gy.value, ey, atol=1e-6)
    assert len(calls) == 1


def test_nondiff_argnums_are_not_differentiated():
    def scaled(v, n):
        return jnp.sum(v.value) * n
    scaled = vj.custom_vjp(scaled, nondiff_argnums=(1,))
    scaled.defvjp(lambda v, n: (scaled(v, n), n),
                  lambda n, g: (vj.Variable(jnp.full((2,), g * n)),))
    v = vj.Variable(jnp.ones(2))
    assert float(scaled(v, 3.0)) == 6.0
    np.testing.assert_array_equal(vj.grad(lambda v: scaled(v, 3.0))(v).value, [3.0, 3.0])


def test_integer_variable_may_be_updated_inside_and_is_written_back():
    count = vj.Variable(jnp.zeros((), jnp.int32), collection="count")

    def square(v, c):
        c.value = c.value + 1
        return jnp.sum(v.value ** 2)
    square = vj.custom_vjp(square)

    def fwd(v, c):
        c.value = c.value + 1
        return jnp.sum(v.value ** 2), v.value

    def bwd(v, g):
        return vj.Variable(2 * v * g), vj.Variable(jnp.zeros((), jnp.int32), collection="count")
    square.defvjp(fwd, bwd)
    v = vj.Variable(jnp.array([1.0, 2.0]))
    assert float(square(v, count)) == 5.0 and int(count.value) == 1
    g = vj.grad(square)(v, count)
    np.testing.assert_array_equal(g.value, [2.0, 4.0])
    assert int(count.value) == 2


def test_updating_a_float_variable_inside_raises_naming_it_and_leaves_it_unchanged():
    def double(v):
        v.value = v.value * 2.0
        return v.value.sum()
    double = vj.custom_vjp(double)
    double.defvjp(lambda v: (double(v), None), lambda res, g: (vj.Variable(jnp.ones(2)),))
    v = vj.Variable(jnp.ones(2))
    with pytest.raises(vj.errors.TransformError) as info:
        double(v)
    assert info.value.collection == "params" and info.value.path == ("v",)
    assert "float variable v of collection 'params'" in info.value.what   # first line too
    np.testing.assert_array_equal(v.value, [1.0, 1.0])


def test_calling_before_defvjp_raises():
    f = vj.custom_vjp(lambda v: v.value.sum())
    with pytest.raises(vj.errors.TransformError):
        f(vj.Variable(jnp.ones(2)))
