"""``nnx.StateAxes`` in ``nnx.vmap`` and ``nnx.scan``, against flax.nnx 0.12.8: a module's
Params mapped (scanned) and the rest broadcast or carried give flax.nnx's outputs, the
Variables' updates come back to the caller's module as flax.nnx's do, and a module made
inside comes back with each state stacked along its ``out_axes`` filter's axis; beyond
flax.nnx, also with ``graph_updates=False``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.batching import vmap
from varjax.nnx.iteration import Carry, scan
from varjax.nnx.state_axes import StateAxes

X = jnp.arange(4.0).reshape(2, 2) / 3


def _run(lib, vmap_, state_axes, **options):
    """An ensemble of two Linears (Params stacked) with a broadcast scale and a stacked
    counter, called twice with the Params (and counter) mapped and the rest broadcast."""
    class Member(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 3, rngs=rngs)
    ens = vmap_(lambda rngs: Member(rngs))(lib.Rngs(0).fork(split=2))
    ens.scale = lib.BatchStat(jnp.full((), 2.0))
    ens.count = lib.Param(jnp.zeros((2,)))

    @vmap_(in_axes=(state_axes({lib.Param: 0, ...: None}), None), **options)
    def forward(m, x):
        m.count[...] += 1
        return m.lin(x) * m.scale[...]
    forward(ens, X)
    return forward(ens, X), ens


def test_vmap_state_axes_maps_params_broadcasts_the_rest_and_writes_updates_back_as_flax():
    y, ens = _run(nnx, vmap, StateAxes)
    with pytest.warns(DeprecationWarning):
        fy, fens = _run(flax_nnx, flax_nnx.vmap, flax_nnx.StateAxes)
    np.testing.assert_allclose(y, fy, rtol=1e-6)
    np.testing.assert_array_equal(ens.count[...], fens.count[...])
    assert float(ens.scale[...]) == 2.0


def test_vmap_state_axes_without_graph_updates_beyond_flax():
    with pytest.raises(ValueError, match="cannot contain `StateAxes`"):
        _run(flax_nnx, flax_nnx.vmap, flax_nnx.StateAxes, graph_updates=False)
    y, ens = _run(nnx, vmap, StateAxes, graph_updates=False)
    want, _ = _run(nnx, vmap, StateAxes)
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(ens.count[...], [2.0, 2.0])


def test_state_axes_is_a_mapping_of_filters_to_axes_as_flax():
    axes, faxes = (StateAxes({nnx.Param: 0, ...: None}),
                   flax_nnx.StateAxes({flax_nnx.Param: 0, ...: None}))
    assert axes.axes == faxes.axes == (0, None) and len(axes) == len(faxes) == 2
    assert axes[...] is faxes[...] is None and list(axes) == [nnx.Param, ...]


class ScanSteps(nnx.Variable):
    pass


class FlaxSteps(flax_nnx.Variable):
    pass


def _lib(lib):
    """The library's vmap, scan, StateAxes, Carry and step-counter type."""
    if lib is nnx:
        return vmap, scan, StateAxes, Carry, ScanSteps
    return flax_nnx.vmap, flax_nnx.scan, flax_nnx.StateAxes, flax_nnx.Carry, FlaxSteps


