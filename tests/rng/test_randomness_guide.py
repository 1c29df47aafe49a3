"""The Flax NNX "Randomness" guide, ported to varjax's Linen-style modules.

Each example of the guide is a test: a ``vj.Rngs`` drawn from (and advanced) by
``init``/``apply``, explicit keys, ``rngs.fork(split=n)`` through ``jax.vmap``,
``vj.reseed`` reproducing an earlier output, and recurrent dropout in a scanned cell
whose mask is the same at every step.  Expected values are computed by hand from the
documented key derivation: the i-th draw from a stream kept as state is ``fold_in(key, count + i)``
(NNX's convention); an explicit key follows Linen's (``tests/rng/test_linen_rng.py``).
"""
import jax
import jax.numpy as jnp
import numpy as np

import varjax as vj
import varjax.nn as nn
from varjax.ir import streams

WIDTH = 64    # wide enough that two independent rate-0.5 masks are never equal in practice
RATE = 0.5


def _normal(shape, seed=0):
    # NumPy draws: no XLA compile per shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _key_data(key):
    return np.asarray(jax.random.key_data(key))


class Model(nn.Module):
    """The guide's model: ``relu(dropout(linear(x)))``."""

    @nn.compact
    def __call__(self, x, train=True):
        return nn.relu(nn.Dropout(RATE, deterministic=not train)(nn.Dense(WIDTH)(x)))


@jax.jit
def _by_hand(variables, x, key):
    """``Model`` computed without varjax, its dropout mask drawn from ``key``."""
    p = variables["params"]["Dense_0"]
    h = x @ p["kernel"] + p["bias"].reshape((1,) * (x.ndim - 1) + (-1,))
    keep = jax.random.bernoulli(key, 1.0 - RATE, h.shape)
    return jnp.maximum(jnp.where(keep, h / (1.0 - RATE), 0.0), 0.0)


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# -- 1. explicit Rngs, advanced in place ---------------------------------------------------

def test_rngs_passed_to_init_and_apply_is_advanced_so_each_apply_drops_out_differently():
    model = Model()
    rngs = vj.Rngs(0)
    variables = model.init(rngs, jnp.ones((2, 8), jnp.float32))
    assert set(variables) == {"params", "rngs"}
    after_init = int(rngs.default.count)
    assert after_init > 0                                   # init drew from the Rngs
    np.testing.assert_array_equal(variables["rngs"]["default"]["count"], 0)   # kept fresh

    x = rngs.normal((2, 8))                                 # a draw like any other
    np.testing.assert_array_equal(
        x, jax.random.normal(jax.random.fold_in(jax.random.key(0), after_init), (2, 8)))
    assert int(rngs.default.count) == after_init + 1

    y1 = model.apply(variables, x, rngs=rngs)
    assert int(rngs.default.count) == after_init + 2       # one dropout draw, kept by the Rngs
    y2 = model.apply(variables, x, rngs=rngs)
    assert int(rngs.default.count) == after_init + 3
    assert not np.array_equal(y1, y2)
    key0 = jax.random.key(0)
    _close(y1, _by_hand(variables, x, jax.random.fold_in(key0, after_init + 1)))
    _close(y2, _by_hand(variables, x, jax.random.fold_in(key0, after_init + 2)))


def test_explicit_dropout_key_gives_the_same_output_for_the_same_key():
    model = Model()
    variables = model.init(vj.Rngs(0), jnp.ones((2, 8), jnp.float32))
    x = _normal((2, 8))
    key, other = jax.random.key(5), jax.random.key(6)
    a = model.apply(variables, x, rngs={"dropout": key})
    b = model.apply(variables, x, rngs={"dropout": key})
    c = model.apply(variables, x, rngs={"dropout": other})
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # explicit keys follow Linen: the first draw of module Dropout_0
    _close(a, _by_hand(variables, x, streams.derive_at(key, ("Dropout_0",), 1)))


# -- 2. fork(split=n) through jax.vmap ------------------------------------------------------

def test_forked_rngs_through_jax_vmap_give_each_member_its_own_dropout_mask():
    model = Model()
    rngs = vj.Rngs(0)
    variables = model.init(rngs, jnp.ones((8,), jnp.float32))
    before = int(rngs.default.count)
    forked = rngs.fork(split=5)
    assert int(rngs.default.count) == before + 1           # the fork is one draw from the parent
    keys = jax.random.split(jax.random.fold_in(jax.random.key(0), before), 5)
    np.testing.assert_array_equal(_key_data(forked.default.key), _key_data(keys))
    np.testing.assert_array_equal(forked.default.count, np.zeros(5, np.uint32))

    xs = jnp.broadcast_to(_normal((8,)), (5, 8))            # one input: only the masks differ
    ys = jax.vmap(lambda r, x: model.apply(variables, x, rngs=r))(forked, xs)
    assert ys.shape == (5, WIDTH)
    rows = {tuple(np.asarray(y != 0).tolist()) for y in ys}
    assert len(rows) == 5                                   # five different masks
    for i in range(5):
        # member i is stream (key=keys[i], count=0): its dropout key is fold_in(keys[i], 0)
        _close(ys[i], _by_hand(variables, xs[i], jax.random.fold_in(keys[i], 0)))
        np.testing.assert_array_equal(ys[i], model.apply(variables, xs[i], rngs=vj.Rngs(keys[i])))


