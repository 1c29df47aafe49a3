"""``nnx.StateAxes`` in ``nnx.vmap``'s ``in_axes``, against flax.nnx 0.12.8: a module's Params
mapped and the rest broadcast give flax.nnx's outputs, and the mapped Variables' updates come
back to the caller's module; beyond flax.nnx, also with ``graph_updates=False``."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.batching import vmap
from varjax.nnx.iteration import scan
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


def test_state_axes_in_tree_mode_is_a_valueerror_and_in_scan_not_provided():
    with pytest.raises(ValueError, match="cannot contain `StateAxes`"):
        vmap(lambda m: m, in_axes=(StateAxes({...: 0}),), graph=False)
    with pytest.raises(errors.NotProvidedError, match="StateAxes"):
        vmap(lambda m: m, out_axes=(StateAxes({...: 0}),))
    with pytest.raises(errors.NotProvidedError, match="StateAxes"):
        scan(lambda c, m: (c, m), in_axes=(nnx.Carry, StateAxes({...: 0})))
