"""A ``StateAxes`` inside an NNX object of ``nnx.vmap``'s/``nnx.scan``'s ``in_axes``: a
module-shaped prefix whose submodule entry is a ``StateAxes``, or an ``nnx.prefix`` tree
whose leaves are.  flax.nnx 0.12.8 takes it in no mode (the first test shows each of its
errors); varjax.nnx gives the part under it an axis per filter, matched against the paths
below that place.  The oracle is flax.nnx's ``StateAxes`` of the whole argument whose
filters say the same by path: outputs and the Variables after the call bitwise equal."""
import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.batching import vmap
from varjax.nnx.iteration import Carry, scan
from varjax.nnx.prefixes import prefix
from varjax.nnx.state_axes import StateAxes

X = jnp.arange(2.0) / 3
XS = jnp.arange(6.0).reshape(3, 2) / 5


@contextlib.contextmanager
def _quiet():
    """flax.nnx's graph-mode StateAxes deprecation warning silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _model(lib, n, stacked_c=True):
    """``inner.a`` stacked ``n`` deep, ``inner.b`` not, ``c`` stacked or not."""
    class Inner(lib.Module):
        def __init__(self):
            self.a = lib.Param(jnp.arange(n * 4.0).reshape(n, 2, 2) / 7)
            self.b = lib.BatchStat(jnp.ones(2))

    class Outer(lib.Module):
        def __init__(self):
            self.inner = Inner()
            self.c = lib.Param(jnp.arange(n * 2.0).reshape(n, 2)[:n if stacked_c else 1]
                               .squeeze(None if stacked_c else 0) / 5)
    return Outer(), Inner


def _inner_param(path, x):
    return tuple(path[:1]) == ("inner",) and isinstance(x, flax_nnx.Param)


def _under_inner(path, x):
    return tuple(path[:1]) == ("inner",)


def _same_state(ours, theirs):
    a = jax.tree.leaves(nnx.to_pure_dict(nnx.state(ours)))
    b = jax.tree.leaves(flax_nnx.to_pure_dict(flax_nnx.state(theirs)))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def _step(m, x):
    m.inner.b[...] += 1.0
    return x @ m.inner.a[...] + m.c[...] + m.inner.b[...]


def test_flax_takes_a_state_axes_inside_a_prefix_tree_in_no_mode():
    sa = flax_nnx.StateAxes({flax_nnx.Param: 0, ...: None})
    m, inner_type = _model(flax_nnx, 2)
    shaped = jax.tree.map(lambda x: sa if isinstance(x, inner_type) else 0, m,
                          is_leaf=lambda x: isinstance(x, (inner_type, flax_nnx.Variable)))
    with pytest.raises(ValueError, match="Graph nodes are not allowed as prefixes"):
        flax_nnx.vmap(_step, in_axes=(shaped, None))(m, X)
    with pytest.raises(TypeError, match="vmap in_axes must be an int, None"):
        flax_nnx.vmap(_step, in_axes=(shaped, None), graph=False)(m, X)
    tree = flax_nnx.prefix(m, lambda path, x: sa, graph=True)
    with pytest.raises(ValueError, match="`TreeState` objects are only allowed"):
        flax_nnx.vmap(_step, in_axes=(tree, None))(m, X)
    with pytest.raises(TypeError, match="vmap in_axes must be an int, None"):
        flax_nnx.vmap(_step, in_axes=(tree, None), graph_updates=False)(m, X)


@pytest.mark.parametrize("mode", [{}, {"graph_updates": False}], ids=["updates", "values"])
def test_vmap_state_axes_at_a_submodule_of_a_module_prefix_as_flax_by_path(mode):
    """The prefix made by ``jax.tree.map`` without stopping at Variables (each holds its
    axis) works too: a Variable is one place of the tree."""
    ours, inner_type = _model(nnx, 2)
    shaped = jax.tree.map(lambda x: StateAxes({nnx.Param: 0, ...: None})
                          if isinstance(x, inner_type) else 0, ours,
                          is_leaf=lambda x: isinstance(x, inner_type))
    y = vmap(_step, in_axes=(shaped, None), **mode)(ours, X)
    theirs, _ = _model(flax_nnx, 2)
    by_path = flax_nnx.StateAxes({_inner_param: 0, _under_inner: None, ...: 0})
    with _quiet():
        fy = flax_nnx.vmap(_step, in_axes=(by_path, None))(theirs, X)
    np.testing.assert_array_equal(y, fy)
    _same_state(ours, theirs)
    assert float(ours.inner.b[0]) == 2.0


def test_vmap_nnx_prefix_tree_of_state_axes_nested_in_a_container_as_flax():
    """``nnx.prefix`` giving each Variable a ``StateAxes`` (matched at the Variable itself),
    the tree inside a tuple of the argument's entry."""
    ours, _ = _model(nnx, 2)
    tree = prefix(ours, lambda path, x: StateAxes({nnx.Param: 0, ...: None}))
    y = vmap(lambda t: _step(*t), in_axes=((tree, None),))((ours, X))
    theirs, _ = _model(flax_nnx, 2)
    with _quiet():
        fy = flax_nnx.vmap(lambda t: _step(*t), in_axes=(
            (flax_nnx.StateAxes({flax_nnx.Param: 0, ...: None}), None),))((theirs, X))
    np.testing.assert_array_equal(y, fy)
    _same_state(ours, theirs)


