"""``nnx.custom_vjp``'s ``defvjp(fwd, bwd, symbolic_zeros=True)`` against flax.nnx 0.12.8:
what ``fwd`` and ``bwd`` see (``CustomVJPPrimal`` arguments, a module whose Variables hold
them, ``SymbolicZero`` cotangents), the gradients, the updates written back, and flax.nnx's
failure on a module argument with graph updates."""
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from varjax import nnx
from varjax.ir import errors

A, B = jnp.array(2.0), jnp.array(5.0)


def _kind(x):
    """What a cotangent or primal is, in words both libraries share (varjax's grad traces,
    so its arrays are tracers where flax.nnx's are concrete)."""
    if x is None:
        return None
    if isinstance(x, SymbolicZero):
        return "zero"
    if isinstance(x, CustomVJPPrimal):
        return ("primal", x.perturbed)
    return "array"


def _pair(lib, seen):
    """``(a, b) -> (a * b, a + b)`` with graph updates (the default), recording what its
    fwd and bwd get in ``seen``."""
    @lib.custom_vjp
    def h(a, b):
        return a * b, a + b

    def fwd(a, b):
        seen.append(("fwd", _kind(a), _kind(b)))
        return h(a.value, b.value), (a.value, b.value)

    def bwd(res, g):
        input_updates_g, (g1, g2) = g
        seen.append(("bwd", input_updates_g, _kind(g1), _kind(g2)))
        a, b = res
        g1 = jnp.zeros_like(a) if isinstance(g1, SymbolicZero) else g1
        g2 = jnp.zeros_like(a) if isinstance(g2, SymbolicZero) else g2
        return g1 * b + g2, g1 * a + g2
    h.defvjp(fwd, bwd, symbolic_zeros=True)
    return h


@pytest.mark.parametrize("out", [0, 1])
def test_fwd_gets_primals_and_bwd_a_symbolic_zero_for_the_unused_output_as_flax(out):
    grads = []
    for lib, seen in ((nnx, []), (flax_nnx, [])):
        h = _pair(lib, seen)
        grads.append((lib.grad(lambda a, b: h(a, b)[out], argnums=(0, 1))(A, B), seen))
    (ours, seen), (theirs, fseen) = grads
    assert seen == fseen
    assert seen[0] == ("fwd", ("primal", True), ("primal", True))
    assert seen[1] == ("bwd", (None, None), *(("array", "zero") if out == 0 else ("zero", "array")))
    np.testing.assert_array_equal(ours, theirs)


def test_an_argument_not_differentiated_is_not_perturbed_as_flax():
    seen = {}
    for lib in (nnx, flax_nnx):
        seen[lib] = []
        h = _pair(lib, seen[lib])
        grad = lib.grad(lambda a, b: h(a, b)[0])(A, B)
        np.testing.assert_array_equal(grad, B)
    assert seen[nnx] == seen[flax_nnx]
    assert seen[nnx][0] == ("fwd", ("primal", True), ("primal", False))


def test_the_primal_function_runs_without_differentiation_as_flax():
    seen = []
    out = _pair(nnx, seen)(A, B)
    assert seen == [] and [float(x) for x in out] == [10.0, 7.0]


def test_a_nondiff_argument_reaches_fwd_and_bwd_plain_as_flax():
    got = {}
    for lib in (nnx, flax_nnx):
        seen = []

        @lib.custom_vjp(nondiff_argnums=(1,))
        def scale(a, k):
            return a * k

        def fwd(a, k):
            seen.append(("fwd", _kind(a), _kind(k)))
            return a.value * k, ()

        def bwd(k, res, g):
            seen.append(("bwd", _kind(k), g[0], _kind(g[1])))
            return (g[1] * k,)
        scale.defvjp(fwd, bwd, symbolic_zeros=True)
        got[lib] = (lib.grad(scale)(A, B), seen)
    assert got[nnx][1] == got[flax_nnx][1] == [("fwd", ("primal", True), "array"),
                                               ("bwd", "array", (None,), "array")]
    np.testing.assert_array_equal(got[nnx][0], got[flax_nnx][0])


