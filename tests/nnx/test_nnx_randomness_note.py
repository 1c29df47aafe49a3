"""The code examples of Flax's NNX Randomness guide (/work/shared/design/004, "Randomness"),
each run as written with ``from varjax import nnx`` and with ``from flax import nnx`` from
the same seeds: keys, counts, parameters and dropout masks compared bitwise, outputs to
1e-6.  ``nnx.display(...)`` lines are replaced by comparing what they would show: the
object's state.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax import random

from varjax import nnx as varjax_nnx


def _pure(nnx: Any, node: Any) -> dict:
    return nnx.to_pure_dict(nnx.state(node))


def _plain(x: Any) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = random.key_data(x)
    return np.asarray(x)


def _bitwise(ours: Any, theirs: Any) -> None:
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        a, b = _plain(a), _plain(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def _close(ours: Any, theirs: Any) -> None:
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6)


def _both(example: Callable[[Any], tuple[Any, Any]]) -> None:
    """``example(nnx) -> (exact, outputs)`` in both libraries: ``exact`` (keys, counts,
    parameters, masks) compared bitwise, ``outputs`` to 1e-6."""
    exact, outputs = example(varjax_nnx)
    flax_exact, flax_outputs = example(flax_nnx)
    _bitwise(exact, flax_exact)
    _close(outputs, flax_outputs)


def test_note_intro_model_with_explicit_rngs_matches_flax():
    def example(nnx):
        class Model(nnx.Module):
            def __init__(self, *, rngs: nnx.Rngs):
                self.linear = nnx.Linear(20, 10, rngs=rngs)
                self.drop = nnx.Dropout(0.1)

            def __call__(self, x, *, rngs):
                return nnx.relu(self.drop(self.linear(x), rngs=rngs))

        rngs = nnx.Rngs(0)
        model = Model(rngs=rngs)
        x = rngs.normal((32, 20))
        y = model(x, rngs=rngs)
        return (_pure(nnx, model), _pure(nnx, rngs), x, y == 0), y
    _both(example)


def test_note_named_streams_draw_fold_in_keys_and_count_matches_flax():
    def example(nnx):
        rngs = nnx.Rngs(params=0, dropout=random.key(1))
        before = _pure(nnx, rngs)
        params_key = rngs.params()
        dropout_key = rngs.dropout()
        after = _pure(nnx, rngs)
        for name in ("params", "dropout"):     # "the key attribute does not change"
            _bitwise(after[name]["key"], before[name]["key"])
            assert after[name]["count"] == before[name]["count"] + 1
        return (before, params_key, dropout_key, after), ()
    _both(example)


def test_note_linear_draws_params_and_dropout_draws_dropout_stream_matches_flax():
    def example(nnx):
        rngs = nnx.Rngs(params=0, dropout=random.key(1))
        rngs.params(), rngs.dropout()
        linear = nnx.Linear(20, 10, rngs=rngs)
        dropout = nnx.Dropout(0.5)
        y = dropout(jnp.ones(4), rngs=rngs)
        np.testing.assert_array_equal(y, jnp.array([2.0, 0.0, 2.0, 2.0]))   # as printed
        return (_pure(nnx, linear), y, _pure(nnx, rngs)), ()
    _both(example)


def test_note_default_stream_is_the_fallback_and_the_rngs_call_matches_flax():
    def example(nnx):
        rngs = nnx.Rngs(0, params=1)
        key1 = rngs.params()
        key2 = rngs.dropout()
        key3 = rngs()
        return (key1, key2, key3, _pure(nnx, rngs)), ()
    _both(example)


def test_note_jax_random_shorthand_methods_match_flax():
    def example(nnx):
        rngs = nnx.Rngs(0, params=1)
        z1 = jax.random.normal(rngs(), (2, 3))
        z2 = jax.random.bernoulli(rngs.params(), 0.5, (10,))
        z3 = rngs.normal((2, 3))
        z4 = rngs.params.bernoulli(0.5, (10,))
        return (z1, z2, z3, z4, _pure(nnx, rngs)), ()
    _both(example)


def test_note_fork_and_vmap_over_forked_rngs_matches_flax():
    def example(nnx):
        class Model(nnx.Module):
            def __init__(self, rngs: nnx.Rngs):
                self.linear = nnx.Linear(20, 10, rngs=rngs)
                self.drop = nnx.Dropout(0.1)

            def __call__(self, x, rngs):
                return nnx.relu(self.drop(self.linear(x), rngs=rngs))
        model = Model(rngs=nnx.Rngs(0))

        @nnx.vmap(in_axes=(None, 0, 0), out_axes=0)
        def model_forward(model, x, rngs):
            return model(x, rngs=rngs)
        dropout_rngs = nnx.Rngs(1)
        forked_rngs = dropout_rngs.fork(split=5)
        forked = (_pure(nnx, dropout_rngs), _pure(nnx, forked_rngs))
        y = model_forward(model, jnp.ones((5, 20)), forked_rngs)
        assert y.shape == (5, 10)
        assert forked_rngs.default.key.shape == forked_rngs.default.count.shape == (5,)
        return (forked, _pure(nnx, forked_rngs), _pure(nnx, model), y == 0), y
    _both(example)


def _implicit_model(nnx: Any) -> type:
    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear = nnx.Linear(20, 10, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(self.drop(self.linear(x)))
    return Model


def _model_state(nnx: Any, model: Any) -> dict:
    return _pure(nnx, model)


def test_note_implicit_random_state_in_the_module_matches_flax():
    def example(nnx):
        model = _implicit_model(nnx)(nnx.Rngs(params=0, dropout=1))
        y = model(x=jnp.ones((1, 20)))
        assert y.shape == (1, 10)
        return (_model_state(nnx, model), y == 0), y
    _both(example)


def test_note_reseed_repeats_the_first_dropout_mask_matches_flax():
    def example(nnx):
        model = _implicit_model(nnx)(nnx.Rngs(params=0, dropout=1))
        x = jnp.ones((1, 20))
        y1 = model(x)
        y2 = model(x)
        nnx.reseed(model, dropout=1)
        y3 = model(x)
        assert not jnp.allclose(y1, y2)
        assert jnp.allclose(y1, y3)
        return (_model_state(nnx, model), y1 == 0, y2 == 0, y3 == 0), (y1, y2, y3)
    _both(example)


def test_note_filtering_random_state_by_type_and_stream_name_matches_flax():
    def example(nnx):
        model = _implicit_model(nnx)(nnx.Rngs(params=0, dropout=1))
        rng_state = nnx.state(model, nnx.RngState)    # all random states
        key_state = nnx.state(model, nnx.RngKey)      # only PRNG keys
        count_state = nnx.state(model, nnx.RngCount)  # only counts
        rng_dropout_state = nnx.state(model, "dropout")    # only `dropout`
        tags = {v.tag for v in jax.tree.leaves(rng_dropout_state, is_leaf=lambda v: isinstance(
            v, nnx.Variable))}
        assert tags == {"dropout"}
        states = (rng_state, key_state, count_state, rng_dropout_state)
        return tuple(nnx.to_pure_dict(s) for s in states), ()
    _both(example)


def test_note_forking_implicit_random_state_with_state_axes_matches_flax():
    def example(nnx):
        model = _implicit_model(nnx)(nnx.Rngs(params=0, dropout=1))
        x = jnp.ones((1, 20))
        rng_axes = nnx.StateAxes({"dropout": 0, ...: None})

        @nnx.fork_rngs(split={"dropout": 5})
        @nnx.vmap(in_axes=(rng_axes, None), out_axes=0)
        def sample_from_model(model, x):
            return model(x)
        y = sample_from_model(model, x)
        assert y.shape == (5, 1, 10)
        return (_model_state(nnx, model), y == 0), (y,)
    _both(example)


def _recurrent_dropout(nnx: Any) -> tuple[Any, Any]:
    """The note's "Transforming implicit state" example as written: an RNNCell whose Dropout
    draws from a ``recurrent_dropout`` stream, unrolled by ``nnx.scan`` inside ``nnx.jit``
    with that stream broadcast (the same mask every step) and the rest of the cell carried
    (its counter counts the steps)."""
    class Count(nnx.Variable):
        pass

    class RNNCell(nnx.Module):
      def __init__(self, din, dout, rngs):
        self.linear = nnx.Linear(dout + din, dout, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs, rng_collection='recurrent_dropout')
        self.dout = dout
        self.count = Count(jnp.array(0, jnp.uint32))

      def __call__(self, h, x) -> tuple[jax.Array, jax.Array]:
        h = self.drop(h) # Recurrent dropout.
        y = nnx.relu(self.linear(jnp.concatenate([h, x], axis=-1)))
        self.count.value += 1
        return y, y

      def initial_state(self, batch_size: int):
        return jnp.zeros((batch_size, self.dout))

    cell = RNNCell(8, 16, nnx.Rngs(params=0, recurrent_dropout=1))

    @nnx.jit
    def rnn_forward(cell: RNNCell, x: jax.Array):
      h = cell.initial_state(batch_size=x.shape[0])

      # Broadcast the 'recurrent_dropout' PRNG state to have the same mask on every step.
      state_axes = nnx.StateAxes({'recurrent_dropout': None, ...: nnx.Carry})
      @nnx.scan(in_axes=(state_axes, nnx.Carry, 1), out_axes=(nnx.Carry, 1))
      def unroll(cell: RNNCell, h, x) -> tuple[jax.Array, jax.Array]:
        h, y = cell(h, x)
        return h, y

      h, y = unroll(cell, h, x)
      return y

    x = jnp.ones((4, 20, 8))
    y = rnn_forward(cell, x)
    assert y.shape == (4, 20, 16)
    assert cell.count.value == 20 and cell.count.value.dtype == jnp.uint32
    return cell, y


def test_note_recurrent_dropout_scan_with_state_axes_matches_flax():
    """y, the counter (20), the broadcast stream's count (its updates are not kept, so 0)
    and every Variable of the cell after the call: flax.nnx's."""
    def example(nnx):
        cell, y = _recurrent_dropout(nnx)
        assert int(cell.drop.rngs.count[...]) == 0
        return _pure(nnx, cell), (y,)
    _both(example)


def test_note_recurrent_dropout_without_graph_updates_beyond_flax():
    """With graph updates off the StateAxes keeps its meaning (flax.nnx refuses it there):
    the same outputs and Variables as flax.nnx's default."""
    with flax_nnx.set_graph_updates(False), pytest.raises(ValueError, match="StateAxes"):
        _recurrent_dropout(flax_nnx)
    with varjax_nnx.set_graph_updates(False):
        cell, y = _recurrent_dropout(varjax_nnx)
    theirs, fy = _recurrent_dropout(flax_nnx)
    _bitwise(_pure(varjax_nnx, cell), _pure(flax_nnx, theirs))
    _close(y, fy)
