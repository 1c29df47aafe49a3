"""``nnx.Dropout`` holds its forked stream bare, as flax.nnx 0.12.8 does (``rngs/key``,
``rngs/count``): its state, and its masks eagerly, under ``nnx.jit`` and in an ensemble made
and applied by ``nnx.vmap``, bitwise flax.nnx's from the same seeds."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as fnnx

from varjax import nnx as vnnx
from varjax.nnx.stochastic import Dropout

X = jnp.arange(1.0, 9.0).reshape(2, 4)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def pure(nnx, node) -> dict:
    """A state as nested dicts of numpy arrays (keys as their key data)."""
    def plain(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)
    return jax.tree.map(plain, nnx.to_pure_dict(nnx.state(node)))


def bitwise(ours, theirs) -> None:
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def model(nnx, drop, rngs):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = drop(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))
    return Net(rngs)


def pair(**seeds):
    return (model(vnnx, Dropout, vnnx.Rngs(**seeds)),
            model(fnnx, fnnx.Dropout, fnnx.Rngs(**seeds)))


def test_dropout_stream_is_bare_at_flax_nnx_path():
    ours, theirs = pair(params=0, dropout=1)
    state = pure(vnnx, ours)
    assert set(state["drop"]["rngs"]) == {"key", "count"}
    bitwise(state, pure(fnnx, theirs))


def test_dropout_forks_the_default_stream_when_rngs_has_no_dropout_stream():
    ours, theirs = pair(default=3)
    assert ours.drop.rngs.tag == theirs.drop.rngs.tag == "default"
    bitwise(pure(vnnx, ours), pure(fnnx, theirs))


def test_dropout_masks_under_nnx_jit_match_flax_nnx_and_advance_the_stream():
    ours, theirs = pair(params=0, dropout=1)
    v_call = vnnx.jit(lambda m, x: m(x))
    f_call = fnnx.jit(lambda m, x: m(x))
    for calls in (1, 2):
        np.testing.assert_array_equal(v_call(ours, X), f_call(theirs, X))
        assert int(ours.drop.rngs.count) == calls
    bitwise(pure(vnnx, ours), pure(fnnx, theirs))


def test_dropout_ensemble_made_and_applied_by_nnx_vmap_matches_flax_nnx():
    def ensemble(nnx, drop):
        make = nnx.vmap(lambda r: model(nnx, drop, r))
        return make(nnx.Rngs(params=0, dropout=1).fork(split=3))
    ours, theirs = ensemble(vnnx, Dropout), ensemble(fnnx, fnnx.Dropout)
    bitwise(pure(vnnx, ours), pure(fnnx, theirs))
    assert ours.drop.rngs.key.shape == (3,)
    xs = jnp.stack([X, 2 * X, 3 * X])
    np.testing.assert_array_equal(vnnx.vmap(lambda m, x: m(x))(ours, xs),
                                  fnnx.vmap(lambda m, x: m(x))(theirs, xs))
    bitwise(pure(vnnx, ours), pure(fnnx, theirs))
    np.testing.assert_array_equal(ours.drop.rngs.count, [1, 1, 1])
