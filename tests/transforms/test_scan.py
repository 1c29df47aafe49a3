"""Lifted ``scan`` and ``remat_scan``: Linen parity, variable groups, options, and carry or
broadcast variables created inside the body (beyond Linen: the first step is peeled)."""
import functools

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn
from varjax.errors import TransformError

T, B, F, H = 4, 2, 3, 5


def _normal(shape, seed=0):
    # NumPy draws: no XLA compile per shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _layout(variables):
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    return {jax.tree_util.keystr(p): np.shape(x) for p, x in flat}


def _close(a, b, atol=1e-5):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=atol)


def _dense(p, x):
    y = x @ p["kernel"]
    return y + p["bias"].reshape((1,) * (y.ndim - 1) + (-1,))


# -- Linen parity -------------------------------------------------------------------------

def _rnn_model(lib):
    """The same model source for flax.linen and varjax.nn (``lib`` is either)."""
    class Cell(lib.Module):
        @lib.compact
        def __call__(self, c, x):
            h = jnp.tanh(lib.Dense(H)(x) + lib.Dense(H, use_bias=False)(c))
            return h, 2.0 * h

    class Model(lib.Module):
        @lib.compact
        def __call__(self, c, xs):
            scan = lib.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True})
            return scan()(c, xs)
    return Model()


def test_scan_module_class_has_linen_name_layout_and_outputs():
    c, xs = _normal((B, H), 1), _normal((T, B, F), 2)
    flax_model, vj_model = _rnn_model(flax_nn), _rnn_model(nn)
    flax_vars = flax_model.init(jax.random.key(0), c, xs)
    vj_vars = vj_model.init(jax.random.key(0), c, xs)
    assert list(vj_vars["params"]) == ["ScanCell_0"]
    assert _layout(vj_vars) == _layout(flax_vars)
    assert _layout(vj_vars)["['params']['ScanCell_0']['Dense_0']['kernel']"] == (T, F, H)
    variables = jax.tree.map(lambda x: x + 0.1 * _normal(x.shape, 3), dict(flax_vars))
    expected = flax_model.apply(variables, c, xs)
    got = vj_model.apply(variables, c, xs)
    _close(got, expected)
    # and a hand-written loop over the per-step slices agrees too
    p = variables["params"]["ScanCell_0"]
    h, ys = c, []
    for t in range(T):
        h = jnp.tanh(_dense(jax.tree.map(lambda v: v[t], p["Dense_0"]), xs[t])
                     + h @ p["Dense_1"]["kernel"][t])
        ys.append(2.0 * h)
    _close(got, (h, jnp.stack(ys)))


# -- variable groups --------------------------------------------------------------------

class _Step(nn.Module):
    """``c -> tanh(Dense(c) + x)``; the Dense's params are created in the body."""

    @nn.compact
    def __call__(self, c, x):
        h = jnp.tanh(nn.Dense(F)(c) + x)
        return h, h.sum(-1)


def test_variable_broadcast_params_are_one_set_shared_by_every_step():
    model = nn.scan(_Step, variable_broadcast="params", split_rngs={"params": False})()
    c, xs = _normal((B, F), 1), _normal((T, B, F), 2)
    variables = model.init(jax.random.key(0), c, xs)
    assert _layout(variables) == {"['params']['Dense_0']['bias']": (F,),
                                  "['params']['Dense_0']['kernel']": (F, F)}
    carry, ys = model.apply(variables, c, xs)
    p, h, expected = variables["params"]["Dense_0"], c, []
    for t in range(T):
        h = jnp.tanh(_dense(p, h) + xs[t])
        expected.append(h.sum(-1))
    _close((carry, ys), (h, jnp.stack(expected)))


@pytest.mark.parametrize("split", [True, False])
def test_variable_axes_params_give_one_slice_per_step(split):
    model = nn.scan(_Step, variable_axes={"params": 0}, split_rngs={"params": split})()
    c, xs = _normal((B, F), 1), _normal((T, B, F), 2)
    variables = model.init(jax.random.key(0), c, xs)
    kernel = variables["params"]["Dense_0"]["kernel"]
    assert kernel.shape == (T, F, F)
    distinct = {tuple(np.asarray(kernel[t]).ravel().round(6)) for t in range(T)}
    assert len(distinct) == (T if split else 1)     # split keys: every slice initialised differently


def test_variable_carry_counter_is_advanced_once_per_step():
    def body(mdl, c, x):
        n = mdl.variable("counter", "n", lambda: jnp.zeros((), jnp.int32))
        n.value = n.value + 1
        return c + x * n.value.astype(jnp.float32), n.value

    class Counted(nn.Module):
        @nn.compact
        def __call__(self, c, xs):
            return nn.scan(body, variable_carry="counter")(self, c, xs)

    xs = _normal((T, F), 2)
    start = {"counter": {"n": jnp.asarray(5, jnp.int32)}}
    (carry, ns), updated = Counted().apply(start, jnp.zeros((F,), jnp.float32), xs,
                                           mutable=["counter"])
    assert int(updated["counter"]["n"]) == 5 + T
    np.testing.assert_array_equal(ns, np.arange(6, 6 + T))
    _close(carry, (xs * jnp.arange(6, 6 + T, dtype=jnp.float32)[:, None]).sum(0))


