"""Lifted ``while_loop`` and ``fori_loop``: Linen's docstring example, carry and broadcast
variables, RNG splitting, and the errors for what a loop body may not do."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transform_checks import close as _close

import varjax as vj
import varjax.nn as nn
from varjax.errors import TransformError, VariableCreationError


def _while_loop_example(lib):
    """Linen's ``while_loop`` docstring example, verbatim but for ``nn`` -> ``lib``."""
    class WhileLoopExample(lib.Module):
        @lib.compact
        def __call__(self, x):
            def cond_fn(mdl, c):
                return mdl.variables['state']['acc'] < 10

            def body_fn(mdl, c):
                acc = mdl.variable('state', 'acc', lambda: jnp.array(0))
                acc.value += 1
                y = lib.Dense(c.shape[-1])(c)
                return y
            c = x
            if self.is_mutable_collection('params'):
                return body_fn(self, c)
            else:
                return lib.while_loop(cond_fn, body_fn, self, c,
                                      carry_variables='state')
    return WhileLoopExample()


def test_while_loop_docstring_example_matches_linen():
    k = jax.random.key(0)
    x = jnp.ones((2, 2))
    flax_vars = _while_loop_example(flax_nn).init(k, x)
    vj_vars = _while_loop_example(nn).init(k, x)
    assert jax.tree.map(jnp.shape, vj_vars) == jax.tree.map(jnp.shape, flax_vars)
    assert int(vj_vars['state']['acc']) == 1
    expected = _while_loop_example(flax_nn).apply(flax_vars, x, mutable=['state'])
    result, state = _while_loop_example(nn).apply(flax_vars, x, mutable=['state'])
    assert int(state['state']['acc']) == 10
    _close((result, state), expected)
    p, y = flax_vars['params']['Dense_0'], x            # 9 more iterations: acc 1 -> 10
    for _ in range(9):
        y = y @ p['kernel'] + p['bias'][None]
    _close(result, y)


F = 3


def _w_init(key, shape):
    return jax.random.normal(key, shape)


def test_while_loop_reads_broadcast_params_in_the_body():
    def body(c):
        i, h = c
        return i + 1, h * vj.param("w", _w_init, (F,)) + 1.0

    @vj.functionalize
    def run(x):
        vj.param("w", _w_init, (F,))                    # created before the loop
        return vj.while_loop(lambda c: c[0] < 3, body, None, (jnp.int32(0), x),
                             broadcast_variables="params")

    x = jnp.arange(F, dtype=jnp.float32)
    variables = run.init(jax.random.key(0), x)
    w = variables["params"]["w"]
    i, h = run.apply(variables, x)
    assert int(i) == 3
    expected = x
    for _ in range(3):
        expected = expected * w + 1.0
    _close(h, expected)


@pytest.mark.parametrize("stream", ["params", "dropout"])
@pytest.mark.parametrize("split", [True, False])
def test_while_loop_split_rngs_gives_a_fresh_key_per_iteration(stream, split):
    n = 4

    def body(c):
        i, buf = c
        return i + 1, buf.at[i].set(jax.random.uniform(vj.make_rng(stream), ()))

    @vj.functionalize
    def run(buf):
        return vj.while_loop(lambda c: c[0] < n, body, None, (jnp.int32(0), buf),
                             split_rngs={stream: split})[1]

    draws = run.apply({}, jnp.zeros((n,), jnp.float32), rngs={stream: jax.random.key(1)})
    assert len(set(np.asarray(draws).tolist())) == (n if split else 1)
    assert float(draws[0]) != 0.0


class _Counter(nn.Module):
    """``while_loop`` whose body advances ``state/n`` and sums ``x * n``."""
    carry: object = "state"
    broadcast: object = True

    @nn.compact
    def __call__(self, x):
        self.variable("state", "n", lambda: jnp.zeros((), jnp.int32))

        def cond_fn(mdl, c):
            return mdl.variable("state", "n", lambda: jnp.zeros((), jnp.int32)).value < 5

        def body_fn(mdl, c):
            total, x = c
            n = mdl.variable("state", "n", lambda: jnp.zeros((), jnp.int32))
            n.value += 1
            return total + x * n.value.astype(jnp.float32), x
        return nn.while_loop(cond_fn, body_fn, self, (jnp.zeros_like(x), x),
                             carry_variables=self.carry, broadcast_variables=self.broadcast)[0]


def test_while_loop_carry_variable_is_mutated_by_the_body():
    x = jnp.ones((F,), jnp.float32)
    variables = {"state": {"n": jnp.asarray(2, jnp.int32)}}
    out, updated = _Counter().apply(variables, x, mutable=["state"])
    assert int(updated["state"]["n"]) == 5
    _close(out, x * (3.0 + 4.0 + 5.0))


