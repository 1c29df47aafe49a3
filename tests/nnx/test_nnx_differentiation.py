"""``nnx.jvp``, ``nnx.vjp`` and ``nnx.custom_vjp`` (``varjax/nnx/differentiation.py``) against
flax.nnx 0.12.8: outputs, gradients and the updates written back to the caller's modules,
bit for bit.  ``custom_vjp`` in both of flax.nnx's forms (the Tree Mode note's two
examples), nondiff arguments, updates inside (a BatchNorm's statistics under ``grad``) and
their cotangents; what is not built is refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.config import set_graph_updates
from varjax.nnx.differentiation import custom_vjp, jvp, vjp
from varjax.nnx.transforms import DiffState, grad, jit

X = jnp.arange(4.0).reshape(2, 2) / 7


def _same_state(ours, theirs):
    a, b = nnx.to_pure_dict(nnx.state(ours)), flax_nnx.to_pure_dict(flax_nnx.state(theirs))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(x, y)


def _assert_same_tree(a, b):
    assert type(a).__name__ == type(b).__name__
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert u.dtype == v.dtype
        if u.dtype != jax.dtypes.float0:
            np.testing.assert_array_equal(u, v)


def _same_grads(ours, theirs):
    """Two ``nnx.grad`` results (States, or modules without graph updates), bitwise."""
    pure = [lib.to_pure_dict(lib.state(g) if isinstance(g, lib.Module) else g)
            for lib, g in ((nnx, ours), (flax_nnx, theirs))]
    _assert_same_tree(*pure)


# --- jvp / vjp -----------------------------------------------------------------------------

def _counted(lib):
    class Counted(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 3, rngs=rngs)
            self.count = lib.BatchStat(jnp.array(0))

        def __call__(self, x):
            self.count[...] += 1
            return self.lin(x)
    return Counted(lib.Rngs(0))


def _loss(m, x):
    y = m(x)
    return jnp.sum(y ** 2), y.mean()


def test_vjp_cotangent_of_a_module_is_a_module_and_updates_are_written_back():
    ours, theirs = _counted(nnx), _counted(flax_nnx)
    out, fn, aux = vjp(_loss, ours, X, has_aux=True, graph_updates=False)
    fout, ffn, faux = flax_nnx.vjp(_loss, theirs, X, has_aux=True, graph_updates=False)
    np.testing.assert_array_equal(out, fout)
    np.testing.assert_array_equal(aux, faux)
    _assert_same_tree(fn(jnp.ones(())), ffn(jnp.ones(())))
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 1
    out2, fn2 = vjp(graph_updates=False)(lambda m, x: _loss(m, x)[0])(ours, X)
    np.testing.assert_array_equal(out2, out)
    assert int(ours.count[...]) == 2


def test_jvp_tangent_of_a_module_is_a_module_and_updates_are_written_back():
    ours, theirs = _counted(nnx), _counted(flax_nnx)

    def tangent(m):
        return jax.tree.map(lambda a: jnp.ones_like(a) if a.dtype.kind == "f"
                            else np.zeros(a.shape, jax.dtypes.float0), m)
    out = jvp(_loss, (ours, X), (tangent(ours), X), has_aux=True, graph_updates=False)
    fout = flax_nnx.jvp(_loss, (theirs, X), (tangent(theirs), X), has_aux=True,
                        graph_updates=False)
    for u, v in zip(out, fout, strict=True):    # one trace, compiled: within an ulp
        np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-6)
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 1


def test_vjp_of_a_module_passed_twice_updates_its_one_variable_as_flax_does():
    """One trace: the module is one object inside, so both increments land on its one
    counter (copies of each place would each write 1 back).  The cotangent of the shared
    ``w`` is its whole gradient at the first place in varjax (object mode's rule), at both
    in flax.nnx: not compared."""
    def run(lib, vjp_):
        class Shared(lib.Module):
            def __init__(self):
                self.w, self.n = lib.Param(jnp.array(2.0)), lib.BatchStat(jnp.array(0))
        m = Shared()

        def f(a, b):
            a.n[...] += 1
            b.n[...] += 1
            return a.w * b.w
        out, fn = vjp_(f, m, m, graph_updates=False)
        return out, fn(jnp.ones(()))[0].w[...], m
    (out, gw, ours), (fout, fgw, theirs) = run(nnx, vjp), run(flax_nnx, flax_nnx.vjp)
    np.testing.assert_array_equal(out, fout)
    np.testing.assert_array_equal(gw, fgw)
    _same_state(ours, theirs)
    assert int(ours.n[...]) == 2


def test_vjp_and_jvp_with_graph_updates_raise_as_flax_raises():
    m = _counted(nnx)
    with pytest.raises(NotImplementedError, match="graph_updates is not supported for nnx.vjp"):
        flax_nnx.vjp(_loss, _counted(flax_nnx), X)
    with pytest.raises(NotImplementedError, match="graph_updates is not supported for nnx.vjp"):
        vjp(_loss, m, X)
    with pytest.raises(NotImplementedError, match="graph_updates is not supported for nnx.jvp"):
        jvp(_loss, (m, X), (m, X))
    assert int(m.count[...]) == 0


def test_vjp_follows_set_graph_updates_when_graph_updates_is_not_given():
    ours, theirs = _counted(nnx), _counted(flax_nnx)
    with set_graph_updates(False), flax_nnx.set_graph_updates(False):
        out, _ = vjp(lambda m, x: _loss(m, x)[0], ours, X)
        fout, _ = flax_nnx.vjp(lambda m, x: _loss(m, x)[0], theirs, X)
    np.testing.assert_array_equal(out, fout)
    _same_state(ours, theirs)


def test_vjp_reduce_axes_and_returning_a_module_are_not_provided():
    m = _counted(nnx)
    with pytest.raises(errors.NotProvidedError, match="reduce_axes"):
        vjp(_loss, m, X, reduce_axes=("i",), graph_updates=False)
    with pytest.raises(errors.NotProvidedError, match="returning an object from nnx.vjp"):
        vjp(lambda m, x: m, m, X, graph_updates=False)


def test_vjp_inside_nnx_jit_matches_flax_and_writes_updates_back():
    def run(lib, jit_, vjp_):
        m = _counted(lib)

        @jit_
        def g(m, x):
            _, fn = vjp_(lambda m, x: _loss(m, x)[0], m, x, graph_updates=False)
            return fn(jnp.ones(()))[1]
        return g(m, X), m
    (gx, ours), (fgx, theirs) = run(nnx, jit, vjp), run(flax_nnx, flax_nnx.jit, flax_nnx.vjp)
    np.testing.assert_array_equal(gx, fgx)
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 1


# --- custom_vjp: the Tree Mode note's two examples ----------------------------------------

def _foo(lib):
    class Foo(lib.Module):
        def __init__(self, x, y):
            self.x = lib.Param(x)
            self.y = lib.Param(y)
    return Foo(x=jnp.array(1.0), y=jnp.array(2.0))


def _note_previous(lib, custom_vjp_):
    """The note's "previous code": bwd gets ``(input_updates_g, out_g)`` and returns a State."""
    @custom_vjp_
    def f(m):
        return jnp.sin(m.x) * m.y

    def f_fwd(m):
        return f(m), (jnp.cos(m.x), jnp.sin(m.x), m)

    def f_bwd(res, g):
        (m_updates_g,), out_g = g
        cos_x, sin_x, m = res
        m_g = lib.clone(m_updates_g)  # create copy
        m_g['x'][...] = cos_x * out_g * m.y
        m_g['y'][...] = sin_x * out_g
        return (m_g,)  # State gradient
    f.defvjp(f_fwd, f_bwd)
    return f


def _note_new(lib, custom_vjp_):
    """The note's "new code": ``graph_updates=False``, bwd returns a Foo."""
    @custom_vjp_(graph_updates=False)
    def f(m):
        return jnp.sin(m.x) * m.y

    def f_fwd(m):
        return f(m), (jnp.cos(m.x), jnp.sin(m.x), m)

    def f_bwd(res, g):  # no gradients for updates
        cos_x, sin_x, m = res
        m_g = lib.clone(m)  # create copy
        m_g.x[...] = cos_x * g * m.y
        m_g.y[...] = sin_x * g
        return (m_g,)  # Foo gradient
    f.defvjp(f_fwd, f_bwd)
    return f


def test_note_previous_custom_vjp_with_graph_updates_gives_flax_state_gradient():
    f, ff = _note_previous(nnx, custom_vjp), _note_previous(flax_nnx, flax_nnx.custom_vjp)
    ours, theirs = _foo(nnx), _foo(flax_nnx)
    g, fg = grad(f)(ours), flax_nnx.grad(ff)(theirs)
    assert isinstance(g, nnx.State)
    _same_grads(g, fg)
    np.testing.assert_array_equal(f(ours), ff(theirs))


def test_note_new_custom_vjp_without_graph_updates_gives_flax_gradient_of_the_input_type():
    f, ff = _note_new(nnx, custom_vjp), _note_new(flax_nnx, flax_nnx.custom_vjp)
    ours, theirs = _foo(nnx), _foo(flax_nnx)
    _same_grads(grad(f)(ours), flax_nnx.grad(ff)(theirs))
    g = grad(f, graph_updates=False)(ours)
    assert type(g) is type(ours)
    _same_grads(g, flax_nnx.grad(ff, graph_updates=False)(theirs))
    _same_grads(jit(grad(f))(ours), flax_nnx.jit(flax_nnx.grad(ff))(theirs))


def test_custom_vjp_follows_set_graph_updates_when_graph_updates_is_not_given():
    with set_graph_updates(False), flax_nnx.set_graph_updates(False):
        f = custom_vjp(lambda m: jnp.sin(m.x) * m.y)
        ff = flax_nnx.custom_vjp(lambda m: jnp.sin(m.x) * m.y)
    for f_ in (f, ff):      # bwd(res, g) returning the input's type: the form without updates
        f_.defvjp(lambda m: (f_(m), m), lambda m, g: (jax.tree.map(lambda v: v * g, m),))
    _same_grads(grad(f)(_foo(nnx)), flax_nnx.grad(ff)(_foo(flax_nnx)))


# --- custom_vjp: nondiff arguments, updates inside, their cotangents ----------------------

def _at(tree, name):
    """The Variable ``name`` of a module or of a State (a cotangent in either form)."""
    return getattr(tree, name) if isinstance(tree, (nnx.Module, flax_nnx.Module)) else tree[name]


def _bar(lib):
    class Bar(lib.Module):
        def __init__(self):
            self.x, self.y = lib.Param(jnp.array(1.0)), lib.Param(jnp.array(2.0))
            self.n = lib.BatchStat(jnp.array(0))
    return Bar()


def _with_nondiff(lib, custom_vjp_, graph_updates):
    """``f(m, a, k)``, ``k`` nondiff: bwd gets ``k`` first, in each form (its rule is not
    the true derivative: bwd's own, scaled by 10)."""
    @custom_vjp_(nondiff_argnums=(2,), graph_updates=graph_updates)
    def f(m, a, k):
        m.n[...] += 1
        return jnp.sin(m.x) * m.y * a * k

    def f_fwd(m, a, k):
        return f(m, a, k), (m, a)

    def f_bwd(k, res, g):
        m, a = res
        (m_g,), out_g = ((lib.clone(g[0][0]),), g[1]) if graph_updates else ((lib.clone(m),), g)
        _at(m_g, 'x')[...] = jnp.cos(m.x) * m.y * a * k * out_g * 10
        _at(m_g, 'y')[...] = jnp.sin(m.x) * a * k * out_g
        return m_g, jnp.sin(m.x) * m.y * k * out_g
    f.defvjp(f_fwd, f_bwd)
    return f


@pytest.mark.parametrize("graph_updates", [True, False])
def test_custom_vjp_bwd_gets_nondiff_args_first_and_updates_are_written_back(graph_updates):
    f = _with_nondiff(nnx, custom_vjp, graph_updates)
    ff = _with_nondiff(flax_nnx, flax_nnx.custom_vjp, graph_updates)
    ours, theirs = _bar(nnx), _bar(flax_nnx)
    (gm, ga) = grad(f, argnums=(0, 1))(ours, 2.0, 3.0)
    (fgm, fga) = flax_nnx.grad(ff, argnums=(0, 1))(theirs, 2.0, 3.0)
    _same_grads(gm, fgm)
    np.testing.assert_array_equal(ga, fga)
    np.testing.assert_array_equal(f(ours, 2.0, 3.0), ff(theirs, 2.0, 3.0))
    _same_state(ours, theirs)
    assert int(ours.n[...]) == 2


def _normalized(lib, custom_vjp_, graph_updates):
    """A BatchNorm called inside the custom_vjp function: its statistics are updated there,
    under grad (flax#4847 is about this case); bwd is the derivative of ``sum(bn(x) * w)``."""
    class Net(lib.Module):
        def __init__(self, rngs):
            self.bn = lib.BatchNorm(2, rngs=rngs)
            self.w = lib.Param(jnp.array([1.0, -2.0]))

    @custom_vjp_(graph_updates=graph_updates)
    def f(net, x):
        return jnp.sum(net.bn(x) * net.w[None])

    def f_fwd(net, x):
        y = net.bn(x)
        return jnp.sum(y * net.w[None]), (y, net)

    def f_bwd(res, g):
        y, net = res
        if graph_updates:
            (net_g, x_g), out_g = g
            net_g = lib.clone(net_g)
            net_g['w'][...] = jnp.sum(y, axis=0) * out_g
            return net_g, None
        net_g = jax.tree.map(jnp.zeros_like, net)
        net_g.w[...] = jnp.sum(y, axis=0) * g
        return net_g, jnp.zeros_like(y)
    f.defvjp(f_fwd, f_bwd)
    return f, Net(lib.Rngs(0))


@pytest.mark.parametrize("graph_updates", [True, False])
def test_batchnorm_statistics_updated_inside_custom_vjp_under_grad_match_flax(graph_updates):
    f, ours = _normalized(nnx, custom_vjp, graph_updates)
    ff, theirs = _normalized(flax_nnx, flax_nnx.custom_vjp, graph_updates)
    g = jit(grad(f, argnums=DiffState(0, nnx.Param)))(ours, X)
    fg = flax_nnx.jit(flax_nnx.grad(ff, argnums=flax_nnx.DiffState(0, flax_nnx.Param)))(theirs, X)
    _same_grads(g, fg)
    _same_state(ours, theirs)
    assert not np.array_equal(ours.bn.mean[...], np.zeros(2))


def _used_after(lib, custom_vjp_, graph_updates):
    """``n`` (a float BatchStat) doubled inside and used after the call: its update's
    cotangent reaches bwd (``input_updates_g``, or ``updates_g``), which passes it on."""
    class Baz(lib.Module):
        def __init__(self):
            self.x, self.n = lib.Param(jnp.array(1.5)), lib.BatchStat(jnp.array(2.0))

    @custom_vjp_(graph_updates=graph_updates)
    def f(m):
        m.n[...] = m.n[...] * 2.0
        return jnp.sin(m.x)

    def f_fwd(m):
        return f(m), (jnp.cos(m.x), m)

    def rule(cos_x, out_g, n_g, m_g):
        _at(m_g, 'x')[...] = cos_x * out_g + n_g
        _at(m_g, 'n')[...] = 2.0 * n_g
        return (m_g,)

    def f_bwd(res, g):
        (m_updates_g,), out_g = g
        return rule(res[0], out_g, m_updates_g['n'][...], lib.clone(m_updates_g))

    def f_bwd_updates_g(res, g, *, updates_g):
        (m_updates_g,) = updates_g
        assert m_updates_g.x is None
        return rule(res[0], g, m_updates_g.n[...], lib.clone(res[1]))
    f.defvjp(f_fwd, f_bwd if graph_updates else f_bwd_updates_g)

    def loss(m):
        return f(m) + 3.0 * m.n[...]
    return loss, Baz()


@pytest.mark.parametrize("graph_updates", [True, False])
def test_cotangent_of_a_variable_updated_inside_reaches_bwd_as_flax_hands_it(graph_updates):
    loss, ours = _used_after(nnx, custom_vjp, graph_updates)
    floss, theirs = _used_after(flax_nnx, flax_nnx.custom_vjp, graph_updates)
    argnums = DiffState(0, ...) if graph_updates else 0
    fargnums = flax_nnx.DiffState(0, ...) if graph_updates else 0
    g = grad(loss, argnums=argnums, graph_updates=graph_updates)(ours)
    fg = flax_nnx.grad(floss, argnums=fargnums, graph_updates=graph_updates)(theirs)
    _same_grads(g, fg)
    _same_state(ours, theirs)
    assert float(ours.n[...]) == 4.0


# --- custom_vjp: refusals ------------------------------------------------------------------

def test_custom_vjp_module_in_integer_nondiff_argnums_with_graph_updates_raises_as_flax():
    for lib, cv in ((nnx, custom_vjp), (flax_nnx, flax_nnx.custom_vjp)):
        f = cv(lambda m, a: a * m.x, nondiff_argnums=(0,))
        f.defvjp(lambda m, a: (a * m.x, None), lambda m, res, g: (g,))
        with pytest.raises(TypeError, match="Passing integers to nondiff_argnums for graph"):
            f(_foo(lib), 1.0)


def test_custom_vjp_module_in_nondiff_argnums_without_graph_updates_works_under_jit():
    f = custom_vjp(lambda m, a: a * m.x, nondiff_argnums=(0,), graph_updates=False)
    f.defvjp(lambda m, a: (a * m.x, None), lambda m, res, g: (g * m.x * 10,))
    m = _foo(nnx)
    assert float(jax.grad(lambda a: f(m, a))(1.0)) == 10.0
    assert float(jit(lambda m: jax.grad(lambda a: f(m, a))(1.0))(m)) == 10.0


def test_custom_vjp_state_bwd_returning_an_array_for_a_module_raises():
    f = custom_vjp(lambda m: jnp.sin(m.x) * m.y)
    f.defvjp(lambda m: (f(m), None), lambda res, g: (g[1],))
    with pytest.raises(errors.TransformError, match="its cotangent is a State"):
        grad(f)(_foo(nnx))


def test_custom_vjp_diffstate_without_graph_updates_refused_as_flax():
    for lib, cv in ((nnx, custom_vjp), (flax_nnx, flax_nnx.custom_vjp)):
        with pytest.raises(ValueError, match="`nondiff_argnums` cannot contain `DiffState`"):
            cv(lambda m: m, nondiff_argnums=(lib.DiffState(0, ...),), graph_updates=False)


def test_custom_vjp_of_a_bound_method_is_refused():
    with pytest.raises(ValueError, match="does not support bound methods"):
        custom_vjp(_counted(nnx).__call__)
