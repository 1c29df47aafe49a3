"""NNX's randomness functions (``varjax/nnx/rnglib.py``: ``split_rngs``, ``fork_rngs``,
``with_rngs``, ``backup_keys``, ``restore_rngs``, ``reseed``; ``RngStream``/``Rngs``
``split``/``broadcast``) against flax.nnx 0.12.8: the same
objects built in both, the same call, then every stream's key and count compared bitwise
(and the keys drawn afterwards).  The Randomness design note's ``reseed`` example runs as
written with varjax's ``nnx``."""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as fnnx

import varjax as vj
import varjax.nnx.rnglib as rnglib
from varjax import errors
from varjax import nnx as vnnx
from varjax.nnx.filterlib import PathContains
from varjax.nnx.stochastic import Dropout

# The two frontends side by side: flax.nnx, and varjax.nnx with the functions built here.
FLAX = types.SimpleNamespace(nnx=fnnx, split_rngs=fnnx.split_rngs, fork_rngs=fnnx.fork_rngs,
                             restore_rngs=fnnx.restore_rngs, reseed=fnnx.reseed,
                             Dropout=fnnx.Dropout, PathContains=fnnx.PathContains)
VARJAX = types.SimpleNamespace(nnx=vnnx, split_rngs=rnglib.split_rngs,
                               fork_rngs=rnglib.fork_rngs, restore_rngs=rnglib.restore_rngs,
                               reseed=rnglib.reseed, Dropout=Dropout, PathContains=PathContains)


def _data(key):
    return np.asarray(jax.random.key_data(key) if jax.dtypes.issubdtype(
        key.dtype, jax.dtypes.prng_key) else key).tolist()


def streams(node, side):
    """``{path: (key data, count)}`` of every stream inside ``node``."""
    if side is FLAX:
        found = ((p, s.key[...], s.count[...]) for p, s in fnnx.iter_graph(node)
                 if isinstance(s, fnnx.RngStream))
    else:
        found = ((p, s.key, s.count) for p, s in rnglib._streams(node, graph=True))
    return {p: (_data(k), np.asarray(c).tolist()) for p, k, c in found}


def both(build):
    """``build(side)`` for each frontend."""
    return build(FLAX), build(VARJAX)


def same(f, v):
    assert streams(f, FLAX) == streams(v, VARJAX)


def model(side):
    """Two Rngs in a module, with a stream name in both (order of draws matters)."""
    nnx = side.nnx

    class Pair(nnx.Module):
        def __init__(self):
            self.enc = nnx.Rngs(0, dropout=2)
            self.dec = nnx.Rngs(dropout=3, params=1)
    return Pair()


# -- split_rngs -----------------------------------------------------------------------------

@pytest.mark.parametrize("splits", [5, (2, 3)])
def test_split_rngs_in_place_splits_every_stream_and_restores(splits):
    (f, v) = both(model)
    fb = fnnx.split_rngs(f, splits=splits)
    vb = rnglib.split_rngs(v, splits=splits)
    same(f, v)
    assert streams(v, VARJAX)[("dec", "params")][1] == np.zeros(splits, int).tolist()
    fnnx.restore_rngs(fb)
    rnglib.restore_rngs(vb)
    same(f, v)    # restored: the old keys, and counts one past the draw the split took
    assert streams(v, VARJAX)[("dec", "params")] == ([0, 1], 1)


def test_split_rngs_only_chooses_streams_by_name_type_and_path():
    for only in ["params", ["params", "default"]]:
        (f, v) = both(model)
        fnnx.split_rngs(f, splits=2, only=only)
        rnglib.split_rngs(v, splits=2, only=only)
        same(f, v)
    (f, v) = both(model)
    fnnx.split_rngs(f, splits=2, only=fnnx.PathContains("enc"))
    rnglib.split_rngs(v, splits=2, only=PathContains("enc"))
    same(f, v)
    assert streams(v, VARJAX)[("dec", "dropout")] == ([0, 3], 0)
    (f, v) = both(model)
    fnnx.split_rngs(f, splits=2, only=fnnx.RngKey)   # the count is no RngKey: nothing split
    rnglib.split_rngs(v, splits=2, only=vnnx.RngKey)
    same(f, v)
    assert streams(v, VARJAX)[("dec", "dropout")] == ([0, 3], 0)


