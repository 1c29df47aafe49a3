"""Repeated object-mode calls reuse the argument graph of an earlier call on the same objects
(``varjax.objects.graph.ArgumentGraphs``): each behaviour below is what a fresh call would
do, checked after the objects changed in every way a kept graph must notice."""
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from object_models import X, bound

import varjax as vj
import varjax.nn as nn
from varjax.objects.graph import ArgumentGraphs


class Growing(nn.Module):
    """``__call__`` uses a kernel; ``grow`` creates one more variable, ``extra``."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(2, name="dense")(x)

    @nn.compact
    def grow(self, x):
        self.variable("params", "extra", jnp.ones, (2,))
        return self(x)


def _sgd(model, x):
    grads = vj.grad(lambda m, x: jnp.sum(m(x) ** 2))(model, x)
    vj.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, vj.state(model, "params"),
                                  vj.state(grads, "params")))


def test_repeated_steps_match_the_same_steps_without_jit():
    model, variables = bound(Growing(), mutable="params")
    plain, _ = bound(Growing(), mutable="params")
    step = vj.jit(_sgd)
    for _ in range(3):
        step(model, X)
        _sgd(plain, X)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 vj.state(model), vj.state(plain))


def test_a_variable_created_between_calls_is_seen_by_the_next_call():
    model, _ = bound(Growing(), mutable="params")
    step = vj.jit(lambda m, x: m(x).sum() + m.variables["params"].get("extra", jnp.zeros(2)).sum())
    before = step(model, X)
    model.grow(X)                      # an eager call adds params/extra (the layout moves on)
    after = step(model, X)
    np.testing.assert_allclose(after, before + 2.0, rtol=1e-6)


def test_alternating_objects_are_each_updated():
    counters = [vj.Variable(jnp.zeros(())) for _ in range(6)]   # more than are kept

    @vj.jit
    def inc(v, by):
        v.value = v.value + by
    for _ in range(2):
        for i, v in enumerate(counters):
            inc(v, float(i))
    np.testing.assert_array_equal([float(v.value) for v in counters], [0, 2, 4, 6, 8, 10])


def test_a_new_value_structure_for_a_variable_is_traced_again():
    v = vj.Variable({"a": jnp.ones(2)})

    @vj.jit
    def total(v):
        return sum(jnp.sum(x) for x in jax.tree.leaves(v.value))
    assert float(total(v)) == 2.0
    v.value = {"a": jnp.ones(2), "b": jnp.ones(3)}
    assert float(total(v)) == 5.0


def test_an_object_in_a_container_and_one_passed_twice_take_the_walking_path():
    v = vj.Variable(jnp.ones(()))

    @vj.jit
    def add(a, b):
        a.value = a.value + b.value
    add(v, v)                                     # one object at two places
    assert float(v.value) == 2.0
    listed = vj.jit(lambda vs: [setattr(w, "value", w.value * 3) for w in vs] and None)
    listed([v])
    assert float(v.value) == 6.0


def test_rng_draws_advance_across_calls():
    rngs = vj.Rngs(0)
    draw = vj.jit(lambda r: r.normal(()))
    got = [draw(rngs) for _ in range(3)]
    fresh = vj.Rngs(0)
    np.testing.assert_array_equal(got, [fresh.normal(()) for _ in range(3)])


def test_kept_graphs_hold_only_the_last_few_objects():
    step = vj.jit(lambda m, x: m(x))
    refs = []
    for _ in range(3 * ArgumentGraphs.SIZE):
        model, _ = bound(Growing(), mutable="params")
        step(model, X)
        refs.append(weakref.ref(model))
        del model
    gc.collect()
    assert 0 < sum(r() is not None for r in refs) <= ArgumentGraphs.SIZE
