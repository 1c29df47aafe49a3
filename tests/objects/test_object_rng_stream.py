"""A bare ``vj.RngStream`` as an object-mode node (``varjax/objects/nodes.py``,
``RngStreamKind``): its key and count are state of collection ``rngs``, so draws inside a
transform advance the caller's stream, as draws from an ``Rngs``'s stream do.  Each test
compares the draws with the same draws made eagerly from a twin stream."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from varjax import errors


def twins(seed=0):
    return vj.RngStream(seed, tag="dropout"), vj.RngStream(seed, tag="dropout")


def test_draws_inside_jit_advance_the_stream_each_call():
    stream, eager = twins()
    draw = vj.jit(lambda s: s.normal(()))
    for calls in (1, 2):
        np.testing.assert_array_equal(draw(stream), eager.normal(()))
        assert int(stream.count) == calls


def test_scan_carrying_a_stream_draws_a_new_key_each_step():
    stream, eager = twins()
    _, ys = vj.scan(lambda s, x: (s, s.normal(())))(stream, jnp.arange(3.0))
    np.testing.assert_array_equal(ys, jnp.stack([eager.normal(()) for _ in range(3)]))
    assert int(stream.count) == 3


def test_cond_branch_drawing_advances_the_stream():
    stream, eager = twins()
    out = vj.cond(True, lambda s: s.normal(()), lambda s: jnp.zeros(()), stream)
    np.testing.assert_array_equal(out, eager.normal(()))
    assert int(stream.count) == 1


def test_vmap_over_a_split_stream_advances_each_member():
    keys = jax.random.split(jax.random.key(0), 3)
    stream = vj.RngStream(keys, tag="dropout")
    out = vj.vmap(lambda s: s.normal(()))(stream)
    want = [jax.random.normal(jax.random.fold_in(k, 0), ()) for k in keys]
    np.testing.assert_array_equal(out, jnp.stack(want))
    np.testing.assert_array_equal(stream.count, [1, 1, 1])


def test_state_of_a_stream_is_its_key_and_count_in_rngs():
    stream, _ = twins()
    stream()
    state = vj.state(stream)
    assert set(state) == {"rngs"} and set(state["rngs"]) == {"key", "count"}
    assert int(state["rngs"]["count"]) == 1


def test_stream_of_an_rngs_passed_to_a_nested_jit_advances_the_outer_rngs():
    rngs, eager = vj.Rngs(0), vj.Rngs(0)
    out = vj.jit(lambda r: vj.jit(lambda s: s.normal(()))(r.default))(rngs)
    np.testing.assert_array_equal(out, eager.normal(()))
    assert int(rngs.default.count) == 1


def test_a_stream_held_in_a_pytree_is_a_node_there():
    stream, eager = twins()
    holder = {"noise": stream, "scale": jnp.float32(2.0)}
    out = vj.jit(lambda h: h["scale"] * h["noise"].normal(()))(holder)
    np.testing.assert_array_equal(out, 2.0 * eager.normal(()))
    assert int(stream.count) == 1


def test_replacing_the_key_of_a_stream_inside_jit_is_refused():
    stream, _ = twins()
    with pytest.raises(errors.TransformError, match="RNG stream 'dropout' cannot be replaced"):
        vj.jit(lambda s: s._varjax_replace(jax.random.key(1)))(stream)
