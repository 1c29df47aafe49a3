"""A ``StateAxes`` nested inside an argument's ``in_axes`` entry (a tuple, list, dict or named
tuple of the argument's parts) and inside ``out_axes``, in ``nnx.vmap`` and ``nnx.scan``,
against flax.nnx 0.12.8: outputs and the Variables after the call bitwise equal (with
``transform_metadata`` too), what flax.nnx refuses refused with its error class; beyond
flax.nnx, also without graph updates."""
import collections
import contextlib
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import nnx
from varjax.nnx.batching import vmap
from varjax.nnx.iteration import Carry, scan
from varjax.nnx.state_axes import StateAxes

X = jnp.arange(4.0).reshape(2, 2) / 3
XS = jnp.arange(6.0).reshape(3, 2) / 5
Pair = collections.namedtuple("Pair", "m x")


def _lib(lib):
    if lib is nnx:
        return vmap, scan, StateAxes, Carry
    return flax_nnx.vmap, flax_nnx.scan, flax_nnx.StateAxes, flax_nnx.Carry


@contextlib.contextmanager
def _quiet():
    """flax.nnx's graph-mode StateAxes deprecation warning silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _flax(run, *args, **kwargs):
    with _quiet():
        return run(flax_nnx, *args, **kwargs)


def _same_state(ours, theirs):
    a = jax.tree.leaves(nnx.to_pure_dict(nnx.state(ours)))
    b = jax.tree.leaves(flax_nnx.to_pure_dict(flax_nnx.state(theirs)))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def _nest(kind, model, x, model_axes, x_axes):
    """The argument and its entry, the module and ``x`` inside a ``kind`` container."""
    if kind == "dict":
        return {"m": model, "x": x}, {"m": model_axes, "x": x_axes}
    if kind == "list":
        return [model, x], [model_axes, x_axes]
    if kind == "namedtuple":
        return Pair(model, x), Pair(model_axes, x_axes)
    return (model, x), (model_axes, x_axes)


def _unnest(arg):
    return (arg["m"], arg["x"]) if isinstance(arg, dict) else tuple(arg)


def _ensemble(lib):
    """Two Linears (Params stacked), a broadcast scale and a stacked counter."""
    class Member(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 3, rngs=rngs)
    ens = _lib(lib)[0](lambda rngs: Member(rngs))(lib.Rngs(0).fork(split=2))
    ens.scale = lib.BatchStat(jnp.full((), 2.0))
    ens.count = lib.Param(jnp.zeros((2,)))
    return ens


def _vmap_nested(lib, kind, **options):
    """The ensemble and ``X`` in one argument, ``in_axes=((StateAxes, 0), None)``-style."""
    vmap_, _, state_axes, _ = _lib(lib)
    ens = _ensemble(lib)
    arg, entry = _nest(kind, ens, X, state_axes({lib.Param: 0, ...: None}), 0)

    def forward(arg, y):
        m, x = _unnest(arg)
        m.count[...] += 1
        return m.lin(x) * m.scale[...] + y
    return vmap_(forward, in_axes=(entry, None), **options)(arg, 1.0), ens


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "namedtuple"])
def test_vmap_state_axes_nested_in_an_argument_entry_matches_flax(kind):
    y, ens = _vmap_nested(nnx, kind)
    fy, fens = _flax(_vmap_nested, kind)
    np.testing.assert_array_equal(y, fy)
    _same_state(ens, fens)
    np.testing.assert_array_equal(ens.count[...], [1.0, 1.0])


def test_vmap_nested_state_axes_without_graph_updates_beyond_flax():
    with pytest.raises(ValueError, match="cannot contain `StateAxes`"):
        _flax(_vmap_nested, "tuple", graph_updates=False)
    y, ens = _vmap_nested(nnx, "tuple", graph_updates=False)
    want, want_ens = _vmap_nested(nnx, "tuple")
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(ens.count[...], want_ens.count[...])


def _stack(lib):
    """Three layers (Params stacked), a step counter and a statistic."""
    class Layer(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
    stack = _lib(lib)[0](lambda rngs: Layer(rngs))(lib.Rngs(0).fork(split=3))
    stack.steps = lib.BatchStat(jnp.zeros(()))
    stack.stat = lib.Cache(jnp.ones(()))
    return stack


def _scan_nested(lib, kind):
    """The stack and ``XS`` in one argument: Params and ``XS`` scanned, the counter carried,
    the statistic broadcast (written every step, read into the output)."""
    _, scan_, state_axes, carry = _lib(lib)
    stack = _stack(lib)
    arg, entry = _nest(kind, stack, XS,
                       state_axes({lib.Param: 0, lib.BatchStat: carry, ...: None}), 0)

    def step(c, arg):
        m, x = _unnest(arg)
        m.steps[...] += 1
        m.stat[...] += 1
        return c + m.lin(c) * m.stat[...] + x, m.stat[...] + m.steps[...]
    c, seen = scan_(step, in_axes=(carry, entry), out_axes=(carry, 0))(jnp.ones((2,)), arg)
    return c, seen, stack


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_scan_state_axes_nested_in_an_argument_entry_matches_flax(kind):
    c, seen, stack = _scan_nested(nnx, kind)
    fc, fseen, fstack = _flax(_scan_nested, kind)
    np.testing.assert_array_equal(c, fc)
    np.testing.assert_array_equal(seen, fseen)
    np.testing.assert_array_equal(seen, [3.0, 4.0, 5.0])
    _same_state(stack, fstack)
    assert (float(stack.steps[...]), float(stack.stat[...])) == (3.0, 1.0)


def _made(lib, transform):
    """A module made inside (five members) returned in a dict beside an array, its Params
    stacked along axis 1 by a StateAxes nested in ``out_axes``."""
    _, scan_, state_axes, carry = _lib(lib)

    class Made(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 3, rngs=rngs)
            self.stat = lib.BatchStat(jnp.zeros((4,)))
    axes = {"m": state_axes({lib.Param: 1, ...: 0}), "k": 0}
    rngs = lib.Rngs(0).fork(split=5)
    if transform == "vmap":
        return _lib(lib)[0](lambda r: {"m": Made(r), "k": jnp.ones(())}, out_axes=axes)(rngs)
    return scan_(lambda c, r: (c, {"m": Made(r), "k": c}), in_axes=(carry, 0),
                 out_axes=(carry, axes))(jnp.zeros(()), rngs)[1]


@pytest.mark.parametrize("transform", ["vmap", "scan"])
def test_state_axes_nested_in_out_axes_stacks_a_made_module_as_flax(transform):
    ours, theirs = _made(nnx, transform), _flax(_made, transform)
    assert ours["m"].lin.kernel.shape == theirs["m"].lin.kernel.shape == (2, 5, 3)
    assert ours["m"].stat.shape == theirs["m"].stat.shape == (5, 4)
    assert ours["k"].shape == theirs["k"].shape == (5,)
    _same_state(ours["m"], theirs["m"])


def test_nested_state_axes_refusals_match_flax():
    """Tree mode, a nested StateAxes on an array (scan), and an argument not shaped as its
    entry are flax.nnx's ValueErrors."""
    for lib in (nnx, flax_nnx):
        vmap_, scan_, state_axes, carry = _lib(lib)
        sa = state_axes({...: 0})
        with pytest.raises(ValueError, match="cannot contain `StateAxes`"):
            vmap_(lambda y, p: p, in_axes=(None, (sa, 0)), graph=False)
        with pytest.raises(ValueError, match="cannot contain `StateAxes`"):
            scan_(lambda c, p: (c, p), in_axes=(carry, (sa, 0)), graph=False)
        with pytest.raises(ValueError, match="Cannot use StateAxes on non-graph nodes"):
            scan_(lambda c, p: (c, p[0]), in_axes=(carry, (sa, 0)))(
                jnp.zeros(()), (jnp.ones((2,)), jnp.ones((2,))))
        linear = lib.Linear(2, 2, rngs=lib.Rngs(0))
        with pytest.raises(ValueError), _quiet():
            vmap_(lambda p: p, in_axes=((sa, 0),))({"m": linear})


