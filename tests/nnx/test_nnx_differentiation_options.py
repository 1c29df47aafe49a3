"""nnx.vjp/jvp and nnx.custom_vjp options against flax.nnx 0.12.8: tree mode
(``graph=False``), ``custom_vjp``'s ``DiffState`` in ``nondiff_argnums``, and ``reduce_axes``,
which JAX itself no longer has, refused as JAX and flax.nnx refuse it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from counting_model import X
from counting_model import counting_model as _model
from counting_model import same_state as _same_state
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.differentiation import custom_vjp, jvp, vjp
from varjax.nnx.transforms import grad

# --- vjp(reduce_axes=...): gone from JAX ----------------------------------------------------

def test_vjp_reduce_axes_is_refused_as_jax_and_flax_refuse_it():
    with pytest.raises(NotImplementedError, match="JAX no longer has this option"):
        vjp(lambda x: x.sum(), X, reduce_axes=("i",), graph_updates=False)
    with pytest.raises(NotImplementedError, match="deprecated"):
        flax_nnx.vjp(lambda x: x.sum(), X, reduce_axes=("i",), graph_updates=False)
    with pytest.raises(NotImplementedError, match="deprecated"):
        jax.vjp(lambda x: x.sum(), X, reduce_axes=("i",))


# --- vjp / jvp in tree mode (graph=False) ----------------------------------------------------

def _tree_mode(lib, vjp_, jvp_):
    m = _model(lib)
    out, back = vjp_(lambda m, x: m(x).sum(), m, X, graph=False)
    g_m, g_x = back(jnp.ones(()))
    def one(a):
        if jnp.issubdtype(a.dtype, jnp.inexact):
            return jnp.ones_like(a)
        return np.zeros(a.shape, jax.dtypes.float0)      # the counter's tangent
    tangents = (jax.tree.map(one, m), jnp.ones_like(X))
    y, t = jvp_(lambda m, x: m(x).sum(), (m, X), tangents, graph=False)
    return m, out, g_m, g_x, y, t


def test_vjp_and_jvp_in_tree_mode_match_flax_and_write_updates_back():
    ours = _tree_mode(nnx, vjp, jvp)
    theirs = _tree_mode(flax_nnx, flax_nnx.vjp, flax_nnx.jvp)
    _same_state(ours[0], theirs[0])
    assert int(ours[0].count[...]) == 2
    _same_state(ours[2], theirs[2])
    for a, b in zip(ours[3:] + (ours[1],), theirs[3:] + (theirs[1],)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_tree_mode_vjp_of_a_shared_variable_is_a_value_error_as_flax():
    for lib, vjp_ in [(nnx, vjp), (flax_nnx, flax_nnx.vjp)]:
        m = _model(lib)
        m.again = m.lin.kernel
        with pytest.raises(ValueError, match="aliasing"):
            vjp_(lambda m, x: m(x).sum(), m, X, graph=False)


# --- custom_vjp(nondiff_argnums=(DiffState(...),)) ----------------------------------------

def _sin_x_times_y(lib, keep_y=False):
    """flax.nnx's docstring example: only ``x`` is differentiable."""
    class Foo(lib.Module):
        def __init__(self):
            self.x, self.y = lib.Param(jnp.array(1.0)), lib.Param(jnp.array(2.0))
    only_x = lib.PathContains("x")
    seen = []

    @(custom_vjp if lib is nnx else flax_nnx.custom_vjp)(
        nondiff_argnums=(lib.DiffState(0, only_x),))
    def f(m):
        return jnp.sin(m.x[...]) * m.y[...]

    def f_bwd(res, g):
        (m_updates_g,), out_g = g
        seen.append(sorted(lib.to_pure_dict(m_updates_g)))
        cos_x, m = res
        m_g = jax.tree.map(lambda x: x, m_updates_g)
        m_g.x[...] = cos_x * out_g * m.y[...]
        if not keep_y:
            del m_g["y"]
        return (m_g,)
    f.defvjp(lambda m: (f(m), (jnp.cos(m.x[...]), m)), f_bwd)
    return f, Foo(), lib.DiffState(0, only_x), seen


def test_custom_vjp_diffstate_differentiates_only_its_filter_as_flax():
    grads = []
    for lib in (nnx, flax_nnx):
        f, m, diff, seen = _sin_x_times_y(lib)
        grads.append(lib.to_pure_dict(lib.grad(f, argnums=diff)(m)))
        assert seen == [["x", "y"]]            # input_updates_g has the whole state
    assert list(grads[0]) == list(grads[1]) == ["x"]
    np.testing.assert_allclose(grads[0]["x"], grads[1]["x"], rtol=1e-6)


def test_custom_vjp_diffstate_bwd_returning_a_left_out_variable_is_an_error_as_flax():
    f, m, diff, _ = _sin_x_times_y(nnx, keep_y=True)
    with pytest.raises(errors.TransformError, match="DiffState filter"):
        grad(f, argnums=diff)(m)
    f, m, diff, _ = _sin_x_times_y(flax_nnx, keep_y=True)
    with pytest.raises(TypeError, match="same container"):
        flax_nnx.grad(f, argnums=diff)(m)


def test_custom_vjp_repeated_argnum_is_a_value_error_as_flax():
    for lib, cv in ((nnx, custom_vjp), (flax_nnx, flax_nnx.custom_vjp)):
        with pytest.raises(ValueError, match="argnum 0 is repeated"):
            cv(lambda m: m, nondiff_argnums=(0, lib.DiffState(0, ...)))