def _stack(lib):
    """Three layers (Params stacked along 0), a step counter and a statistic."""
    vmap_, _, _, _, steps = _lib(lib)

    class Layer(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
    stack = vmap_(lambda rngs: Layer(rngs))(lib.Rngs(0).fork(split=3))
    stack.steps = steps(jnp.zeros(()))
    stack.stat = lib.BatchStat(jnp.ones(()))
    return stack


def _step(m, x):
    m.steps[...] += 1
    m.stat[...] += 1
    return x + m.lin(x) * m.stat[...], m.stat[...] + m.steps[...]


def _scan_stack(lib, **options):
    """The stack applied one layer per step: Params scanned, the counter carried, the
    statistic broadcast (written every step, read into the output)."""
    _, scan_, state_axes, carry, steps = _lib(lib)
    stack = _stack(lib)
    axes = state_axes({lib.Param: 0, steps: carry, ...: None})
    y, seen = scan_(_step, in_axes=(axes, carry), out_axes=(carry, 0), **options)(stack, X)
    return stack, y, seen


def test_scan_state_axes_scans_params_carries_and_broadcasts_the_rest_as_flax():
    """Each step sees the broadcast statistic as it was given (its writes are not kept), the
    carried counter counts the steps; outputs and Variables are flax.nnx's."""
    ours, y, seen = _scan_stack(nnx)
    with pytest.warns(DeprecationWarning):
        theirs, fy, fseen = _scan_stack(flax_nnx)
    np.testing.assert_allclose(y, fy, rtol=1e-6)
    np.testing.assert_array_equal(seen, fseen)
    np.testing.assert_array_equal(seen, [3.0, 4.0, 5.0])
    assert int(ours.steps[...]) == int(theirs.steps[...]) == 3
    assert float(ours.stat[...]) == float(theirs.stat[...]) == 1.0
    np.testing.assert_array_equal(ours.lin.kernel[...], theirs.lin.kernel[...])


def test_scan_state_axes_without_graph_updates_beyond_flax():
    with pytest.raises(ValueError, match="cannot contain `StateAxes`"), \
            pytest.warns(DeprecationWarning):
        _scan_stack(flax_nnx, graph_updates=False)
    ours, y, seen = _scan_stack(nnx, graph_updates=False)
    _, want, want_seen = _scan_stack(nnx)
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(seen, want_seen)
    assert (int(ours.steps[...]), float(ours.stat[...])) == (3, 1.0)


class _Counter:
    """A module with a counter, broadcast (``None``) through a scan of three steps."""

    @staticmethod
    def run(lib, graph_updates):
        class Model(lib.Module):
            def __init__(self):
                self.c = (ScanSteps if lib is nnx else FlaxSteps)(jnp.array(0))
        m = Model()

        def body(m, x):
            m.c[...] += 1
            return x, m.c[...]
        _, seen = _lib(lib)[1](body, in_axes=(None, _lib(lib)[3]), out_axes=(_lib(lib)[3], 0),
                               length=3, graph_updates=graph_updates)(m, jnp.zeros(()))
        return np.asarray(seen).tolist(), int(m.c[...])


@pytest.mark.parametrize("graph_updates", [True, False])
def test_scan_broadcast_argument_updates_per_mode_as_flax(graph_updates):
    """flax.nnx's two scans differ here: with graph updates every step sees the broadcast
    module as given and nothing is kept; without them its updates are carried and kept."""
    ours = _Counter.run(nnx, graph_updates)
    assert ours == _Counter.run(flax_nnx, graph_updates)
    assert ours == (([1, 1, 1], 0) if graph_updates else ([1, 2, 3], 3))


def _made(lib, transform):
    """A module made inside ``vmap``/``scan`` (five members), Params stacked along axis 1."""
    vmap_, scan_, state_axes, carry, _ = _lib(lib)

    class Made(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 3, rngs=rngs)
            self.stat = lib.BatchStat(jnp.zeros((4,)))
    axes = state_axes({lib.Param: 1, ...: 0})
    rngs = lib.Rngs(0).fork(split=5)
    if transform == "vmap":
        return vmap_(lambda r: Made(r), out_axes=axes)(rngs)
    return scan_(lambda c, r: (c, Made(r)), in_axes=(carry, 0),
                 out_axes=(carry, axes))(jnp.zeros(()), rngs)[1]


@pytest.mark.parametrize("transform", ["vmap", "scan"])
def test_out_axes_state_axes_stacks_each_state_of_a_made_module_as_flax(transform):
    ours = _made(nnx, transform)
    with pytest.warns(DeprecationWarning):
        theirs = _made(flax_nnx, transform)
    assert ours.lin.kernel[...].shape == (2, 5, 3) and ours.stat[...].shape == (5, 4)
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(nnx.state(ours))),
                    jax.tree.leaves(flax_nnx.to_pure_dict(flax_nnx.state(theirs)))):
        np.testing.assert_array_equal(a, b)


def test_state_axes_errors_match_flax_and_what_is_not_built_is_named():
    """Tree mode, a StateAxes on an array, and an output state at None or Carry are
    flax.nnx's ValueErrors (nested StateAxes: test_nnx_nested_state_axes.py)."""
    for lib in (nnx, flax_nnx):
        _, scan_, state_axes, carry, _ = _lib(lib)
        with pytest.raises(ValueError, match="cannot contain `StateAxes`"):
            _lib(lib)[0](lambda m: m, in_axes=(state_axes({...: 0}),), graph=False)
        with pytest.raises(ValueError, match="Cannot broadcast output state"):
            scan_(lambda c: c, in_axes=(carry,), out_axes=(carry, state_axes({...: None})))
        with pytest.raises(ValueError, match="Cannot carry output state"):
            scan_(lambda c: c, in_axes=(carry,), out_axes=(carry, state_axes({...: carry})))
        with pytest.raises(ValueError, match="Cannot use StateAxes on non-graph nodes"):
            scan_(lambda c, x: (c, x), in_axes=(carry, state_axes({...: 0})))(
                jnp.zeros(()), jnp.ones((2,)))


def _by_state(lib):
    """A StateAxes made from a State of axes (each path its own filter, as flax.nnx's)."""
    vmap_, _, state_axes, _, _ = _lib(lib)
    ens = vmap_(lambda rngs: lib.Linear(2, 3, rngs=rngs))(lib.Rngs(0).split(2))
    ens.scale = lib.BatchStat(jnp.full((), 2.0))
    axes = state_axes(lib.State({'kernel': 0, 'bias': 0, 'scale': None}))
    return vmap_(lambda m, x: m(x) * m.scale[...], in_axes=(axes, None))(ens, X)


def test_state_axes_from_a_state_of_axes_matches_flax():
    np.testing.assert_allclose(_by_state(nnx), _by_state(flax_nnx), rtol=1e-6)


def test_vmap_in_axes_given_a_bare_state_axes_is_an_error_asking_for_a_tuple():
    """flax.nnx raises a TypeError here too; varjax used to fail inside with 'unhashable'."""
    with pytest.raises(errors.TransformError, match="one entry per argument"):
        vmap(lambda m: m, in_axes=StateAxes({...: 0}))