def test_split_rngs_squeeze_keeps_one_key_without_an_axis():
    (f, v) = both(model)
    fnnx.split_rngs(f, splits=1, squeeze=True)
    rnglib.split_rngs(v, splits=1, squeeze=True)
    same(f, v)
    assert streams(v, VARJAX)[("dec", "dropout")][1] == 0


def test_split_rngs_squeeze_needs_splits_1():
    with pytest.raises(ValueError):
        fnnx.split_rngs(model(FLAX), splits=2, squeeze=True)
    with pytest.raises(errors.ConfigError, match="squeeze=True needs splits=1") as e:
        rnglib.split_rngs(model(VARJAX), splits=2, squeeze=True)
    assert isinstance(e.value, ValueError) and "test_nnx_rngs.py" in str(e.value)


def test_split_rngs_as_a_context_manager_restores_on_exit():
    (f, v) = both(lambda s: s.nnx.Rngs(params=0, dropout=1))
    with fnnx.split_rngs(f, splits=5, only="params"), \
            rnglib.split_rngs(v, splits=5, only="params"):
        same(f, v)
        assert v.params.key.shape == (5,) and v.dropout.key.shape == ()
    same(f, v)
    assert v.params.key.shape == ()


def test_split_rngs_decorator_splits_the_arguments_for_the_call():
    seen = {}

    def make(side):
        @side.split_rngs(splits=3, only="dropout")
        def f(rngs, *, extra):
            seen[side is FLAX] = (streams(rngs, side), _data(extra.dropout.key[...]), streams(extra, side))
            return rngs
        rngs, extra = side.nnx.Rngs(0, dropout=1), side.nnx.Rngs(dropout=4)
        out = f(rngs, extra=extra)
        assert out is rngs
        return rngs, extra
    (f, fe), (v, ve) = both(make)
    assert seen[True] == seen[False]
    assert np.shape(seen[False][1]) == (3, 2)    # the keyword argument was split too
    same(f, v)
    same(fe, ve)


@pytest.mark.parametrize("graph", [True, False])
def test_split_rngs_without_graph_updates_returns_a_copy(graph):
    (f, v) = both(model)
    fc = fnnx.split_rngs(f, splits=2, only="dropout", graph=graph, graph_updates=False)
    vc = rnglib.split_rngs(v, splits=2, only="dropout", graph=graph, graph_updates=False)
    same(f, v)     # the originals: each chosen stream drew once
    same(fc, vc)
    assert streams(v, VARJAX)[("dec", "dropout")] == ([0, 3], 1)
    assert vc is not v and vc.dec.params is v.dec.params   # unchosen streams are shared
    fc.dec.params()
    vc.dec.params()
    same(f, v)


def test_split_rngs_decorator_without_graph_updates_passes_copies():
    def make(side):
        @side.split_rngs(splits=2, graph_updates=False)
        def f(rngs):
            return streams(rngs, side)
        rngs = side.nnx.Rngs(params=0)
        return f(rngs), rngs
    (fi, f), (vi, v) = both(make)
    assert fi == vi
    same(f, v)
    assert v.params.count == 1


