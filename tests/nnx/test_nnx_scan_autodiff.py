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


def test_scan_without_graph_updates_returns_new_objects_holding_the_callers_variables():
    ours, theirs = _model(nnx), _model(flax_nnx)

    def step(m, x):
        return m, m(x)
    m, ys = scan(step, graph_updates=False)(ours, X)
    fm, fys = flax_nnx.scan(step, graph_updates=False)(theirs, X)
    assert (m is ours) == (fm is theirs) == False      # noqa: E712
    assert m.count is ours.count and fm.count is theirs.count
    np.testing.assert_array_equal(ys, fys)
    _same_state(ours, theirs)


def test_scan_structural_change_in_the_step_is_refused_as_flax_refuses_it():
    def step(lib):
        def f(m, x):
            m.seen = lib.BatchStat(x)
            return m, x
        return f
    with pytest.raises(TypeError, match="carry"):
        flax_nnx.scan(step(flax_nnx))(_model(flax_nnx), X)
    ours = _model(nnx)
    with pytest.raises(errors.TransformError, match="same structure from step to step"):
        scan(step(nnx))(ours, X)
    assert not hasattr(ours, "seen")


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


def test_scan_returning_a_scanned_argument_module_gives_the_callers_back_as_flax():
    for lib, scan_ in ((nnx, scan), (flax_nnx, flax_nnx.scan)):
        stack = lib.vmap(lambda r: _block(lib)(r))(lib.Rngs(0).fork(split=2))
        assert scan_(lambda c, m: (c, m))(jnp.zeros(()), stack)[1] is stack


def test_scan_of_a_bound_method_is_refused_as_flax_refuses_it():
    with pytest.raises(ValueError, match="does not support bound methods"):
        scan(_model(nnx).__call__)


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
