"""Object-mode ``vj.custom_vjp`` (``varjax/objects/custom_vjp.py``): ``bwd(*nondiff, res, g)``
gets what ``jax.custom_vjp``'s gets and returns one cotangent per other argument, shaped
like it; Variables updated inside are written back, and their updates' cotangents reach
``bwd`` when it takes ``updates_g``.  (The design note's bound-module example is in
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


def test_bwd_gets_the_nondiff_arguments_first_as_jax_custom_vjp_gives_them():
    def scaled(v, n, w):
        return jnp.sum(v.value) * n * w
    scaled = vj.custom_vjp(scaled, nondiff_argnums=(1,))
    seen = []

    def bwd(n, res, g):
        seen.append(n)
        return vj.Variable(jnp.full((2,), g * n * res)), g * n * 2.0
    scaled.defvjp(lambda v, n, w: (scaled(v, n, w), w), bwd)

    def raw(v, n, w):     # the same rule on jax.custom_vjp, over the Variable's value
        return jnp.sum(v) * n * w
    raw = jax.custom_vjp(raw, nondiff_argnums=(1,))
    raw.defvjp(lambda v, n, w: (raw(v, n, w), w),
               lambda n, res, g: (jnp.full((2,), g * n * res), g * n * 2.0))
    v = vj.Variable(jnp.ones(2))
    assert float(scaled(v, 3.0, 2.0)) == 12.0
    gv, gw = vj.grad(scaled, argnums=(0, 2))(v, 3.0, 2.0)
    ev, ew = jax.grad(raw, argnums=(0, 2))(v.value, 3.0, 2.0)
    np.testing.assert_array_equal(gv.value, ev)
    assert float(gw) == float(ew) == 6.0 and seen == [3.0]


def test_nondiff_argument_may_be_an_object_and_bwd_reads_its_variables():
    def scaled(v, s):
        return jnp.sum(v.value) * s.value
    scaled = vj.custom_vjp(scaled, nondiff_argnums=(1,))
    scaled.defvjp(lambda v, s: (scaled(v, s), None),
                  lambda s, res, g: (vj.Variable(jnp.full((2,), g * s.value)),))
    v, s = vj.Variable(jnp.ones(2)), vj.Variable(jnp.array(4.0))
    np.testing.assert_array_equal(vj.grad(scaled)(v, s).value, [4.0, 4.0])
    np.testing.assert_array_equal(vj.jit(vj.grad(scaled))(v, s).value, [4.0, 4.0])


def test_bwd_returning_the_wrong_number_of_cotangents_raises():
    f = vj.custom_vjp(lambda v, w: jnp.sum(v.value * w))
    f.defvjp(lambda v, w: (f(v, w), None), lambda res, g: (vj.Variable(jnp.ones(2)),))
    with pytest.raises(vj.errors.TransformError, match="returned 1 cotangents for 2"):
        vj.grad(f)(vj.Variable(jnp.ones(2)), 2.0)


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


def _running_mean(pass_updates_g: bool = False):
    """``sum(x * w)`` updating a float running mean of ``x`` inside: a batch statistic.
    With ``pass_updates_g``, bwd takes ``updates_g`` and gives the statistic's update
    cotangent as the statistic's own (and records what it was handed)."""
    def f(w, stat, x):
        stat.value = 0.5 * stat.value + 0.5 * jnp.mean(x)
        return jnp.sum(x * w.value)
    f = vj.custom_vjp(f)
    f.seen = []

    def fwd(w, stat, x):
        return f(w, stat, x), (w.value, x)

    def bwd(res, g):
        w, x = res
        return vj.Variable(g * x), vj.Variable(jnp.zeros(()), collection="batch_stats"), g * w

    def bwd_updates_g(res, g, *, updates_g):
        f.seen.append(tuple(type(u) for u in updates_g))
        gw, _, gx = bwd(res, g)
        return gw, updates_g[1], gx
    f.defvjp(fwd, bwd_updates_g if pass_updates_g else bwd)
    return f


def test_float_variable_updated_inside_is_written_back_under_grad_and_jit():
    f = _running_mean()
    w, x = vj.Variable(jnp.array([1.0, 2.0])), jnp.array([2.0, 4.0])
    stat = vj.Variable(jnp.array(0.0), collection="batch_stats")
    gw = vj.grad(f)(w, stat, x)
    np.testing.assert_array_equal(gw.value, x)
    assert float(stat.value) == 1.5
    gw = vj.jit(vj.grad(f))(w, stat, x)
    np.testing.assert_array_equal(gw.value, x)
    assert float(stat.value) == 2.25


def test_bwd_taking_updates_g_gets_the_cotangent_of_each_update_and_none_elsewhere():
    f = _running_mean(pass_updates_g=True)
    w, x = vj.Variable(jnp.array([1.0, 2.0])), jnp.array([2.0, 4.0])
    stat = vj.Variable(jnp.array(0.0), collection="batch_stats")

    def loss(w, stat):      # the updated statistic is used after the call: cotangent 3
        return f(w, stat, x) + 3.0 * stat.value
    gw, gstat = vj.grad(loss, argnums=(0, 1))(w, stat)
    np.testing.assert_array_equal(gw.value, x)
    assert float(gstat.value) == 3.0
    assert f.seen == [(type(None), vj.Variable, type(None))]


def test_calling_before_defvjp_raises():
    f = vj.custom_vjp(lambda v: v.value.sum())
    with pytest.raises(vj.errors.TransformError):
        f(vj.Variable(jnp.ones(2)))
