"""``vj.Rngs`` as an object-mode argument: draws inside a transform advance the argument's
counts, and an Rngs can be carried and returned like any other object."""
import jax
import jax.numpy as jnp
import numpy as np

import varjax as vj

_TRACED_STREAM = ("inside a transform an Rngs's streams are _TracedStream objects, a subclass "
                  "of the registered RngStream pytree that is not registered itself, so "
                  "returning or carrying the Rngs fails with \"TypeError: object of type "
                  "'NoneType' has no len()\" in varjax/_jax.py trace_to_jaxpr")


def test_draw_inside_grad_is_written_back():
    w = vj.Variable(jnp.ones(2))
    rngs, eager = vj.Rngs(0), vj.Rngs(0)
    g = vj.grad(lambda w, r: jnp.sum(w.value * r.normal((2,))))(w, rngs)
    np.testing.assert_array_equal(g.value, eager.normal((2,)))
    assert int(rngs.default.count) == 1


def test_rngs_in_argnums_gets_float0_cotangents():
    g = vj.grad(lambda r: r.normal(()))(vj.Rngs(0))
    assert type(g) is vj.Rngs
    assert all(x.dtype == jax.dtypes.float0 for x in jax.tree.leaves(g))


def test_returning_an_rngs_argument_gives_a_new_rngs():
    rngs = vj.Rngs(0)
    out = vj.jit(lambda r: r)(rngs)
    assert type(out) is vj.Rngs and out is not rngs


def test_rngs_carried_through_scan_draws_a_new_key_each_step():
    rngs, eager = vj.Rngs(0), vj.Rngs(0)
    _, ys = vj.scan(lambda r, x: (r, r.normal(())))(rngs, jnp.arange(3.0))
    np.testing.assert_array_equal(ys, jnp.stack([eager.normal(()) for _ in range(3)]))
    assert int(rngs.default.count) == 3


def test_rngs_carried_through_fori_loop_is_advanced():
    rngs = vj.Rngs(0)

    def body(i, r):
        r.normal(())
        return r
    vj.fori_loop(0, 2, body, rngs)
    assert int(rngs.default.count) == 2