def test_in_axes_and_out_axes_one_scan_the_second_axis():
    def body(mdl, c, x):
        return c + x, 2.0 * c

    class M(nn.Module):
        @nn.compact
        def __call__(self, c, xs):
            return nn.scan(body, in_axes=1, out_axes=1)(self, c, xs)

    xs = _normal((B, T), 1)                         # scanned along axis 1
    carry, ys = M().apply({}, jnp.zeros((B,), jnp.float32), xs)
    assert ys.shape == (B, T)
    _close(carry, xs.sum(1))
    _close(ys, 2.0 * jnp.concatenate([jnp.zeros((B, 1), jnp.float32), jnp.cumsum(xs, 1)[:, :-1]], 1))


def test_broadcast_in_axes_entry_gives_every_step_the_whole_argument():
    def body(mdl, c, x, w):
        assert w.shape == (F,)                      # never sliced
        return c + x * w, x * w

    class M(nn.Module):
        @nn.compact
        def __call__(self, c, xs, w):
            return nn.scan(body, in_axes=(0, nn.broadcast))(self, c, xs, w)

    assert vj.broadcast is nn.broadcast
    xs, w = _normal((T, F), 1), _normal((F,), 2)
    carry, ys = M().apply({}, jnp.zeros((F,), jnp.float32), xs, w)
    _close(ys, xs * w[None])
    _close(carry, (xs * w[None]).sum(0))


def test_length_without_xs_runs_that_many_steps():
    def body(mdl, c):
        return c * 2.0, c

    class M(nn.Module):
        @nn.compact
        def __call__(self, c):
            return nn.scan(body, length=T)(self, c)

    carry, ys = M().apply({}, jnp.ones((), jnp.float32))
    assert float(carry) == 2.0 ** T
    np.testing.assert_array_equal(ys, 2.0 ** np.arange(T))


def test_length_missing_and_nothing_scanned_raises():
    class M(nn.Module):
        @nn.compact
        def __call__(self, c):
            return nn.scan(lambda mdl, c: (c, c))(self, c)

    with pytest.raises(TransformError, match="length="):
        M().apply({}, jnp.ones((), jnp.float32))


def test_reverse_matches_a_hand_written_reversed_loop():
    model = nn.scan(_Step, variable_axes={"params": 0}, split_rngs={"params": True},
                    reverse=True)()
    c, xs = _normal((B, F), 1), _normal((T, B, F), 2)
    variables = model.init(jax.random.key(0), c, xs)
    carry, ys = model.apply(variables, c, xs)
    p, h, expected = variables["params"]["Dense_0"], c, [None] * T
    for t in reversed(range(T)):
        h = jnp.tanh(_dense(jax.tree.map(lambda v: v[t], p), h) + xs[t])
        expected[t] = h.sum(-1)
    _close((carry, ys), (h, jnp.stack(expected)))


def test_unroll_two_equals_unroll_one():
    kw = dict(variable_axes={"params": 0}, split_rngs={"params": True})
    one, two = nn.scan(_Step, unroll=1, **kw)(), nn.scan(_Step, unroll=2, **kw)()
    c, xs = _normal((B, F), 1), _normal((T, B, F), 2)
    variables = one.init(jax.random.key(0), c, xs)
    _close(two.apply(variables, c, xs), one.apply(variables, c, xs))


# -- targets ----------------------------------------------------------------------------

def test_scan_of_plain_function_with_vj_param_under_functionalize():
    def step(c, x):
        w = vj.param("w", lambda k: jax.random.normal(k, (F,)))
        return c * w + x, jnp.sum(c)

    @vj.functionalize
    def run(c, xs):
        return vj.scan(step, variable_axes={"params": 0}, split_rngs={"params": True})(c, xs)

    c, xs = _normal((F,), 1), _normal((T, F), 2)
    variables = run.init(jax.random.key(0), c, xs)
    w = variables["params"]["w"]
    assert w.shape == (T, F)
    carry, ys = run.apply(variables, c, xs)
    h, expected = c, []
    for t in range(T):
        expected.append(jnp.sum(h))
        h = h * w[t] + xs[t]
    _close((carry, ys), (h, jnp.stack(expected)))


def test_scan_as_method_decorator_matches_linen():
    def model(lib):
        class Decorated(lib.Module):
            @functools.partial(lib.scan, variable_broadcast="params", split_rngs={"params": False})
            @lib.compact
            def __call__(self, c, x):
                h = jnp.tanh(lib.Dense(F)(c) + x)
                return h, h.sum(-1)
        return Decorated()

    c, xs = _normal((B, F), 1), _normal((T, B, F), 2)
    flax_vars = model(flax_nn).init(jax.random.key(0), c, xs)
    vj_vars = model(nn).init(jax.random.key(0), c, xs)
    assert _layout(vj_vars) == _layout(flax_vars) == {
        "['params']['Dense_0']['bias']": (F,), "['params']['Dense_0']['kernel']": (F, F)}
    _close(model(nn).apply(flax_vars, c, xs), model(flax_nn).apply(flax_vars, c, xs))