def _named(lib, name):
    """A stack whose Params are mapped and whose BatchStat (also named ``layers``) is
    broadcast by a StateAxes nested beside ``x``, with ``transform_metadata``."""
    vmap_, scan_, state_axes, _ = _lib(lib)
    seen = []

    class Layer(lib.Module):
        def __init__(self, rngs):
            self.w = lib.Param(rngs.params.uniform((2,)), out_sharding=("embed",))

    def apply(pair):
        m, x = pair
        seen.append((m.w.out_sharding, m.s.out_sharding))
        return x * m.w[...] * m.s[...].sum()
    metadata = {lib.PARTITION_NAME: "layers"}
    with flax_nnx.use_eager_sharding(False), _quiet():    # no mesh: flax would place it
        stack = vmap_(Layer, transform_metadata=metadata)(lib.Rngs(0).split(3))
        stack.s = lib.BatchStat(jnp.ones((3,)), out_sharding=("layers",))
        entry = (state_axes({lib.Param: 0, ...: None}), None)
        transform = vmap_ if name == "vmap" else functools.partial(scan_, out_axes=0)
        y = transform(apply, in_axes=(entry,), transform_metadata=metadata)((stack, X[0]))
    return stack, y, seen


@pytest.mark.parametrize("name", ["vmap", "scan"])
def test_transform_metadata_with_a_nested_state_axes_as_flax(name):
    (ours, y, seen), (theirs, fy, fseen) = _named(nnx, name), _named(flax_nnx, name)
    assert seen[-1] == fseen[-1] == (("embed",), ("layers",))
    assert ours.w.out_sharding == theirs.w.out_sharding == ("layers", "embed")
    np.testing.assert_array_equal(y, fy)