def _bar(lib, seen, graph_updates=False):
    """flax.nnx's ``updates_g`` example with symbolic zeros: ``z`` is updated by ``f`` and
    ``fwd`` (which writes a plain value: its Variables hold ``CustomVJPPrimal``s)."""
    class Bar(lib.Module):
        def __init__(self):
            self.x = lib.Param(jnp.array(1.0))
            self.y = lib.Param(jnp.array(2.0))
            self.z = lib.BatchStat(jnp.array(3.0))

    @lib.custom_vjp(graph_updates=graph_updates)
    def f(m, a):
        m.z[...] = m.z[...] * 2.0
        return jnp.sin(m.x[...]) * m.y[...] * a, a

    def fwd(m, a):
        seen.append(("fwd", _kind(m.x.get_value()), _kind(m.z.get_value()), _kind(a)))
        m.z.set_value(m.z.get_value().value * 2.0)
        x, y, a = m.x.get_value().value, m.y.get_value().value, a.value
        return (jnp.sin(x) * y * a, a), (jnp.cos(x), jnp.sin(x), y, a)

    def bwd(res, g, *, updates_g):
        (m_updates_g, a_updates_g) = updates_g
        seen.append(("bwd", _kind(g[0]), _kind(g[1]), type(m_updates_g.z).__name__,
                     _kind(m_updates_g.z.get_value()), m_updates_g.x, a_updates_g))
        cos_x, sin_x, y, a = res
        m_g = Bar()
        m_g.x[...] = cos_x * g[0] * y * a
        m_g.y[...] = sin_x * g[0] * a
        m_g.z[...] = jnp.zeros(())
        return m_g, sin_x * y * g[0]
    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return Bar, f


@pytest.mark.parametrize("z_read_after", [False, True])
def test_module_fwd_sees_primals_in_its_variables_and_gradients_match_flax(z_read_after):
    got = {}
    for lib in (nnx, flax_nnx):
        seen = []
        Bar, f = _bar(lib, seen)
        m = Bar()
        loss = (lambda m, a: f(m, a)[0] + m.z[...]) if z_read_after else \
            (lambda m, a: f(m, a)[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm, ga = lib.grad(loss, argnums=(0, 1), graph_updates=False)(m, jnp.array(3.0))
        got[lib] = (seen, type(gm).__name__, [np.asarray(v.get_value()) for v in (gm.x, gm.y, gm.z)],
                    np.asarray(ga), float(m.z[...]))
    ours, theirs = got[nnx], got[flax_nnx]
    assert ours[0] == theirs[0]
    assert ours[0][0] == ("fwd", ("primal", True), ("primal", True), ("primal", True))
    assert ours[0][1][:5] == ("bwd", "array", "zero", "BatchStat",
                              "array" if z_read_after else "zero")
    assert ours[1] == theirs[1] == "Bar"
    np.testing.assert_allclose(ours[2], theirs[2], rtol=1e-6)
    np.testing.assert_allclose(ours[3], theirs[3], rtol=1e-6)
    assert ours[4] == theirs[4] == 6.0          # fwd's update written back


def test_module_gradient_under_jit_matches_the_eager_one():
    Bar, f = _bar(nnx, [])
    grad = nnx.grad(lambda m, a: f(m, a)[0], argnums=(0, 1), graph_updates=False)
    m, jitted = Bar(), Bar()
    eager = grad(m, jnp.array(3.0))
    inside = nnx.jit(grad, graph_updates=False)(jitted, jnp.array(3.0))
    np.testing.assert_allclose(inside[0].x[...], eager[0].x[...], rtol=1e-6)
    assert float(m.z[...]) == float(jitted.z[...]) == 6.0


def test_a_module_with_graph_updates_is_a_type_error_naming_the_variable_as_flax():
    Bar, f = _bar(nnx, [], graph_updates=True)
    with pytest.raises(errors.InvalidVariablesError, match="CustomVJPPrimal") as caught:
        nnx.grad(lambda m, a: f(m, a)[0])(Bar(), jnp.array(3.0))
    assert isinstance(caught.value, TypeError)
    assert "variable:   x" in str(caught.value) and __file__ in str(caught.value)
    FBar, ff = _bar(flax_nnx, [], graph_updates=True)
    with pytest.raises(TypeError, match="CustomVJPPrimal"):
        flax_nnx.grad(lambda m, a: ff(m, a)[0])(FBar(), jnp.array(3.0))


def test_a_module_with_graph_updates_runs_the_primal_function_without_differentiation():
    for lib in (nnx, flax_nnx):
        Bar, f = _bar(lib, [], graph_updates=True)
        m = Bar()
        out, _ = f(m, jnp.array(3.0))
        np.testing.assert_allclose(out, np.sin(1.0) * 2.0 * 3.0, rtol=1e-6)
        assert float(m.z[...]) == 6.0
