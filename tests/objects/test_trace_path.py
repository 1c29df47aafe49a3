"""One object-mode call finds its argument objects once: the graph built outside the JAX
transform, on the caller's objects, keys the pure function the transform traces, which
takes JAX's copies apart by its layout (``Graph.copies``), and a copied bound module's
cells come from its treedef, not from a walk of the nested dict JAX's unflatten builds."""
import jax
import jax.numpy as jnp
import numpy as np
from object_models import MLP, X, bound

import varjax as vj
from varjax.nn.module import as_node
from varjax.objects.graph import Graph


def _count_graphs(monkeypatch):
    calls = []
    of = Graph.of.__func__

    def counted(cls, tree, **kwargs):
        calls.append(tree)
        return of(cls, tree, **kwargs)
    monkeypatch.setattr(Graph, "of", classmethod(counted))
    return calls


def test_a_traced_jit_call_builds_the_argument_graph_once(monkeypatch):
    model, _ = bound(MLP(), mutable="batch_stats")
    calls = _count_graphs(monkeypatch)
    out = vj.jit(lambda m, x: m(x))(model, X)
    assert len(calls) == 1
    assert out.shape == (2, 2)


def test_a_nested_call_builds_its_graph_once_in_the_enclosing_trace(monkeypatch):
    model, _ = bound(MLP(), mutable="batch_stats")
    calls = _count_graphs(monkeypatch)
    g = vj.jit(lambda m, x: vj.grad(lambda m, x: jnp.sum(m(x)))(m, x))(model, X)
    assert len(calls) == 2         # the jit's, and the grad's inside its trace
    want = vj.grad(lambda m, x: jnp.sum(m(x)))(model, X)
    assert jax.tree.all(jax.tree.map(np.allclose, g, want))


def test_a_grad_call_builds_the_argument_graph_once_and_a_repeated_one_never(monkeypatch):
    model, _ = bound(MLP(), mutable="batch_stats")
    calls = _count_graphs(monkeypatch)
    grad = vj.grad(lambda m, x: jnp.sum(m(x)))
    first = grad(model, X)
    assert len(calls) == 1
    second = grad(model, X)       # the graph is kept: none is built
    assert len(calls) == 1
    assert type(first) is type(model)
    assert jax.tree.structure(first) == jax.tree.structure(second)


def test_a_copied_module_is_not_walked_for_its_variables(monkeypatch):
    """The caller's model has its cells already (flattened once); the copy JAX makes inside
    the call gets them from the treedef, so no nested dict is walked."""
    model, _ = bound(MLP(), mutable="batch_stats")
    jax.tree.leaves(model)
    walks = []
    entries = as_node.variable_entries

    def counted(variables):
        walks.append(variables)
        return entries(variables)
    monkeypatch.setattr(as_node, "variable_entries", counted)
    vj.jit(lambda m, x: m(x))(model, X)
    assert walks == []


def test_a_copy_holding_a_dict_where_a_value_was_is_walked():
    """A tree map may put a dict where a variable's value was: the copy's variables are
    then found by a walk, as for any module bound to such a dict."""
    model, _ = bound(MLP())
    mapped = jax.tree.map(lambda a: {"w": a}, model)
    keys = [c.collection + ":" + "/".join(c.path) for c in as_node.variable_cells(mapped)]
    assert keys[0].endswith("/w")
    np.testing.assert_array_equal(
        jax.tree.leaves(mapped)[0], jax.tree.leaves(model)[0])


def test_a_list_of_variables_keeps_its_graph_until_the_list_changes(monkeypatch):
    vs = [vj.Variable(jnp.ones(())), vj.Variable(jnp.ones(()))]
    total = vj.jit(lambda vs: sum(v.value for v in vs))
    calls = _count_graphs(monkeypatch)
    assert float(total(vs)) == 2.0 and float(total(vs)) == 2.0
    assert len(calls) == 1
    vs.append(vj.Variable(jnp.ones(())))
    assert float(total(vs)) == 3.0
    vs[0] = vj.Variable(jnp.zeros(()))
    assert float(total(vs)) == 2.0
    assert len(calls) == 3


@jax.tree_util.register_pytree_node_class
class _Holder:
    """A user's pytree class: object mode cannot tell when its contents change."""

    def __init__(self, v):
        self.v = v

    def tree_flatten(self):
        return (self.v,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def test_an_argument_of_a_users_pytree_class_is_walked_on_every_call(monkeypatch):
    h = _Holder(vj.Variable(jnp.ones(())))
    read = vj.jit(lambda h: h.v.value)
    calls = _count_graphs(monkeypatch)
    read(h)
    h.v = vj.Variable(jnp.full((), 2.0))
    assert float(read(h)) == 2.0
    assert len(calls) == 2