# -- 3. reseed reproduces an earlier output -------------------------------------------------

def test_reseed_restarts_the_dropout_stream_and_reproduces_the_first_output():
    model = Model()
    x = _normal((2, 8))
    variables = model.init(vj.Rngs(params=0, dropout=1), x, train=False)
    assert set(variables["rngs"]) == {"dropout"}            # params is not kept as state
    assert int(variables["rngs"]["dropout"]["count"]) == 0  # deterministic init drew no dropout key

    y1, state = model.apply(variables, x, train=True, mutable=["rngs"])
    assert int(state["rngs"]["dropout"]["count"]) == 1
    variables = {**variables, **state}
    y2, state = model.apply(variables, x, train=True, mutable=["rngs"])
    assert int(state["rngs"]["dropout"]["count"]) == 2
    variables = {**variables, **state}
    assert not np.array_equal(y1, y2)

    reseeded = vj.reseed(variables, dropout=1)
    assert int(reseeded["rngs"]["dropout"]["count"]) == 0
    assert int(variables["rngs"]["dropout"]["count"]) == 2  # a copy: the original is unchanged
    y3, state = model.apply(reseeded, x, train=True, mutable=["rngs"])
    np.testing.assert_array_equal(y3, y1)                   # bitwise the first output
    assert int(state["rngs"]["dropout"]["count"]) == 1


# -- 4. recurrent dropout -------------------------------------------------------------------

HIDDEN, STEPS = 16, 20


class Cell(nn.Module):
    """``h -> relu(Dense(concat([dropout(h), x])))``, counting its steps in ``counts/n``.

    The dropout is written as ``h * Dropout(ones)`` so that the mask it draws is returned
    and observed at every step; at rate 0.5 kept entries are scaled by exactly 2, so this
    is bitwise ``Dropout(h)``."""

    @nn.compact
    def __call__(self, h, x):
        mask = nn.Dropout(RATE, deterministic=False, rng_collection="recurrent_dropout")(
            jnp.ones_like(h))
        h = nn.relu(nn.Dense(HIDDEN)(jnp.concatenate([h * mask, x], axis=-1)))
        n = self.variable("counts", "n", lambda: jnp.zeros((), jnp.int32))
        n.value = n.value + 1
        return h, (h, mask)


class RNN(nn.Module):
    split: bool = False

    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Cell, variable_broadcast="params", variable_carry="counts",
                       split_rngs={"params": False, "recurrent_dropout": self.split},
                       in_axes=1, out_axes=1)
        return scan()(jnp.zeros((x.shape[0], HIDDEN), jnp.float32), x)


def _masks_per_step(masks):
    return [tuple(np.asarray(masks[:, t]).ravel().tolist()) for t in range(masks.shape[1])]


def test_recurrent_dropout_uses_one_mask_for_every_step_and_a_new_one_per_apply():
    x = _normal((4, STEPS, 8))
    model = RNN()
    variables = model.init(vj.Rngs(params=0, recurrent_dropout=1), x)
    assert int(variables["counts"]["ScanCell_0"]["n"]) == STEPS
    assert int(variables["rngs"]["recurrent_dropout"]["count"]) == 0   # init returns it fresh

    (h, (hs, masks)), state = model.apply(variables, x, mutable=["counts", "rngs"])
    assert hs.shape == masks.shape == (4, STEPS, HIDDEN)
    assert int(state["counts"]["ScanCell_0"]["n"]) == 2 * STEPS         # +20 per apply
    assert int(state["rngs"]["recurrent_dropout"]["count"]) == 1        # one key per scan call
    steps = _masks_per_step(masks)
    assert len(set(steps)) == 1                                         # the same mask at all 20 steps
    mask = np.asarray(masks[:, 0])
    assert 0.0 < float((mask == 0).mean()) < 1.0
    np.testing.assert_array_equal(np.unique(mask), [0.0, 1.0 / (1.0 - RATE)])

    # the output is the RNN run by hand with that mask at every step
    p = variables["params"]["ScanCell_0"]["Dense_0"]
    h_ref, hs_ref = jnp.zeros((4, HIDDEN), jnp.float32), []
    for t in range(STEPS):
        h_ref = jnp.maximum(jnp.concatenate([h_ref * mask, x[:, t]], -1) @ p["kernel"] + p["bias"][None],
                            0.0)
        hs_ref.append(h_ref)
    _close(hs, jnp.stack(hs_ref, 1))
    _close(h, h_ref)

    # the state that came back draws a new mask on the next apply (same for all steps again)
    (_, (_, masks2)), state2 = model.apply({**variables, **state}, x, mutable=["counts", "rngs"])
    assert int(state2["counts"]["ScanCell_0"]["n"]) == 3 * STEPS
    steps2 = _masks_per_step(masks2)
    assert len(set(steps2)) == 1 and steps2[0] != steps[0]


def test_recurrent_dropout_split_along_the_steps_gives_a_new_mask_per_step():
    x = _normal((4, STEPS, 8))
    model = RNN(split=True)
    variables = model.init(vj.Rngs(params=0, recurrent_dropout=1), x)
    (_, (hs, masks)), state = model.apply(variables, x, mutable=["counts", "rngs"])
    assert hs.shape == (4, STEPS, HIDDEN)
    assert len(set(_masks_per_step(masks))) == STEPS
    assert int(state["counts"]["ScanCell_0"]["n"]) == 2 * STEPS
