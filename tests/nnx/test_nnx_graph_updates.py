"""NNX's graph updates, ``graph=``/``graph_updates=`` and tree mode in the varjax.nnx transforms,
against flax.nnx 0.12.8: a structural change inside (a ``sow``, a new or removed attribute)
reaches the caller's module, an argument's object returned is the caller's own; without graph
updates only Variable values come back, and what flax.nnx would lose silently is an error;
tree mode refuses shared Variables and ``grad`` returns the argument's type.  The Tree Mode
design note's transform examples run as written."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.batching import vmap
from varjax.nnx.control import cond, fori_loop, switch
from varjax.nnx.transforms import grad, jit, remat, value_and_grad

X = jnp.arange(4.0).reshape(2, 2) / 3


def _model(lib, seed=0):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 3, rngs=rngs)
            self.count = lib.BatchStat(jnp.zeros(()))

        def __call__(self, x):
            self.count[...] += 1
            y = self.lin(x)
            self.sow(lib.Intermediate, "y_mean", jnp.mean(y))
            return y
    return Model(lib.Rngs(seed))


def _pure(lib, state):
    return jax.tree.map(np.asarray, lib.to_pure_dict(state))


def _same(ours, theirs):
    a, b = _pure(nnx, ours), _pure(flax_nnx, theirs)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6)


class Wrapper(nnx.Module):
    def __init__(self, inner):
        self.inner = inner


# --- graph updates (the default) ----------------------------------------------------------

@pytest.fixture(scope="module")
def jitted():
    """One nnx.jit of a forward that sows, shared by the tests (two calls: two traces)."""
    return jit(lambda m, x: m(x)), flax_nnx.jit(lambda m, x: m(x))


def test_jit_sow_then_pop_outside_gives_flax_intermediates(jitted):
    ours, theirs = _model(nnx), _model(flax_nnx)
    f, g = jitted
    for _ in range(2):     # the second call appends to the Intermediate made by the first
        np.testing.assert_allclose(f(ours, X), g(theirs, X), rtol=1e-6)
    _same(nnx.pop(ours, nnx.Intermediate), flax_nnx.pop(theirs, flax_nnx.Intermediate))
    _same(nnx.state(ours), flax_nnx.state(theirs))
    assert not hasattr(ours, "y_mean")


def test_jit_returning_an_argument_object_gives_the_callers_object():
    ours = _model(nnx)
    m, lin, kernel, x = jit(lambda m, x: (m, m.lin, m.lin.kernel, x))(ours, X)
    assert m is ours and lin is ours.lin and kernel is ours.lin.kernel
    assert flax_nnx.jit(lambda m: m)(theirs := _model(flax_nnx)) is theirs


def test_jit_new_removed_and_changed_attributes_reach_the_caller():
    def change(lib):
        def f(m):
            m.new = lib.Param(jnp.ones(2))
            m.arr = m.arr + 1      # a new array attribute leaks a tracer in flax.nnx 0.12.8
            m.sub = lib.Linear(1, 2, rngs=lib.Rngs(1))
            m.alias = m.lin
            m.flag = "on"
            del m.count
        return f
    ours, theirs = _model(nnx), _model(flax_nnx)
    ours.arr, theirs.arr = jnp.zeros(3), jnp.zeros(3)
    jit(change(nnx))(ours)
    flax_nnx.jit(change(flax_nnx))(theirs)
    assert ours.alias is ours.lin and theirs.alias is theirs.lin
    assert ours.flag == theirs.flag == "on"
    assert not hasattr(ours, "count") and not hasattr(theirs, "count")
    assert type(ours.new) is nnx.Param and type(ours.sub) is nnx.Linear
    np.testing.assert_array_equal(ours.arr, theirs.arr)
    _same(nnx.state(ours), flax_nnx.state(theirs))
    jit(lambda m: setattr(m, "fresh", jnp.arange(2.0)))(ours)
    np.testing.assert_array_equal(ours.fresh, [0.0, 1.0])


def test_jit_appending_to_a_list_of_layers_reaches_the_caller_as_flax():
    def run(lib, **options):
        class Stack(lib.Module):
            def __init__(self):
                self.layers = lib.List([lib.Linear(1, 1, rngs=lib.Rngs(0))])
        stack = Stack()
        lib.jit(lambda s: s.layers.append(lib.Linear(1, 2, rngs=lib.Rngs(1))), **options)(stack)
        return stack
    ours, theirs = run(nnx), run(flax_nnx)
    assert len(ours.layers) == len(theirs.layers) == 2
    _same(nnx.state(ours), flax_nnx.state(theirs))
    with pytest.raises(errors.TransformError, match="element 1 of List args/0/layers was added"):
        run(nnx, graph_updates=False)


def test_jit_new_module_holding_an_argument_holds_the_callers_module():
    ours = _model(nnx)
    wrapped = jit(lambda m: Wrapper(m))(ours)
    assert type(wrapped) is Wrapper and wrapped.inner is ours


def test_jit_traces_once_when_the_structure_does_not_change():
    traced = []

    def step(m, x):
        traced.append(1)
        m.count[...] += 1
        return m.lin(x)
    ours, f = _model(nnx), jit(step)
    for _ in range(3):
        f(ours, X)
    assert len(traced) == 1 and float(ours.count[...]) == 3.0


def test_remat_sow_and_returned_argument_as_flax():
    ours, theirs = _model(nnx), _model(flax_nnx)
    out, m = remat(lambda m, x: (m(x), m))(ours, X)
    fout, fm = flax_nnx.remat(lambda m, x: (m(x), m))(theirs, X)
    assert m is ours and fm is theirs
    np.testing.assert_allclose(out, fout, rtol=1e-6)
    _same(nnx.state(ours), flax_nnx.state(theirs))


def test_grad_sow_and_aux_returning_the_module_as_flax():
    ours, theirs = _model(nnx), _model(flax_nnx)

    def loss(m, x):
        return jnp.sum(m(x) ** 2), m
    g, aux = grad(loss, has_aux=True)(ours, X)
    fg, faux = flax_nnx.grad(loss, has_aux=True)(theirs, X)
    assert aux is ours and faux is theirs and isinstance(g, nnx.State)
    _same(g, fg)
    _same(nnx.pop(ours, nnx.Intermediate), flax_nnx.pop(theirs, flax_nnx.Intermediate))


def test_cond_and_switch_sow_and_return_the_callers_module_as_flax():
    ours, theirs = _model(nnx), _model(flax_nnx)
    out, m = cond(False, lambda m: (m(X), m), lambda m: (m(X) * 2, m), ours)
    fout, fm = flax_nnx.cond(False, lambda m: (m(X), m), lambda m: (m(X) * 2, m), theirs)
    assert m is ours and fm is theirs
    np.testing.assert_allclose(out, fout, rtol=1e-6)
    assert switch(1, [lambda m: m.lin, lambda m: m.lin], ours) is ours.lin
    _same(nnx.state(ours), flax_nnx.state(theirs))


def test_cond_branches_changing_the_structure_differently_raise_typeerror_as_flax():
    def sows(m):
        return m(X)
    with pytest.raises(TypeError, match="same pytree structure"):
        flax_nnx.cond(True, sows, lambda m: m.lin(X), _model(flax_nnx))
    ours = _model(nnx)
    with pytest.raises(TypeError, match="same pytree structure"):
        cond(True, sows, lambda m: m.lin(X), ours)
    assert not hasattr(ours, "y_mean")


def test_vmap_sow_on_a_stacked_module_and_returned_arguments_as_flax():
    def make(lib):
        return lambda rngs: _model(lib).__class__(rngs)
    ens = vmap(make(nnx))(nnx.Rngs(0).fork(split=2))
    with pytest.warns(DeprecationWarning):
        fens = flax_nnx.vmap(make(flax_nnx))(flax_nnx.Rngs(0).fork(split=2))
    y, m = vmap(lambda m, x: (m(x), m), in_axes=(0, None))(ens, X)
    fy, fm = flax_nnx.vmap(lambda m, x: (m(x), m), in_axes=(0, None))(fens, X)
    assert m is ens and fm is fens
    np.testing.assert_allclose(y, fy, rtol=1e-6)
    _same(nnx.state(ens), flax_nnx.state(fens))
    assert vmap(lambda m, x: m, in_axes=(None, 0), out_axes=None)(ens, X) is ens


def test_a_structural_change_in_a_loop_body_is_refused_as_flax_refuses_it():
    def body(i, m):
        m(X)
        return m
    with pytest.raises(TypeError):
        flax_nnx.fori_loop(0, 2, body, _model(flax_nnx))
    ours = _model(nnx)
    with pytest.raises(errors.TransformError, match="same structure from step to step"):
        fori_loop(0, 2, body, ours)
    assert not hasattr(ours, "y_mean")


# --- graph_updates=False ------------------------------------------------------------------

def test_without_graph_updates_a_sow_flax_would_lose_is_an_error_naming_it():
    theirs = _model(flax_nnx)
    flax_nnx.jit(lambda m, x: m(x), graph_updates=False)(theirs, X)
    assert not flax_nnx.pop(theirs, flax_nnx.Intermediate)      # lost silently in flax.nnx
    ours = _model(nnx)
    with pytest.raises(errors.TransformError, match="attribute 'y_mean' of Model args/0 "
                                                    "was added") as e:
        jit(lambda m, x: m(x), graph_updates=False)(ours, X)
    assert e.value.path == ("args", "0", "y_mean")
    assert not hasattr(ours, "y_mean") and float(ours.count[...]) == 0.0
    with nnx.set_graph_updates(False):
        with pytest.raises(errors.TransformError, match="'y_mean'"):
            cond(True, lambda m: m(X), lambda m: m(X), ours)
    with pytest.raises(errors.TransformError, match="attribute 'lin' of Model args/0 was "
                                                    "removed"):
        vmap(lambda m: m.__delattr__("lin"), in_axes=None, axis_size=2,
             graph_updates=False)(ours)


def test_without_graph_updates_variable_values_come_back_as_flax():
    def step(m, x):
        m.count[...] += 1
        return m.lin(x)
    ours, theirs = _model(nnx), _model(flax_nnx)
    for lib, model in ((nnx, ours), (flax_nnx, theirs)):
        lib.jit(step, graph_updates=False)(model, X)
        lib.jit(step, graph=False)(model, X)
    assert float(ours.count[...]) == float(theirs.count[...]) == 2.0


def test_without_graph_updates_returning_an_argument_is_a_valueerror_as_flax():
    with pytest.raises(ValueError, match="Variable aliasing"):
        flax_nnx.jit(lambda m: m, graph_updates=False)(_model(flax_nnx))
    ours = _model(nnx)
    with pytest.raises(errors.InconsistentAliasError, match="returned at output"):
        jit(lambda m: m, graph_updates=False)(ours)
    with pytest.raises(ValueError, match="inner"):
        jit(lambda m: Wrapper(m), graph=False)(ours)


def test_without_graph_updates_grad_differentiates_the_whole_argument_as_flax():
    ours, theirs = _model(nnx), _model(flax_nnx)

    def loss(m, x):
        return jnp.sum(m.lin(x) * m.count)
    g = grad(loss, graph_updates=False)(ours, X)
    fg = flax_nnx.grad(loss, graph_updates=False)(theirs, X)
    assert type(g) is type(ours) and type(g.count) is nnx.BatchStat
    _same(nnx.state(g), flax_nnx.state(fg))
    (v, aux), g2 = value_and_grad(lambda m, x: (loss(m, x), x.shape), has_aux=True,
                                  graph=False)(ours, X)
    assert aux == X.shape and type(g2) is type(ours)
    with pytest.raises(ValueError, match="cannot contain `DiffState`"):
        flax_nnx.grad(loss, argnums=flax_nnx.DiffState(0, flax_nnx.Param), graph=False)
    with pytest.raises(ValueError, match="cannot contain `DiffState`"):
        grad(loss, argnums=nnx.DiffState(0, nnx.Param), graph_updates=False)


def test_without_graph_updates_a_loop_returns_new_objects_holding_the_callers_variables():
    def body(i, m):
        m.count[...] += 1
        return m
    ours, theirs = _model(nnx), _model(flax_nnx)
    out = fori_loop(0, 3, body, ours, graph_updates=False)
    fout = flax_nnx.fori_loop(0, 3, body, theirs, graph_updates=False)
    assert (out is ours) == (fout is theirs) == False      # noqa: E712
    assert out.count is ours.count and fout.count is theirs.count
    assert float(ours.count[...]) == float(theirs.count[...]) == 3.0
    assert fori_loop(0, 1, body, ours) is ours


# --- tree mode (graph=False) --------------------------------------------------------------

def test_tree_mode_refuses_shared_variables_naming_both_paths_as_flax():
    theirs = _model(flax_nnx)
    with pytest.raises(ValueError, match="Variable aliasing"):
        flax_nnx.jit(lambda a, b: a.lin(X), graph=False)(theirs, theirs)
    ours = _model(nnx)
    with pytest.raises(errors.InconsistentAliasError,
                       match="reached at args/0/count and at args/1/count"):
        jit(lambda a, b: a.lin(X), graph=False)(ours, ours)
    ours.other = ours.lin
    with nnx.set_graph_mode(False):
        with pytest.raises(ValueError, match="args/0/lin/bias and at args/0/other/bias"):
            vmap(lambda m: m.lin(X), in_axes=None, out_axes=None, axis_size=2)(ours)
    np.testing.assert_allclose(jit(lambda m: m.other(X))(ours), ours.lin(X), rtol=1e-6)


def test_design_note_grad_examples():
    """The Tree Mode note's "nnx.grad": the old code (a State of Params), the new code
    (split/merge, a State of the params), and a module's gradient of its own type; each
    against flax.nnx's run of it."""
    def run(lib, g):
        model = _model(lib)

        def loss_fn(model):
            return jnp.mean(model.lin(X) ** 2)
        old = g(loss_fn)(model)     # argnums=nnx.DiffState(0, nnx.Param)
        graphdef, params, nondiff = lib.split(model, lib.Param, ...)

        def loss_split(params, nondiff):
            model = lib.merge(graphdef, params, nondiff)
            return jnp.mean(model.lin(X) ** 2)
        new = g(loss_split, graph=False)(params, nondiff)
        whole = g(loss_fn, graph=False)(model)
        return model, old, new, whole
    model, old, new, whole = run(nnx, grad)
    fmodel, fold, fnew, fwhole = run(flax_nnx, flax_nnx.grad)
    assert isinstance(old, nnx.State) and isinstance(new, nnx.State)
    assert type(whole) is type(model) and type(fwhole) is type(fmodel)
    _same(old, fold)
    _same(new, fnew)
    _same(nnx.state(whole), flax_nnx.state(fwhole))


def test_design_note_prefix_filter_rewrite_with_split_and_merge_under_vmap():
    """The note's "Prefix filters" rewrite: split the model into a vectorized and a broadcast
    state, vmap with in_axes=(0, None), merge inside; against flax.nnx's run of it."""
    def run(lib, vm):
        model = lib.vmap(lambda rngs: lib.Linear(2, 3, rngs=rngs))(lib.Rngs(0).fork(split=2))
        model.scale = lib.BatchStat(jnp.full((), 2.0))
        graphdef, vectorized, broadcasted = lib.split(model, lib.Param, ...)

        @vm(in_axes=(0, None), graph=False)
        def f(vectorized, broadcasted):
            m = lib.merge(graphdef, vectorized, broadcasted)
            return m(X) * m.scale[...]
        return f(vectorized, broadcasted)
    with pytest.warns(DeprecationWarning):
        want = run(flax_nnx, flax_nnx.vmap)
    np.testing.assert_allclose(run(nnx, vmap), want, rtol=1e-6)
