"""A stream's key and count as ``RngKey``/``RngCount`` Variables in NNX's graph and state
functions (``varjax/nnx/rng_variables.py``), against flax.nnx 0.12.8 from the same seeds:
what the RNG filters select, split/merge/update round trips, and the Variables reading and
writing the stream (keys, counts and dropout masks compared bitwise)."""
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.state_ops import pop

X = jnp.ones((1, 2))


def _model(lib: Any) -> Any:
    class Model(lib.Module):
        def __init__(self, rngs):
            self.linear = lib.Linear(2, 4, rngs=rngs)
            self.drop = lib.Dropout(0.5, rngs=rngs)
            self.rngs = rngs

        def __call__(self, x):
            return self.drop(self.linear(x))
    return Model(lib.Rngs(params=0, dropout=1))


def _plain(tree: Any) -> list:
    def value(x: Any) -> np.ndarray:
        return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.prng_key) else x)
    return [(jax.tree_util.keystr(p), value(x))
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _same(ours: Any, theirs: Any) -> None:
    a, b = _plain(ours), _plain(theirs)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("which", ["RngState", "RngKey", "RngCount", "dropout", "WithTag"])
def test_rng_filters_select_stream_keys_and_counts_as_flax_nnx(which):
    # a stream's name selects its key and count (its tag); 'params' would select the params
    # collection too in varjax.nnx (SPEC §6), so the params stream is chosen by WithTag
    ours, theirs = _model(nnx), _model(flax_nnx)

    def pick(lib: Any) -> Any:
        if which == "dropout":
            return which
        return lib.WithTag("params") if which == "WithTag" else getattr(lib, which)
    _same(nnx.to_pure_dict(nnx.state(ours, pick(nnx))),
          flax_nnx.to_pure_dict(flax_nnx.state(theirs, pick(flax_nnx))))


def test_stream_fields_are_tagged_rng_variables_and_the_whole_state_is_flax_nnx():
    ours, theirs = _model(nnx), _model(flax_nnx)
    _same(nnx.to_pure_dict(nnx.state(ours)), flax_nnx.to_pure_dict(flax_nnx.state(theirs)))
    key = nnx.state(ours)["drop"]["rngs"]["key"]
    count = nnx.state(ours)["rngs"]["params"]["count"]
    assert isinstance(key, nnx.RngKey) and key.tag == "dropout" and key.collection == "RngKey"
    assert isinstance(count, nnx.RngCount) and count.tag == "params"
    assert nnx.state(ours)["drop"]["rngs"]["key"] is key    # the same Variable every time


def test_rng_variables_read_and_write_their_stream_as_flax_nnx():
    for lib, model in ((nnx, _model(nnx)), (flax_nnx, _model(flax_nnx))):
        count = lib.state(model, lib.RngCount)["drop"]["rngs"]["count"]
        model(X)
        assert int(count.value) == 1     # the stream drew: the Variable sees it
        count.value = jnp.uint32(5)
        assert int(lib.state(model)["drop"]["rngs"]["count"].value) == 5
    ours, theirs = _model(nnx), _model(flax_nnx)
    for lib, model in ((nnx, ours), (flax_nnx, theirs)):
        lib.state(model, lib.RngCount)["drop"]["rngs"]["count"].value = jnp.uint32(3)
    _same(ours(X) == 0, theirs(X) == 0)     # the dropout mask of count 3 in both


def test_update_with_a_saved_rng_state_repeats_the_dropout_mask_as_flax_nnx():
    def run(lib: Any, model: Any) -> tuple:
        saved = jax.tree.map(lambda x: x, lib.state(model, lib.RngState))   # copies
        first = model(X)
        second = model(X)
        lib.update(model, saved)
        again = model(X)
        return first == 0, second == 0, again == 0, lib.to_pure_dict(lib.state(model))
    ours, theirs = run(nnx, _model(nnx)), run(flax_nnx, _model(flax_nnx))
    _same(ours, theirs)
    np.testing.assert_array_equal(ours[0], ours[2])


def test_split_by_rng_state_and_merge_round_trip_as_flax_nnx():
    def run(lib: Any) -> tuple:
        model = _model(lib)
        g, rng, rest = lib.split(model, lib.RngState, ...)
        merged = lib.merge(g, rng, rest)
        return (lib.to_pure_dict(rng), sorted(lib.to_flat_state(rest).paths),
                lib.to_pure_dict(lib.state(merged)), merged(X) == 0)
    ours, theirs = run(nnx), run(flax_nnx)
    assert ours[1] == theirs[1]
    _same((ours[0], ours[2], ours[3]), (theirs[0], theirs[2], theirs[3]))


def test_copies_of_rng_variables_are_plain_variables_of_their_type():
    model = _model(nnx)
    state = nnx.state(model, nnx.RngCount)
    copied = jax.tree.map(lambda x: x + 1, state)
    count = copied["drop"]["rngs"]["count"]
    assert isinstance(count, nnx.RngCount) and int(count.value) == 1
    count.value = jnp.uint32(9)     # a copy: the stream is not written
    assert int(model.drop.rngs.count) == 0
    cloned = nnx.clone(model)
    assert isinstance(nnx.state(cloned)["drop"]["rngs"]["count"], nnx.RngCount)
    cloned.drop.rngs()
    assert (int(cloned.drop.rngs.count), int(model.drop.rngs.count)) == (1, 0)


def test_rng_state_survives_nnx_jit_bitwise_as_flax_nnx():
    def run(lib: Any) -> tuple:
        model = _model(lib)
        y = lib.jit(lambda m, x: m(x))(model, X)
        return y == 0, lib.to_pure_dict(lib.state(model, lib.RngCount))
    _same(run(nnx), run(flax_nnx))


def test_pop_refuses_a_stream_key_or_count():
    model = _model(nnx)
    with pytest.raises(errors.NotProvidedError, match="drop/rngs/count") as info:
        pop(model, nnx.RngState)
    assert __file__ in info.value.source
    assert int(model.drop.rngs.count) == 0 and model.drop.rngs.key is not None


def test_rng_count_written_through_state_inside_nnx_jit_reaches_the_caller_as_flax_nnx():
    def run(lib: Any) -> Any:
        model = _model(lib)

        @lib.jit
        def step(m):
            lib.state(m, lib.RngCount)["drop"]["rngs"]["count"].value = jnp.uint32(4)
            return m(X)
        return step(model) == 0, lib.to_pure_dict(lib.state(model, lib.RngCount))
    _same(run(nnx), run(flax_nnx))


def test_rng_key_written_inside_a_transform_is_refused_naming_the_stream():
    @nnx.jit
    def step(m):
        nnx.state(m, nnx.RngKey)["drop"]["rngs"]["key"].value = jax.random.key(3)

    with pytest.raises(errors.TransformError, match="'dropout'"):
        step(_model(nnx))
