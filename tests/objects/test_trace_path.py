"""One object-mode call finds its argument objects once: the graph built outside the JAX
transform, on the caller's objects, keys the pure function the transform traces, which
takes JAX's copies apart by its layout (``Graph.copies``), and a copied bound module's
cells come from its treedef, not from a walk of the nested dict JAX's unflatten builds."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from object_models import MLP, X, assert_tree_close, bound

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


def _count_dict_walks(monkeypatch):
    walks = []
    entries = as_node.variable_entries

    def counted(variables):
        walks.append(variables)
        return entries(variables)
    monkeypatch.setattr(as_node, "variable_entries", counted)
    return walks


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
    walks = _count_dict_walks(monkeypatch)
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


# --- control flow: the caller walks the operands once; branches and loop bodies take
# JAX's copies apart by its graph's layout, renamed for each body's argument names ---------

def _apply(m, x):
    return m(x)


def _negated(m, x):
    return -m(x)


def _models(calls: int):
    """A bound MLP (its cells found once, as a caller's model has them) and the output and
    batch statistics of ``calls`` eager calls of another, to compare with."""
    model, _ = bound(MLP(), mutable="batch_stats")
    jax.tree.leaves(model)
    eager, _ = bound(MLP(), mutable="batch_stats")
    out = [eager(X) for _ in range(calls)][-1]
    return model, out, eager.variables["batch_stats"]


@pytest.mark.parametrize("transform", ["cond", "switch"])
def test_a_branch_does_not_walk_its_operands_again(monkeypatch, transform):
    model, want, stats = _models(1)
    calls, walks = _count_graphs(monkeypatch), _count_dict_walks(monkeypatch)
    if transform == "cond":
        out = vj.cond(jnp.array(True), _apply, _negated, model, X)
    else:
        out = vj.switch(jnp.array(2), [_negated, _negated, _apply], model, X)
    assert len(calls) == 1 and walks == []      # the caller's graph, none per branch
    assert_tree_close(out, want)
    assert_tree_close(model.variables["batch_stats"], stats)


def test_a_scan_body_does_not_walk_its_carry_or_its_slice(monkeypatch):
    model, want, stats = _models(3)
    calls, walks = _count_graphs(monkeypatch), _count_dict_walks(monkeypatch)
    _, ys = vj.scan(lambda m, x: (m, m(x)))(model, jnp.stack([X] * 3))
    assert len(calls) == 2 and walks == []      # the carry's graph and the xs's, once each
    assert_tree_close(ys[-1], want)
    assert_tree_close(model.variables["batch_stats"], stats)


def _twice(carry):
    m, n = carry
    m(X)
    return m, n + 1


@pytest.mark.parametrize("loop", ["while_loop", "fori_loop"])
def test_a_loop_body_and_condition_do_not_walk_the_carry_again(monkeypatch, loop):
    model, _, stats = _models(2)
    calls, walks = _count_graphs(monkeypatch), _count_dict_walks(monkeypatch)
    if loop == "while_loop":
        vj.while_loop(lambda carry: carry[1] < 2, _twice, (model, 0))
    else:
        vj.fori_loop(0, 2, lambda i, carry: _twice(carry), (model, 0))
    assert len(calls) == 1 and walks == []
    assert_tree_close(model.variables["batch_stats"], stats)


def test_each_branch_names_the_operands_by_its_own_argument_names():
    """One layout of the operands, renamed per branch: an error names the variable as the
    branch that wrote it calls its argument."""
    count = vj.Variable(jnp.array(0), collection="counts")

    def keep(old):
        return jnp.zeros(())

    def to_float(new):
        new.value = new.value.astype(jnp.float32)
        return jnp.zeros(())
    with pytest.raises(vj.errors.VariableStructureError,
                       match=r"variable new of collection 'counts'"):
        vj.cond(True, to_float, keep, count)


def test_an_object_given_twice_in_xs_is_one_object_in_the_scan_body():
    """The slices are taken apart by the layout of ``xs``, which has the object once: a
    write through one place is read through the other, as in a Python loop."""
    v = vj.Variable(jnp.arange(3.0), collection="s")

    def body(c, xs):
        a, b = xs
        a.value = a.value * 2.0
        return c, b.value
    _, ys = vj.scan(body)(jnp.zeros(()), (v, v))
    np.testing.assert_array_equal(ys, [0.0, 2.0, 4.0])
    np.testing.assert_array_equal(v.value, [0.0, 2.0, 4.0])