def _scan_step(carry, m, x):
    m.inner.b[...] += 1.0
    return carry + x @ m.inner.a[...] + m.c[...], m.inner.b[...]


def _scanned(lib, in_axes, **mode):
    if lib is nnx:
        return scan(_scan_step, in_axes=in_axes, out_axes=(Carry, 0), **mode)
    return flax_nnx.scan(_scan_step, in_axes=in_axes, out_axes=(flax_nnx.Carry, 0), **mode)


@pytest.mark.parametrize("at_b", [None, "carry"])
def test_scan_state_axes_at_a_submodule_of_a_module_prefix_as_flax_by_path(at_b):
    """The submodule's Params scanned, its BatchStat broadcast (given its values back every
    step, as a StateAxes ``None``) or carried; ``c`` broadcast by the tree's ``None`` (a
    Variable holding it: the tree made without stopping at Variables)."""
    ours, inner_type = _model(nnx, 3, stacked_c=False)
    b_axis = None if at_b is None else Carry
    shaped = jax.tree.map(lambda x: StateAxes({nnx.Param: 0, ...: b_axis})
                          if isinstance(x, inner_type) else None, ours,
                          is_leaf=lambda x: isinstance(x, inner_type))
    carry, bs = _scanned(nnx, (Carry, shaped, 0))(jnp.zeros(2), ours, XS)
    theirs, _ = _model(flax_nnx, 3, stacked_c=False)
    fb_axis = None if at_b is None else flax_nnx.Carry
    by_path = flax_nnx.StateAxes({_inner_param: 0, _under_inner: fb_axis, ...: None})
    with _quiet():
        fcarry, fbs = _scanned(flax_nnx, (flax_nnx.Carry, by_path, 0))(jnp.zeros(2), theirs, XS)
    np.testing.assert_array_equal(carry, fcarry)
    np.testing.assert_array_equal(bs, fbs)
    _same_state(ours, theirs)
    assert float(ours.inner.b[0]) == (1.0 if at_b is None else 4.0)


def test_scan_without_graph_updates_a_state_axes_none_in_a_tree_keeps_its_meaning():
    """Without graph updates a tree's own ``None`` carries and keeps the updates (a ``None``
    argument's meaning), while a ``StateAxes`` ``None`` in it gives the state its values
    back every step, as a whole argument's ``StateAxes`` does (flax.nnx takes neither)."""
    ours, inner_type = _model(nnx, 3, stacked_c=False)
    shaped = jax.tree.map(lambda x: StateAxes({nnx.Param: 0, ...: None})
                          if isinstance(x, inner_type) else None, ours,
                          is_leaf=lambda x: isinstance(x, (inner_type, nnx.Variable)))
    _, bs = _scanned(nnx, (Carry, shaped, 0), graph_updates=False)(jnp.zeros(2), ours, XS)
    np.testing.assert_array_equal(bs, jnp.full((3, 2), 2.0))
    assert float(ours.inner.b[0]) == 1.0
    plain = jax.tree.map(lambda x: 0 if isinstance(x, nnx.Param) and x is ours.inner.a
                         else None, ours, is_leaf=lambda x: isinstance(x, nnx.Variable))
    _, bs = _scanned(nnx, (Carry, plain, 0), graph_updates=False)(jnp.zeros(2), ours, XS)
    np.testing.assert_array_equal(bs, jnp.array([[2.0] * 2, [3.0] * 2, [4.0] * 2]))
    assert float(ours.inner.b[0]) == 4.0


def test_a_variable_under_the_state_axes_matching_no_filter_is_named():
    ours, inner_type = _model(nnx, 2)
    shaped = jax.tree.map(lambda x: StateAxes({nnx.Param: 0}) if isinstance(x, inner_type)
                          else 0, ours, is_leaf=lambda x: isinstance(x, (inner_type,
                                                                         nnx.Variable)))
    with pytest.raises(errors.InvalidVariablesError, match="inner/b") as e:
        vmap(_step, in_axes=(shaped, None))(ours, X)
    assert "test_nnx_prefix_state_axes.py" in e.value.source


def test_a_state_axes_in_a_prefix_tree_in_tree_mode_is_flax_value_error():
    """Tree mode refuses a StateAxes anywhere in the axes, as flax.nnx does (for one inside
    a module-shaped prefix flax.nnx's error is jax.vmap's TypeError)."""
    ours, _ = _model(nnx, 2)
    tree = prefix(ours, lambda path, x: StateAxes({...: 0}))
    with pytest.raises(ValueError, match="cannot contain `StateAxes`"):
        vmap(_step, in_axes=(tree, None), graph=False)
    with pytest.raises(ValueError, match="cannot contain `StateAxes`"):
        scan(_scan_step, in_axes=(Carry, tree, 0), out_axes=(Carry, 0), graph=False)
