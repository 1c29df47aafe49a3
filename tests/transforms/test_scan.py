"""Lifted ``scan`` and ``remat_scan``: Linen parity, variable groups, options, and carry or
broadcast variables created inside the body (beyond Linen: the first step is peeled)."""
import functools

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transform_checks import close as _close
from transform_checks import shape_layout as _layout

import varjax as vj
import varjax.nn as nn
from varjax.errors import TransformError

T, B, F, H = 4, 2, 3, 5


def _normal(shape, seed=0):
    # NumPy draws: no XLA compile per shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


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
    traced = jax.make_jaxpr(lambda v: two.apply(v, c, xs))(variables)
    assert _scan_params(traced.jaxpr, "unroll") == [2]


def _scan_params(jaxpr, name):
    """``name`` of every ``scan`` equation in ``jaxpr`` and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn.params[name])
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if hasattr(sub, "eqns"):
                    found += _scan_params(sub, name)
                elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                    found += _scan_params(sub.jaxpr, name)
    return found


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


def test_nested_scan_stacks_params_along_both_levels_like_linen():
    def model(lib):
        class Inner(lib.Module):
            @lib.compact
            def __call__(self, c, _):
                return jnp.tanh(lib.Dense(F)(c)), None

        class Outer(lib.Module):
            @lib.compact
            def __call__(self, c, _):
                inner = lib.scan(Inner, variable_axes={"params": 0}, split_rngs={"params": True},
                                 length=3)
                return inner()(c, None)[0], None

        class Model(lib.Module):
            @lib.compact
            def __call__(self, c):
                outer = lib.scan(Outer, variable_axes={"params": 0}, split_rngs={"params": True},
                                 length=2)
                return outer()(c, None)[0]
        return Model()

    c = _normal((B, F), 1)
    flax_vars = model(flax_nn).init(jax.random.key(0), c)
    vj_vars = model(nn).init(jax.random.key(0), c)
    assert _layout(vj_vars) == _layout(flax_vars)
    p = vj_vars["params"]["ScanOuter_0"]["ScanInner_0"]["Dense_0"]
    assert p["kernel"].shape == (2, 3, F, F)
    got = model(nn).apply(vj_vars, c)
    h = c
    for i in range(2):
        for j in range(3):
            h = jnp.tanh(_dense(jax.tree.map(lambda v: v[i, j], p), h))
    _close(got, h)
    assert len({float(p["kernel"][i, j, 0, 0]) for i in range(2) for j in range(3)}) == 6


def test_scan_inside_vmap_gives_each_member_its_own_scanned_params():
    class Ensemble(nn.Module):
        @nn.compact
        def __call__(self, c, xs):
            scanned = nn.scan(_Step, variable_axes={"params": 0}, split_rngs={"params": True})
            members = nn.vmap(scanned, variable_axes={"params": 0}, split_rngs={"params": True},
                              in_axes=0, out_axes=0)
            return members()(c, xs)

    E = 2
    c, xs = _normal((E, F), 1), _normal((E, T, F), 2)
    variables = Ensemble().init(jax.random.key(0), c, xs)
    p = variables["params"]["VmapScan_Step_0"]["Dense_0"]
    assert p["kernel"].shape == (E, T, F, F)
    carry, ys = Ensemble().apply(variables, c, xs)
    assert ys.shape == (E, T)
    for e in range(E):
        h = c[e]
        for t in range(T):
            h = jnp.tanh(_dense(jax.tree.map(lambda v: v[e, t], p), h) + xs[e, t])
            np.testing.assert_allclose(ys[e, t], h.sum(), atol=1e-5)
        _close(carry[e], h)


# -- beyond Linen: carry and broadcast variables created in the body --------------------

class _Counted(nn.Module):
    """A counter in 'state' (created in the body) and a Dense whose params are broadcast."""

    @nn.compact
    def __call__(self, c, x):
        n = self.variable("state", "n", lambda: jnp.zeros((), jnp.int32))
        n.value = n.value + 1
        h = jnp.tanh(nn.Dense(F)(c) + x)
        return h, (n.value, h)


def _counted(**kw):
    return nn.scan(_Counted, variable_carry="state", variable_broadcast="params",
                   split_rngs={"params": False}, **kw)()


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_creates_carry_variable_by_peeling_first_step(reverse):
    model = _counted(reverse=reverse)
    c, xs = _normal((B, F), 1), _normal((T, B, F), 2)
    (carry, (ns, hs)), variables = model.init_with_output(jax.random.key(0), c, xs)
    assert int(variables["state"]["n"]) == T
    order = list(reversed(range(T))) if reverse else list(range(T))
    expected_n = np.empty(T, np.int32)
    expected_n[order] = np.arange(1, T + 1)
    np.testing.assert_array_equal(ns, expected_n)
    # the broadcast params, created in the peeled step, are the ones every step used
    p, h = variables["params"]["Dense_0"], c
    assert p["kernel"].shape == (F, F)
    for t in order:
        h = jnp.tanh(_dense(p, h) + xs[t])
        _close(hs[t], h)
    _close(carry, h)
    # applying with the variables in hand continues the count (no peeling needed)
    _, updated = model.apply(variables, c, xs, mutable=["state"])
    assert int(updated["state"]["n"]) == 2 * T


def test_scan_peels_the_only_step_when_length_is_one():
    model = _counted()
    c, xs = _normal((B, F), 1), _normal((1, B, F), 2)
    (carry, (ns, hs)), variables = model.init_with_output(jax.random.key(0), c, xs)
    assert int(variables["state"]["n"]) == 1
    np.testing.assert_array_equal(ns, [1])
    assert hs.shape == (1, B, F)
    _close(carry, jnp.tanh(_dense(variables["params"]["Dense_0"], c) + xs[0]))


class _WritesBroadcast(nn.Module):
    @nn.compact
    def __call__(self, c, x):
        m = self.variable("stats", "m", lambda: jnp.zeros((F,), jnp.float32))
        m.value = m.value + x.mean(0)
        return c, None


def test_writing_a_broadcast_variable_in_the_body_raises():
    model = nn.scan(_WritesBroadcast, variable_broadcast="stats")()
    c, xs = _normal((B, F), 1), _normal((T, B, F), 2)
    variables = {"stats": {"m": jnp.zeros((F,), jnp.float32)}}
    with pytest.raises(TransformError, match="variable m is in variable_broadcast") as info:
        model.apply(variables, c, xs, mutable=["stats"])
    assert "collection: stats" in str(info.value) and "variable_carry" in str(info.value)


def test_writing_a_broadcast_variable_it_created_in_the_body_raises_at_init():
    model = nn.scan(_WritesBroadcast, variable_broadcast="stats")()
    c, xs = _normal((B, F), 1), _normal((T, B, F), 2)
    with pytest.raises(TransformError, match="variable m is in variable_broadcast"):
        model.init(jax.random.key(0), c, xs)


# -- remat_scan ---------------------------------------------------------------------------

def test_remat_scan_dense_stacks_params_along_lengths_like_linen():
    def model(lib):
        class Stack(lib.Module):
            @lib.compact
            def __call__(self, x):
                return lib.remat_scan(lib.Dense, lengths=(2, 3))(F, name="stack")(x)
        return Stack()

    x = _normal((B, F), 1)
    flax_vars = model(flax_nn).init(jax.random.key(0), x)
    vj_vars = model(nn).init(jax.random.key(0), x)
    assert _layout(vj_vars) == _layout(flax_vars)
    p = vj_vars["params"]["stack"]
    assert p["kernel"].shape == (2, 3, F, F) and p["bias"].shape == (2, 3, F)
    got = model(nn).apply(flax_vars, x)
    _close(got, model(flax_nn).apply(flax_vars, x))
    h, q = x, flax_vars["params"]["stack"]
    for i in range(2):
        for j in range(3):
            h = _dense(jax.tree.map(lambda v: v[i, j], q), h)
    _close(got, h)
    # gradients flow through the rematerialised loops
    grads = jax.grad(lambda v: model(nn).apply(v, x).sum())(vj_vars)
    assert jax.tree.map(jnp.shape, grads) == jax.tree.map(jnp.shape, vj_vars)
    assert float(jnp.abs(grads["params"]["stack"]["kernel"][0, 0]).sum()) > 0