def _shared(side):
    """A module holding one Rngs at two attributes."""
    nnx = side.nnx

    class Twice(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = rngs, rngs
    return Twice(nnx.Rngs(params=0))


def test_split_rngs_visits_a_shared_rngs_once_in_graph_mode():
    (f, v) = both(_shared)
    fnnx.split_rngs(f, splits=2)
    rnglib.split_rngs(v, splits=2)
    same(f, v)
    assert v.a.params.key.shape == (2,)    # split once, not split again as b
    (f, v) = both(_shared)
    fc = fnnx.split_rngs(f, splits=3, graph_updates=False)
    vc = rnglib.split_rngs(v, splits=3, graph_updates=False)
    same(f, v)
    same(fc, vc)
    assert vc.a is vc.b and fc.a is fc.b    # the copy shares as the original does


def test_tree_mode_refuses_a_shared_stream():
    (f, v) = both(_shared)
    with pytest.raises(ValueError):
        fnnx.split_rngs(f, splits=2, graph=False)
    with pytest.raises(errors.InconsistentAliasError, match="a/params and b/params") as e:
        rnglib.split_rngs(v, splits=2, graph=False)
    assert isinstance(e.value, ValueError)


# -- fork_rngs ------------------------------------------------------------------------------

@pytest.mark.parametrize("split", [None, 4, {"params": 2, "dropout": None}])
def test_fork_rngs_in_place_forks_and_restores(split):
    (f, v) = both(model)
    fb = fnnx.fork_rngs(f, split=split)
    vb = rnglib.fork_rngs(v, split=split)
    same(f, v)
    fnnx.restore_rngs(fb)
    rnglib.restore_rngs(vb)
    same(f, v)


def test_fork_rngs_in_place_forks_a_stream_once_per_matching_filter():
    (f, v) = both(model)
    fnnx.fork_rngs(f, split={"dropout": None, fnnx.RngState: 2})
    rnglib.fork_rngs(v, split={"dropout": None, vnnx.RngState: 2})
    same(f, v)
    assert v.enc.dropout.key.shape == (2,)    # forked, then forked again split


def test_fork_rngs_leaves_streams_no_filter_matches():
    (f, v) = both(model)
    fnnx.fork_rngs(f, split={"params": 3})
    rnglib.fork_rngs(v, split={"params": 3})
    same(f, v)
    assert streams(v, VARJAX)[("enc", "dropout")] == ([0, 2], 0)


@pytest.mark.parametrize("graph", [True, False])
def test_fork_rngs_without_graph_updates_returns_a_copy(graph):
    (f, v) = both(model)
    split = {"params": 2, "dropout": None}
    fc = fnnx.fork_rngs(f, split=split, graph=graph, graph_updates=False)
    vc = rnglib.fork_rngs(v, split=split, graph=graph, graph_updates=False)
    same(f, v)
    same(fc, vc)
    assert vc.enc.default is v.enc.default


def test_fork_rngs_decorator_forks_for_the_call_as_the_design_note_does():
    # The note's sample_from_model, with the vmap (not built yet) replaced by drawing
    # one key per member from the forked dropout stream.
    def make(side):
        nnx = side.nnx

        class Model(nnx.Module):
            def __init__(self, rngs):
                self.linear = nnx.Linear(20, 10, rngs=rngs)
                self.drop = side.Dropout(0.1, rngs=rngs)

        @side.fork_rngs(split={"dropout": 5})
        def sample_from_model(model, x):
            return streams(model, side)
        m = Model(nnx.Rngs(params=0, dropout=1))
        return sample_from_model(m, jnp.ones((1, 20))), m
    (fi, f), (vi, v) = both(make)
    # varjax's Dropout keeps its stream in a one-stream Rngs: same keys, one path longer
    assert list(fi.values()) == list(vi.values())
    assert np.shape(list(vi.values())[0][1]) == (5,)
    assert list(streams(f, FLAX).values()) == list(streams(v, VARJAX).values())


# -- reseed ---------------------------------------------------------------------------------

def test_reseed_restarts_each_named_stream_in_order_in_place():
    (f, v) = both(model)
    for s in (f, v):
        s.enc.dropout(), s.dec.dropout(), s.dec.params()
    streams_before = v.enc.dropout
    fnnx.reseed(f, dropout=7, default=jax.random.key(3))
    rnglib.reseed(v, dropout=7, default=jax.random.key(3))
    same(f, v)   # dec/dropout got fold_in(key(7), 0), enc/dropout fold_in(key(7), 1)
    assert v.enc.dropout is streams_before
    assert streams(v, VARJAX)[("dec", "params")][1] == 1     # not named: untouched
    assert _data(f.enc.dropout()) == _data(v.enc.dropout())


def test_reseed_as_in_the_design_note():
    def run(side):
        nnx = side.nnx

        class Model(nnx.Module):
            def __init__(self, rngs: nnx.Rngs):
                self.linear = nnx.Linear(20, 10, rngs=rngs)
                self.drop = side.Dropout(0.1, rngs=rngs)

            def __call__(self, x):
                return nnx.relu(self.drop(self.linear(x)))

        model = Model(nnx.Rngs(params=0, dropout=1))
        x = jnp.ones((1, 20))
        y1 = model(x)
        y2 = model(x)
        side.reseed(model, dropout=1)  # reset dropout RngState
        y3 = model(x)
        assert not jnp.allclose(y1, y2)  # different
        assert jnp.allclose(y1, y3)      # same
        return y1, y2, y3
    for a, b in zip(*both(run)):
        np.testing.assert_array_equal(a, b)


def test_reseed_match_shape_splits_the_new_key_to_a_split_stream():
    (f, v) = both(model)
    fnnx.split_rngs(f, splits=3, only="dropout")
    rnglib.split_rngs(v, splits=3, only="dropout")
    fnnx.reseed(f, policy="match_shape", dropout=5)
    rnglib.reseed(v, policy="match_shape", dropout=5)
    same(f, v)


def test_reseed_scalars_only_refuses_a_split_stream():
    (f, v) = both(model)
    fnnx.split_rngs(f, splits=3, only="dropout")
    rnglib.split_rngs(v, splits=3, only="dropout")
    with pytest.raises(ValueError):
        fnnx.reseed(f, dropout=5)
    with pytest.raises(errors.ConfigError, match=r"dec/dropout has keys of shape \(3,\)") as e:
        rnglib.reseed(v, dropout=5)
    assert isinstance(e.value, ValueError) and e.value.path == ("dec", "dropout")


def test_reseed_takes_a_policy_callable():
    calls = {}

    def policy(side):
        def make(path, key, shape):
            calls.setdefault(side is FLAX, []).append((path, shape))
            return jax.random.fold_in(key, 9)
        return make
    (f, v) = both(model)
    fnnx.reseed(f, policy=policy(FLAX), dropout=5)
    rnglib.reseed(v, policy=policy(VARJAX), dropout=5)
    same(f, v)
    assert calls[True] == calls[False]


def test_reseed_refuses_an_unknown_policy():
    with pytest.raises(ValueError):
        fnnx.reseed(model(FLAX), policy="nearest", dropout=1)
    with pytest.raises(errors.ConfigError, match="policy must be"):
        rnglib.reseed(model(VARJAX), policy="nearest", dropout=1)


def test_reseed_keeps_a_raw_key_raw():
    v = vnnx.Rngs(dropout=jax.random.PRNGKey(0))
    rnglib.reseed(v, dropout=1)
    f = fnnx.Rngs(dropout=0)
    fnnx.reseed(f, dropout=1)
    assert v.dropout.key.dtype == jnp.uint32
    assert _data(v.dropout.key) == _data(f.dropout.key[...])


def test_vj_reseed_still_copies_and_keys_by_the_seed_itself():
    rngs = vj.Rngs(dropout=0)
    rngs.dropout()
    new = vj.reseed(rngs, dropout=1)
    assert new is not rngs and int(rngs.dropout.count) == 1
    assert _data(new.dropout.key) == _data(jax.random.key(1))


def test_replacing_a_key_inside_an_object_mode_transform_is_refused():
    class Holder(vnnx.Module):
        def __init__(self):
            self.rngs = vnnx.Rngs(dropout=0)

        def __call__(self):
            rnglib.reseed(self, dropout=1)
            return self.rngs.dropout()
    with pytest.raises(errors.TransformError, match="RNG stream 'dropout' cannot be replaced"):
        vj.jit(lambda m: m())(Holder())


# -- RngStream/Rngs split and broadcast -----------------------------------------------------

@pytest.mark.parametrize("method, k", [("split", 3), ("split", (2, 3)), ("broadcast", 3)])
def test_stream_split_and_broadcast_match_flax_nnx(method, k):
    f, v = fnnx.RngStream(0, tag="noise"), vnnx.RngStream(0, tag="noise")
    f_new, v_new = getattr(f, method)(k), getattr(v, method)(k)
    assert v_new.tag == "noise"
    assert (_data(v_new.key), np.asarray(v_new.count).tolist()) == \
        (_data(f_new.key[...]), np.asarray(f_new.count[...]).tolist())
    assert int(v.count) == int(f.count[...]) == 1


@pytest.mark.parametrize("method, k", [("split", 4), ("split", {"params": 2, ...: (2, 3)}),
                                       ("broadcast", {"dropout": None, ...: 2}),
                                       ("split", {"Not params": 3})])
def test_rngs_split_and_broadcast_match_flax_nnx(method, k):
    f, v = both(lambda side: side.nnx.Rngs(params=0, dropout=1))
    f.dropout(), v.dropout()

    def rules(nnx):
        return {nnx.Not("params") if f == "Not params" else f: n for f, n in k.items()} \
            if isinstance(k, dict) else k
    f_new, v_new = getattr(f, method)(rules(fnnx)), getattr(v, method)(rules(vnnx))
    same(f_new, v_new)    # a stream left alone restarts from its key at count 0, as in NNX
    same(f, v)


# -- with_rngs ------------------------------------------------------------------------------

def holder(side):
    """A module with a Dropout (a bare stream) and an Rngs."""
    nnx = side.nnx

    class Holder(nnx.Module):
        def __init__(self, rngs):
            self.drop = side.Dropout(0.5, rngs=rngs)
            self.rngs = rngs
    return Holder(nnx.Rngs(params=0, dropout=1, noise=2))


@pytest.mark.parametrize("graph", [True, False])
@pytest.mark.parametrize("rules", [
    dict(split=3),
    dict(split={"params": 2, ...: (2, 3)}),
    dict(broadcast={"dropout": 4}, fork=...),
    dict(fork="Not params"),
    dict(split={"dropout": 2}, fork=["noise"], only="dropout"),
    dict(split=2, broadcast=3),
])
def test_with_rngs_matches_flax_nnx(rules, graph):
    def run(side):
        node = holder(side)
        given = {k: side.nnx.Not("params") if v == "Not params" else v for k, v in rules.items()}
        with_rngs = fnnx.with_rngs if side is FLAX else rnglib.with_rngs
        return node, with_rngs(node, **given, graph=graph, graph_updates=False)
    (f, f_new), (v, v_new) = both(run)
    same(f_new, v_new)
    same(f, v)     # each chosen stream drew once
    assert v_new is not v and v_new.drop.rngs is not v.drop.rngs


def test_with_rngs_keeps_the_variables_and_the_streams_it_leaves():
    v = holder(VARJAX)
    v_new = rnglib.with_rngs(v, split={"params": 2}, graph_updates=False)
    assert v_new.rngs.dropout is v.rngs.dropout and v_new.rngs.params is not v.rngs.params


def test_with_rngs_on_a_bare_stream_replaces_it():
    f, v = both(lambda side: side.nnx.RngStream(0, tag="noise"))
    same(fnnx.with_rngs(f, split=2, graph=False), rnglib.with_rngs(v, split=2, graph=False))


def test_with_rngs_in_place_is_not_provided_as_in_flax_nnx():
    with pytest.raises(NotImplementedError):
        fnnx.with_rngs(fnnx.Rngs(0), split=2)
    with pytest.raises(errors.NotProvidedError, match="graph_updates=False"):
        rnglib.with_rngs(vnnx.Rngs(0), split=2)


def test_with_rngs_refuses_a_stream_two_specific_rules_match():
    with pytest.raises(ValueError, match="multiple rules"):
        fnnx.with_rngs(fnnx.Rngs(params=0), split={"params": 2}, fork="params", graph=False)
    with pytest.raises(errors.ConfigError, match="split by filter 'params', fork by filter"):
        rnglib.with_rngs(vnnx.Rngs(params=0), split={"params": 2}, fork="params", graph=False)


def test_with_rngs_decorator_passes_copies_to_the_function():
    def run(side):
        lib = fnnx if side is FLAX else rnglib
        rngs = side.nnx.Rngs(params=0, dropout=1)
        seen = lib.with_rngs(split={"dropout": 3}, graph=False)(lambda r: r)(rngs)
        return rngs, seen
    (f, f_seen), (v, v_seen) = both(run)
    same(f_seen, v_seen)
    same(f, v)
    assert v_seen.dropout.key.shape == (3,) and v.dropout.key.shape == ()


def test_with_rngs_tree_mode_refuses_a_shared_stream():
    rngs = vnnx.Rngs(0)
    with pytest.raises(errors.InconsistentAliasError, match="two paths"):
        rnglib.with_rngs([rngs, rngs], split=2, graph=False)


# -- backup_keys ----------------------------------------------------------------------------

def test_backup_keys_and_restore_rngs_put_back_the_keys_as_flax_nnx():
    from flax.nnx import rnglib as flax_rnglib

    def run(side):
        node = holder(side)
        lib = flax_rnglib if side is FLAX else rnglib
        backups = lib.backup_keys(node)
        side.split_rngs(node, splits=2, graph_updates=False)   # a copy: draws only
        lib.reseed(node, dropout=7)
        lib.restore_rngs(backups)
        return node, [s.tag for s, _ in backups]
    (f, f_tags), (v, v_tags) = both(run)
    assert v_tags == f_tags == ["dropout", "dropout", "noise", "params"]
    same(f, v)    # keys back, counts as they were left


def test_a_merged_stream_draws_through_the_state_it_was_merged_from_as_flax_nnx():
    """``nnx.merge`` of a split state: the merged module's stream holds the state's
    ``RngCount``, so its draws are seen there (and in ``nnx.state`` of the merged module),
    as flax.nnx's merged stream holds the state's Variables."""
    seen = {}
    for lib in (vnnx, fnnx):
        class Holder(lib.Module):
            def __init__(self):
                self.rngs = lib.Rngs(0, noise=1)
        graphdef, state = lib.split(Holder())
        merged = lib.merge(graphdef, state)
        draws = [merged.rngs.noise.normal(()) for _ in range(2)]
        seen[lib.__name__] = (int(state["rngs"]["noise"]["count"][...]), float(draws[1]),
                              lib.state(merged)["rngs"]["noise"]["count"] is
                              state["rngs"]["noise"]["count"])
    assert seen["varjax.nnx"] == seen["flax.nnx"]
    assert seen["varjax.nnx"][0] == 2


def test_a_stream_carried_by_a_state_axes_in_nnx_scan_advances_every_step_as_flax_nnx():
    seen = {}
    for lib in (vnnx, fnnx):
        class Noisy(lib.Module):
            def __init__(self):
                self.rngs = lib.Rngs(0, noise=1)

        def body(m, c, x):
            d = m.rngs.noise.normal(())
            return c + d, d
        m = Noisy()
        scan = lib.scan(body, in_axes=(lib.StateAxes({...: lib.Carry}), lib.Carry, 0),
                        out_axes=(lib.Carry, 0))
        _, draws = scan(m, jnp.zeros(()), jnp.arange(3.0))
        seen[lib.__name__] = (draws.tolist(), int(m.rngs.noise.count[...]))
    assert seen["varjax.nnx"] == seen["flax.nnx"]
    assert len(set(seen["varjax.nnx"][0])) == 3


def test_a_module_and_one_merged_from_its_state_draw_from_one_stream_in_a_transform_as_flax_nnx():
    """Both hold the same RngCount (the merged stream is over the state's views), so a
    transform given both draws two keys from one count, as flax.nnx's one Variable."""
    seen = {}
    for lib in (vnnx, fnnx):
        class Holder(lib.Module):
            def __init__(self):
                self.rngs = lib.Rngs(0, noise=1)
        original = Holder()
        merged = lib.merge(*lib.split(original))
        draws = lib.jit(lambda a, b: jnp.stack([a.rngs.noise.normal(()),
                                                b.rngs.noise.normal(())]))(original, merged)
        seen[lib.__name__] = (draws.tolist(), int(original.rngs.noise.count[...]),
                              int(merged.rngs.noise.count[...]))
    assert seen["varjax.nnx"] == seen["flax.nnx"]
    assert seen["varjax.nnx"][1:] == (2, 2)
