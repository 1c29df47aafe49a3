"""A repeated ``nnx.jit`` call on the same modules keeps their graph (object mode's
``ArgumentGraphs``, with the structure watch ``varjax.nnx.transforms`` registers for NNX
objects and states): it does not walk them again, and every change made to them between
calls is seen, as a fresh call would see it.  Eager ``nnx.grad`` reuses its trace."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx as flax_nnx

from varjax import nnx
from varjax.nnx import Dict, List, Module, Param, Rngs, State, Variable
from varjax.nnx.graph import state
from varjax.nnx.linear import Linear
from varjax.nnx.transforms import grad, jit, value_and_grad
from varjax.objects.graph import Graph


class Bag(Module):
    """Whatever attributes a test gives it; called, the sum of its leaves."""

    def __init__(self):
        self.a = Param(jnp.ones(()))


def _total(m):
    return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(m))


def _bump(m):
    """Adds 1 to every Variable of ``m``; returns the sum of its leaves before."""
    total = _total(m)
    for v in jax.tree.leaves(m, is_leaf=lambda x: isinstance(x, Variable)):
        if isinstance(v, Variable):
            v[...] += 1
    return total


TOTAL = jit(_total)
BUMP = jit(_bump)


def _count_walks(monkeypatch):
    calls = []
    of = Graph.of.__func__

    def counted(cls, tree, **kwargs):
        calls.append(tree)
        return of(cls, tree, **kwargs)
    monkeypatch.setattr(Graph, "of", classmethod(counted))
    return calls


def test_repeated_jit_calls_on_the_same_modules_walk_them_once(monkeypatch):
    m = Bag()
    m.sub = Bag()
    walks = _count_walks(monkeypatch)
    for i in range(3):
        assert float(BUMP(m)) == 2.0 * (i + 1)
    assert len(walks) == 1
    assert float(m.a[...]) == 4.0 and float(m.sub.a[...]) == 4.0


def test_an_attribute_added_between_calls_is_seen(monkeypatch):
    m = Bag()
    assert float(TOTAL(m)) == 1.0
    walks = _count_walks(monkeypatch)
    m.b = Param(jnp.full((), 2.0))
    assert float(TOTAL(m)) == 3.0
    del m.b
    assert float(TOTAL(m)) == 1.0
    assert len(walks) == 1        # walked with b; without it, the first call's graph is kept


def test_a_variable_replaced_by_one_of_equal_value_gets_the_updates():
    m = Bag()
    BUMP(m)
    old = m.a
    m.a = Param(jnp.full((), 2.0))     # equal to old's value: only identity tells them apart
    BUMP(m)
    assert float(m.a[...]) == 3.0 and float(old[...]) == 2.0


def test_list_and_dict_elements_changed_between_calls_are_seen():
    m = Bag()
    m.items = List([Param(jnp.ones(()))])
    m.named = Dict(x=Param(jnp.ones(())))
    assert float(TOTAL(m)) == 3.0
    m.items.append(Param(jnp.ones(())))
    assert float(TOTAL(m)) == 4.0
    m.named["y"] = Param(jnp.ones(()))
    assert float(TOTAL(m)) == 5.0
    m.items[0] = Param(jnp.zeros(()))
    assert float(TOTAL(m)) == 4.0


def test_a_static_attribute_changed_between_calls_is_seen():
    m = Bag()
    m.scale = 1.0
    scaled = jit(lambda m: m.a[...] * m.scale)
    assert float(scaled(m)) == 1.0
    m.scale = 3.0
    assert float(scaled(m)) == 3.0


def test_a_state_argument_changed_between_calls_is_seen():
    m = Bag()
    s = state(m)
    assert isinstance(s, State)
    assert float(TOTAL(s)) == 1.0
    s["b"] = Param(jnp.full((), 2.0))
    assert float(TOTAL(s)) == 3.0


def test_graph_updates_of_a_kept_call_reach_the_caller_each_call():
    m = Bag()

    @jit
    def remember(m, x):
        m.last = x
        return m.a[...]
    for i in range(3):
        remember(m, jnp.full((), float(i)))
        assert float(m.last) == float(i)


def test_tree_mode_kept_calls_write_updates_back(monkeypatch):
    m = Bag()
    bump = jit(_bump, graph=False)
    walks = _count_walks(monkeypatch)
    for _ in range(3):
        bump(m)
    assert float(m.a[...]) == 4.0 and len(walks) == 1


def _train(lib, steps):
    model = lib.Linear(2, 3, rngs=lib.Rngs(0))
    optimizer = lib.Optimizer(model, optax.sgd(0.1), wrt=lib.Param)

    @lib.jit
    def step(model, optimizer, x):
        loss, grads = lib.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss
    x = jnp.arange(4.0).reshape(2, 2)
    losses = [float(step(model, optimizer, x)) for _ in range(steps)]
    return losses, model


def test_kept_train_steps_match_flax_nnx_step_by_step():
    ours, model = _train(nnx, 4)
    theirs, flax_model = _train(flax_nnx, 4)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    np.testing.assert_allclose(model.kernel[...], flax_model.kernel[...], rtol=1e-6)


def test_eager_grad_of_one_function_traces_it_once():
    m = Linear(2, 1, rngs=Rngs(0))
    traced = []

    def loss(m, x):
        traced.append(1)
        return jnp.sum(m(x))
    x = jnp.ones((1, 2))
    first = grad(loss)(m, x)
    for _ in range(2):
        again = grad(loss)(m, x)                # a new nnx.grad each time, as in a loop body
    assert len(traced) == 1
    np.testing.assert_array_equal(first["kernel"][...], again["kernel"][...])
    value_and_grad(loss)(m, x)
    assert len(traced) == 1                    # grad is value_and_grad: one trace for both


def _dropout_grads(lib):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 4, rngs=rngs)
            self.drop = lib.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))
    m = Model(lib.Rngs(0, dropout=1))
    x = jnp.ones((3, 2))
    grads = [lib.grad(lambda m: jnp.sum(m(x)))(m) for _ in range(3)]
    return m, grads


def test_dropout_stream_count_advances_under_eager_grad_as_flax_nnx():
    ours, ours_grads = _dropout_grads(nnx)
    theirs, their_grads = _dropout_grads(flax_nnx)
    assert int(ours.drop.rngs.count[...]) == int(theirs.drop.rngs.count[...]) == 3
    for g, fg in zip(ours_grads, their_grads):
        np.testing.assert_array_equal(g["lin"]["kernel"][...], fg["lin"]["kernel"][...])


def test_a_module_passed_as_a_static_argument_is_not_flattened():
    m = Linear(2, 2, rngs=Rngs(0))
    x = jnp.ones((1, 2))
    apply = jit(lambda m, x: m(x), static_argnums=0)
    for _ in range(2):
        np.testing.assert_array_equal(apply(m, x), m(x))


def test_an_array_attribute_is_read_anew_when_replaced_between_calls():
    m = Bag()
    m.arr = jnp.ones(2)                  # a data attribute that is not a Variable
    assert float(TOTAL(m)) == 3.0
    m.arr = jnp.full(2, 2.0)
    assert float(TOTAL(m)) == 5.0


@pytest.mark.parametrize("outer", ["jit", "vmap"])
def test_dropout_under_a_grad_nested_in_jit_or_vmap_draws_and_counts_as_flax_nnx(outer):
    """A grad inside jit/vmap splits a module whose stream is bound to the outer trace:
    the rebuilt stream is a plain one, and only its count is written back (fuzz finding:
    an AttributeError, then a refused key write)."""
    def run(lib):
        class Model(lib.Module):
            def __init__(self, rngs):
                self.drop = lib.Dropout(0.5, rngs=rngs)
                self.lin = lib.Linear(3, 3, rngs=rngs)

            def __call__(self, x):
                return self.lin(self.drop(x))
        m, x = Model(lib.Rngs(0)), jnp.ones((2, 3))

        def step(m, x):
            return lib.value_and_grad(lambda m: jnp.sum(m(x)))(m)[0]
        f = lib.jit(step) if outer == "jit" else lib.vmap(step, in_axes=(None, 0))
        return f(m, x), m.drop.rngs.count[...]
    (ours, our_count), (theirs, their_count) = run(nnx), run(flax_nnx)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert int(our_count) == int(their_count)
