"""``nnx.scan`` in graph mode, against flax.nnx 0.12.8: the same outputs and the same
updates written back to the caller's modules, bit for bit; what is not built is refused by
name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.batching import vmap
from varjax.nnx.differentiation import custom_vjp, jvp, vjp
from varjax.nnx.iteration import Carry, scan

X = jnp.arange(12.0).reshape(3, 2, 2) / 7     # 3 steps of a (2, 2) batch


def _model(lib):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
            self.bn = lib.BatchNorm(2, rngs=rngs)
            self.count = lib.BatchStat(jnp.array(0))

        def __call__(self, x):
            self.count[...] += 1
            return self.bn(self.lin(x))
    return Model(lib.Rngs(0))


def _same_state(ours, theirs):
    a, b = nnx.to_pure_dict(nnx.state(ours)), flax_nnx.to_pure_dict(flax_nnx.state(theirs))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(x, y)


def test_scan_module_carried_updates_written_back_and_carry_is_the_callers_module():
    ours, theirs = _model(nnx), _model(flax_nnx)

    def step(m, x):
        return m, m(x)
    m, ys = scan(step)(ours, X)
    fm, fys = flax_nnx.scan(step)(theirs, X)
    assert m is ours and fm is theirs
    np.testing.assert_array_equal(ys, fys)
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 3


def _block(lib):
    class Block(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
            self.calls = lib.BatchStat(jnp.array(0))

        def __call__(self, x):
            self.calls[...] += 1
            return jax.nn.relu(self.lin(x))
    return Block


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_over_a_vmapped_stack_of_layers_matches_flax(reverse):
    stack = vmap(lambda r: _block(nnx)(r))(nnx.Rngs(0).fork(split=3))
    fstack = flax_nnx.vmap(lambda r: _block(flax_nnx)(r))(flax_nnx.Rngs(0).fork(split=3))
    _same_state(stack, fstack)

    def forward(x, layer):
        return layer(x)
    y = scan(forward, in_axes=(Carry, 0), out_axes=Carry, reverse=reverse)(X[0], stack)
    fy = flax_nnx.scan(forward, in_axes=(flax_nnx.Carry, 0), out_axes=flax_nnx.Carry,
                       reverse=reverse)(X[0], fstack)
    np.testing.assert_array_equal(y, fy)
    _same_state(stack, fstack)
    np.testing.assert_array_equal(stack.calls[...], [1, 1, 1])


def test_scan_broadcast_module_updates_are_not_kept_as_in_flax():
    ours, theirs = _model(nnx), _model(flax_nnx)

    def step(c, m, x):
        return c + 1, m(x)
    ins, outs = (Carry, None, 0), (Carry, 0)
    c, ys = scan(step, in_axes=ins, out_axes=outs)(jnp.array(0), ours, X)
    fc, fys = flax_nnx.scan(step, in_axes=(flax_nnx.Carry, None, 0),
                            out_axes=(flax_nnx.Carry, 0))(jnp.array(0), theirs, X)
    assert int(c) == int(fc) == 3
    np.testing.assert_array_equal(ys, fys)
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 0


def test_scan_axes_other_than_zero_length_and_unroll_match_flax():
    xs = jnp.moveaxis(X, 0, 2)      # steps along axis 2

    def step(c, x):
        return c + x.sum(), (x * c, c)
    kw = dict(in_axes=(Carry, 2), unroll=2)
    c, (a, b) = scan(step, out_axes=(Carry, (1, 0)), **kw)(jnp.array(1.0), xs)
    fc, (fa, fb) = flax_nnx.scan(step, out_axes=(flax_nnx.Carry, (1, 0)),
                                 in_axes=(flax_nnx.Carry, 2), unroll=2)(jnp.array(1.0), xs)
    for u, v in [(c, fc), (a, fa), (b, fb)]:
        np.testing.assert_array_equal(u, v)
    assert a.shape == (2, 3, 2)
    only = scan(lambda c: c * 2, in_axes=Carry, out_axes=Carry, length=4)(jnp.array(1.0))
    fonly = flax_nnx.scan(lambda c: c * 2, in_axes=flax_nnx.Carry, out_axes=flax_nnx.Carry,
                          length=4)(jnp.array(1.0))
    assert float(only) == float(fonly) == 16.0


def test_scan_without_carry_returns_the_stacked_outputs():
    ys = scan(lambda x: x * 2, in_axes=0, out_axes=0)(X)
    fys = flax_nnx.scan(lambda x: x * 2, in_axes=0, out_axes=0)(X)
    np.testing.assert_array_equal(ys, fys)


def test_scan_axes_errors_as_flax_raises_them():
    for scan_, carry in [(scan, Carry), (flax_nnx.scan, flax_nnx.Carry)]:
        with pytest.raises(ValueError, match="Cannot broadcast output state"):
            scan_(lambda c, x: (c, x), in_axes=(carry, 0), out_axes=(carry, None))
    with pytest.raises(ValueError, match="the other must also have Carry"):
        scan(lambda c, x: (c, x), in_axes=(Carry, 0), out_axes=(0, 0))
    with pytest.raises(ValueError, match="multiple Carry"):
        scan(lambda c, x: (c, x), in_axes=(Carry, Carry))
    with pytest.raises(ValueError, match="cannot be nested"):
        scan(lambda c, x: (c, x), in_axes=(Carry, (Carry, 0)))
    with pytest.raises(ValueError, match="exactly one argument"):
        scan(lambda *c: c[0], in_axes=Carry, out_axes=Carry)(jnp.ones(()), jnp.ones(()))


def test_scan_state_axes_transform_metadata_and_module_off_axis_zero_are_not_provided():
    state_axes = flax_nnx.StateAxes({flax_nnx.Param: 0, ...: None})
    with pytest.raises(errors.NotProvidedError, match="StateAxes"):
        scan(lambda c, m: (c, m), in_axes=(Carry, state_axes))
    with pytest.raises(errors.NotProvidedError, match="transform_metadata"):
        scan(lambda c, x: (c, x), transform_metadata={"partition": "x"})
    with pytest.raises(errors.NotProvidedError, match="_split_transpose"):
        scan(lambda c, x: (c, x), _split_transpose=True)
    stack = vmap(lambda r: _block(nnx)(r))(nnx.Rngs(0).fork(split=2))
    with pytest.raises(errors.NotProvidedError, match="module at in_axes 1"):
        scan(lambda x, m: m(x), in_axes=(Carry, 1), out_axes=Carry)(X[0], stack)


def test_scan_returning_an_argument_module_as_output_is_not_provided():
    stack = vmap(lambda r: _block(nnx)(r))(nnx.Rngs(0).fork(split=2))
    with pytest.raises(errors.NotProvidedError, match="returning an argument's Block"):
        scan(lambda c, m: (c, m))(jnp.zeros(()), stack)


def test_scan_of_a_bound_method_is_refused_as_flax_refuses_it():
    with pytest.raises(ValueError, match="does not support bound methods"):
        scan(_model(nnx).__call__)


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


def _assert_same_tree(a, b):
    assert type(a).__name__ == type(b).__name__
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert u.dtype == v.dtype
        if u.dtype != jax.dtypes.float0:
            np.testing.assert_array_equal(u, v)


def test_vjp_cotangent_of_a_module_is_a_module_and_updates_are_written_back():
    ours, theirs = _counted(nnx), _counted(flax_nnx)
    x = X[0]
    out, fn, aux = vjp(_loss, ours, x, has_aux=True, graph_updates=False)
    fout, ffn, faux = flax_nnx.vjp(_loss, theirs, x, has_aux=True, graph_updates=False)
    np.testing.assert_array_equal(out, fout)
    np.testing.assert_array_equal(aux, faux)
    _assert_same_tree(fn(jnp.ones(())), ffn(jnp.ones(())))
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 1
    out2, fn2 = vjp(graph_updates=False)(lambda m, x: _loss(m, x)[0])(ours, x)
    np.testing.assert_array_equal(out2, out)
    assert int(ours.count[...]) == 2


def test_jvp_tangent_of_a_module_is_a_module_and_updates_are_written_back():
    ours, theirs = _counted(nnx), _counted(flax_nnx)
    x = X[0]

    def tangent(m):
        return jax.tree.map(lambda a: jnp.ones_like(a) if a.dtype.kind == "f"
                            else np.zeros(a.shape, jax.dtypes.float0), m)
    out = jvp(_loss, (ours, x), (tangent(ours), x), has_aux=True, graph_updates=False)
    fout = flax_nnx.jvp(_loss, (theirs, x), (tangent(theirs), x), has_aux=True,
                        graph_updates=False)
    for u, v in zip(out, fout, strict=True):
        np.testing.assert_array_equal(u, v)
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 1


def test_vjp_and_jvp_with_graph_updates_raise_as_flax_raises():
    m, x = _counted(nnx), X[0]
    with pytest.raises(NotImplementedError, match="graph_updates is not supported for nnx.vjp"):
        flax_nnx.vjp(_loss, _counted(flax_nnx), x)
    with pytest.raises(NotImplementedError, match="graph_updates is not supported for nnx.vjp"):
        vjp(_loss, m, x)
    with pytest.raises(NotImplementedError, match="graph_updates is not supported for nnx.jvp"):
        jvp(_loss, (m, x), (m, x))
    assert int(m.count[...]) == 0


def test_vjp_and_jvp_tree_mode_reduce_axes_and_returning_a_module_are_not_provided():
    m, x = _counted(nnx), X[0]
    with pytest.raises(errors.NotProvidedError, match="graph=False"):
        vjp(_loss, m, x, graph=False)
    with pytest.raises(errors.NotProvidedError, match="graph=False"):
        jvp(_loss, (m, x), (m, x), graph=False)
    with pytest.raises(errors.NotProvidedError, match="reduce_axes"):
        vjp(_loss, m, x, reduce_axes=("i",), graph_updates=False)
    with pytest.raises(errors.NotProvidedError, match="returning an object from nnx.vjp"):
        vjp(lambda m, x: m, m, x, graph_updates=False)


def test_vjp_inside_nnx_jit_matches_flax_and_writes_updates_back():
    from varjax.nnx.transforms import jit

    def run(lib, jit_, vjp_):
        m = _counted(lib)

        @jit_
        def g(m, x):
            _, fn = vjp_(lambda m, x: _loss(m, x)[0], m, x, graph_updates=False)
            return fn(jnp.ones(()))[1]
        return g(m, X[0]), m
    (gx, ours), (fgx, theirs) = run(nnx, jit, vjp), run(flax_nnx, flax_nnx.jit, flax_nnx.vjp)
    np.testing.assert_array_equal(gx, fgx)
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 1


# --- custom_vjp ----------------------------------------------------------------------------

def _custom(lib, custom_vjp_):
    class Foo(lib.Module):
        def __init__(self):
            self.x, self.y = lib.Param(jnp.array(1.0)), lib.Param(jnp.array(2.0))
            self.n = lib.BatchStat(jnp.array(0))

    @custom_vjp_(graph_updates=False, nondiff_argnums=(1,))
    def f(m, k):
        m.n[...] += 1
        return jnp.sin(m.x[...]) * m.y[...] * k

    def f_fwd(m, k):
        return f(m, k), (jnp.cos(m.x[...]), jnp.sin(m.x[...]), m)

    def f_bwd(k, res, g):
        cos_x, sin_x, m = res
        m_g = jax.tree.map(lambda a: a, m)
        m_g.x[...] = cos_x * g * m.y[...] * k * 10     # not the true derivative: bwd's own
        m_g.y[...] = sin_x * g * k
        return (m_g,)
    f.defvjp(f_fwd, f_bwd)
    return f, Foo()


def test_custom_vjp_bwd_gives_a_module_cotangent_with_nondiff_args_and_updates_kept():
    from varjax.nnx.transforms import grad
    f, ours = _custom(nnx, custom_vjp)
    ff, theirs = _custom(flax_nnx, flax_nnx.custom_vjp)
    g = grad(lambda m: f(m, 3.0))(ours)
    fg = flax_nnx.grad(lambda m: ff(m, 3.0))(theirs)
    _assert_same_tree(nnx.to_pure_dict(g), flax_nnx.to_pure_dict(fg))
    np.testing.assert_array_equal(f(ours, 3.0), ff(theirs, 3.0))
    _same_state(ours, theirs)
    assert int(ours.n[...]) == 2


def test_custom_vjp_forms_not_built_are_not_provided():
    with pytest.raises(errors.NotProvidedError, match="graph updates"):
        custom_vjp(lambda m: m)
    with pytest.raises(errors.NotProvidedError, match="graph=False"):
        custom_vjp(lambda m: m, graph=False)
    with pytest.raises(errors.NotProvidedError, match="DiffState"):
        custom_vjp(lambda m: m, graph_updates=False,
                   nondiff_argnums=(flax_nnx.DiffState(0, ...),))
    f = custom_vjp(lambda m: m, graph_updates=False)
    with pytest.raises(errors.NotProvidedError, match="updates_g"):
        f.defvjp(lambda m: (m, None), lambda res, g, *, updates_g: (g,))
    with pytest.raises(errors.NotProvidedError, match="symbolic_zeros"):
        f.defvjp(lambda m: (m, None), lambda res, g: (g,), symbolic_zeros=True)


def test_scan_over_a_layer_stack_inside_nnx_jit_matches_flax():
    from varjax.nnx.transforms import jit

    def run(lib, vmap_, scan_, jit_, carry):
        stack = vmap_(lambda r: _block(lib)(r))(lib.Rngs(0).fork(split=3))

        @jit_
        def forward(stack, x):
            return scan_(lambda x, layer: layer(x), in_axes=(carry, 0), out_axes=carry)(x, stack)
        return forward(stack, X[0]), stack
    (y, ours), (fy, theirs) = (run(nnx, vmap, scan, jit, Carry),
                               run(flax_nnx, flax_nnx.vmap, flax_nnx.scan, flax_nnx.jit,
                                   flax_nnx.Carry))
    np.testing.assert_array_equal(y, fy)
    _same_state(ours, theirs)
    np.testing.assert_array_equal(ours.calls[...], [1, 1, 1])
