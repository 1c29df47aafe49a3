"""``nnx.prefix`` against flax.nnx 0.12.8: its docstring's examples (each in the modes flax.nnx
runs it in, and in the default mode, beyond flax.nnx), its errors, and a prefix as
``nnx.scan``'s ``in_axes``, where a ``None`` leaf means what ``None`` means for a whole
argument of that scan."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.batching import vmap
from varjax.nnx.iteration import Carry, scan
from varjax.nnx.prefixes import prefix

MODES = [dict(graph=False), dict(graph=True, graph_updates=False)]    # where flax.nnx runs them


def _lib(lib):
    if lib is nnx:
        return prefix, vmap, scan, Carry
    return flax_nnx.prefix, flax_nnx.vmap, flax_nnx.scan, flax_nnx.Carry


def _docstring_dicts(lib, mode):
    """The docstring's first two examples: a dict of a Param and a BatchStat, the BatchStat
    mapped, by a predicate and by a mapping of filters."""
    prefix_, vmap_, _, _ = _lib(lib)
    d = {'a': lib.Param(jnp.array(2)), 'b': lib.BatchStat(jnp.arange(5))}
    ys = []
    for filter_map in (lambda path, x: 0 if 'b' in path else None,
                       {lib.Param: None, lib.BatchStat: 0}):
        px = prefix_(d, filter_map, graph=mode.get("graph"))

        @vmap_(in_axes=(px,), **mode)
        def f(d):
            return d['a'] * d['b']
        ys.append(f(d))
    return ys


@pytest.mark.parametrize("mode", MODES)
def test_prefix_docstring_dict_examples_match_flax(mode):
    ours, theirs = _docstring_dicts(nnx, mode), _docstring_dicts(flax_nnx, mode)
    for y, fy in zip(ours, theirs):
        np.testing.assert_array_equal(y, fy)
        np.testing.assert_array_equal(y, [0, 2, 4, 6, 8])


def test_prefix_in_the_default_mode_beyond_flax():
    """flax.nnx refuses its graph-mode prefix with graph updates; here it is the same prefix."""
    with pytest.raises(ValueError, match="TreeState"):
        _docstring_dicts(flax_nnx, {})
    for y in _docstring_dicts(nnx, {}):
        np.testing.assert_array_equal(y, [0, 2, 4, 6, 8])


def _docstring_shared_model(lib):
    """The docstring's third example (graph mode, the model passed twice).  As written it
    asserts ``m1 is m2`` inside; varjax's transforms pass one object given twice as two
    objects over the same Variables, so that is what is asserted here."""
    prefix_, vmap_, _, _ = _lib(lib)

    @vmap_
    def create_model(rngs):
        return lib.Linear(2, 3, rngs=rngs)
    model = create_model(lib.Rngs(0).split(4))
    px1, px2 = prefix_((model, model), {lib.Param: 0}, graph=True)

    @vmap_(in_axes=(px1, px2, None), graph=True, graph_updates=False)
    def forward(m1, m2, x):
        assert m1.kernel is m2.kernel
        return m1(x) + m2(x)
    y = forward(model, model, jnp.ones(2))
    assert y.shape == (4, 3)
    return y


def test_prefix_docstring_shared_model_example_matches_flax():
    fy = _docstring_shared_model(flax_nnx)
    np.testing.assert_allclose(_docstring_shared_model(nnx), fy, rtol=1e-6)


def test_prefix_leaves_no_filter_matches_is_flax_valueerror():
    for lib in (nnx, flax_nnx):
        d = {'a': lib.Param(jnp.array(2)), 'b': lib.BatchStat(jnp.arange(5))}
        with pytest.raises(ValueError, match=r"No filter matched leaf at path \('b',\)"):
            _lib(lib)[0](d, {lib.Param: None})


def test_prefix_of_a_module_gives_each_node_its_value_and_one_per_stream():
    """A module's prefix is the module with each Variable, stream and array replaced (the
    values flax.nnx's tree-mode prefix holds there); a stream's key and count given two
    values is not built (a stream is one node)."""
    def build(lib):
        class Model(lib.Module):
            def __init__(self, rngs):
                self.lin = lib.Linear(2, 3, rngs=rngs)
                self.drop = lib.Dropout(0.1, rngs=rngs)
                self.arr = jnp.ones(3)
        return Model(lib.Rngs(0, dropout=1))
    ours = prefix(build(nnx), {'dropout': 0, nnx.Param: None, ...: 1})
    theirs = flax_nnx.prefix(build(flax_nnx), {'dropout': 0, flax_nnx.Param: None, ...: 1},
                             graph=False)
    assert (ours.lin.kernel, ours.lin.bias, ours.arr) == (None, None, 1)
    assert (theirs.lin.kernel, theirs.lin.bias, theirs.arr) == (None, None, 1)
    assert ours.drop.rngs == 0 == theirs.drop.rngs.key == theirs.drop.rngs.count
    with pytest.raises(errors.NotProvidedError, match="drop/rngs"):
        prefix(build(nnx), {nnx.RngKey: 0, ...: None})


class Count(nnx.Variable):
    pass


class FlaxCount(flax_nnx.Variable):
    pass


def _scan_prefix(lib, **mode):
    """A counter at None and a Param scanned, by a prefix: ``(carry, ys, counter, param)``."""
    prefix_, _, scan_, carry = _lib(lib)
    count = Count if lib is nnx else FlaxCount

    class Model(lib.Module):
        def __init__(self):
            self.c = count(jnp.array(0))
            self.w = lib.Param(jnp.arange(3.0))
    m = Model()
    px = prefix_(m, {count: None, lib.Param: 0}, graph=mode.get("graph"))

    def body(x, m):
        m.c[...] += 1
        m.w[...] += 1
        return x + m.w[...], m.c[...]
    c, ys = scan_(body, in_axes=(carry, px), out_axes=(carry, 0), **mode)(jnp.zeros(()), m)
    return float(c), np.asarray(ys).tolist(), int(m.c[...]), np.asarray(m.w[...]).tolist()


@pytest.mark.parametrize("mode", MODES)
def test_prefix_as_scan_in_axes_matches_flax(mode):
    """Where flax.nnx takes a prefix in scan (no graph updates), a None leaf is carried and
    kept, as a None argument is there."""
    ours = _scan_prefix(nnx, **mode)
    assert ours == _scan_prefix(flax_nnx, **mode) == (6.0, [1, 2, 3], 3, [1.0, 2.0, 3.0])


def test_prefix_as_scan_in_axes_with_graph_updates_beyond_flax():
    """With graph updates (flax.nnx refuses the prefix) a None leaf is what a None argument
    is then: every step sees its value as given, and none of its updates is kept."""
    with pytest.raises(ValueError, match="TreeState"):
        _scan_prefix(flax_nnx)
    assert _scan_prefix(nnx) == (6.0, [1, 1, 1], 0, [1.0, 2.0, 3.0])


def test_prefix_with_carry_in_scan_is_flax_valueerror():
    for lib in (nnx, flax_nnx):
        prefix_, _, scan_, carry = _lib(lib)
        m = lib.Linear(2, 2, rngs=lib.Rngs(0))
        px = prefix_(m, {...: carry}, graph=False)
        with pytest.raises(ValueError, match="cannot be nested"):
            scan_(lambda m, x: (m, x), in_axes=(px, 0), out_axes=(px, 0),
                  graph=False)(m, jnp.ones((2, 2)))