def test_while_loop_body_writing_a_broadcast_variable_raises():
    variables = {"state": {"n": jnp.asarray(2, jnp.int32)}}
    with pytest.raises(TransformError, match=r"body_fn writes variable n, which is a broadcast"):
        _Counter(carry=False).apply(variables, jnp.ones((F,), jnp.float32), mutable=["state"])


def test_while_loop_touching_an_unlisted_collection_raises_naming_it():
    variables = {"state": {"n": jnp.asarray(2, jnp.int32)}}
    with pytest.raises(TransformError) as info:
        _Counter(carry=False, broadcast="params").apply(variables, jnp.ones((F,), jnp.float32),
                                                        mutable=["state"])
    assert "collection: state" in str(info.value) and "carry_variables" in str(info.value)


def test_while_loop_reading_an_unlisted_collection_without_init_fn_raises_transform_error():
    def cond_fn(mdl, c):
        return mdl.variable("state", "n").value < 5

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.variable("state", "n", lambda: jnp.zeros((), jnp.int32))
            return nn.while_loop(cond_fn, lambda mdl, c: c + 1.0, self, x,
                                 broadcast_variables="params")

    with pytest.raises(TransformError, match="matches none of its variable filters"):
        M().apply({"state": {"n": jnp.asarray(2, jnp.int32)}}, jnp.ones((F,), jnp.float32))


def test_while_loop_cond_fn_writing_a_variable_raises():
    def cond_fn(mdl, c):
        n = mdl.variable("state", "n")
        n.value += 1
        return n.value < 3

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.variable("state", "n", lambda: jnp.zeros((), jnp.int32))
            return nn.while_loop(cond_fn, lambda mdl, c: c + 1.0, self, x,
                                 carry_variables="state")

    with pytest.raises(TransformError, match=r"cond_fn writes variable n, which is read-only"):
        M().init(jax.random.key(0), jnp.ones((F,), jnp.float32))


def test_while_loop_body_creating_a_variable_raises_with_the_fix():
    def body_fn(mdl, c):
        acc = mdl.variable("state", "acc", lambda: jnp.zeros((), jnp.int32))
        acc.value += 1
        return c

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.while_loop(lambda mdl, c: jnp.all(c < 10.0), body_fn, self, x,
                                 carry_variables="state")

    with pytest.raises(VariableCreationError) as info:
        M().init(jax.random.key(0), jnp.ones((F,), jnp.float32))
    message = str(info.value)
    assert "body_fn creates variable acc" in message
    assert "collection: state" in message
    assert "create it before the loop" in message


# -- fori_loop ---------------------------------------------------------------------------

def test_fori_loop_with_a_module_matches_a_python_loop():
    class Poly(nn.Module):
        def setup(self):
            self.dense = nn.Dense(F)
            self.calls = self.variable("state", "calls", lambda: jnp.zeros((), jnp.int32))

        def __call__(self, x):
            if self.is_initializing():
                self.dense(x)                            # create params before the loop

            def body_fn(mdl, i, c):
                mdl.calls.value += 1
                return jnp.tanh(mdl.dense(c)) * i.astype(jnp.float32)
            return nn.fori_loop(1, 4, body_fn, self, x, carry_variables="state")

    x = jnp.linspace(-1.0, 1.0, F, dtype=jnp.float32)[None]
    variables = Poly().init(jax.random.key(0), x)
    assert int(variables["state"]["calls"]) == 3
    out, updated = Poly().apply(variables, x, mutable=["state"])
    assert int(updated["state"]["calls"]) == 6
    p, h = variables["params"]["dense"], x
    for i in range(1, 4):
        h = jnp.tanh(h @ p["kernel"] + p["bias"][None]) * float(i)
    _close(out, h)


def test_fori_loop_over_a_plain_function_matches_a_python_loop():
    def body_fn(i, c):
        return c * vj.param("w", _w_init, (F,)) + i.astype(jnp.float32)

    @vj.functionalize
    def run(x, upper):
        vj.param("w", _w_init, (F,))
        return vj.fori_loop(0, upper, body_fn, None, x)

    x = jnp.ones((F,), jnp.float32)
    variables = run.init(jax.random.key(0), x, jnp.int32(4))
    w = variables["params"]["w"]
    out = run.apply(variables, x, jnp.int32(4))          # traced upper bound
    expected = x
    for i in range(4):
        expected = expected * w + float(i)
    _close(out, expected)
    _close(run.apply(variables, x, jnp.int32(0)), x)     # zero iterations


def test_while_loop_body_may_close_over_an_outer_array():
    @vj.functionalize
    def run(x):
        w = vj.param("w", _w_init, (F,))                # read outside, used inside the body
        return vj.fori_loop(0, 3, lambda i, c: c * w + x, None, x)

    x = jnp.ones((F,), jnp.float32)
    variables = run.init(jax.random.key(0), x)
    w = variables["params"]["w"]
    _close(run.apply(variables, x), ((x * w + x) * w + x) * w + x)
