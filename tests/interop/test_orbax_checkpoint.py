"""Orbax checkpoints of varjax state: variables (params, batch_stats, RNG-stream state) and a
whole training state (variables, Optax state, step) survive a save/restore bit-exactly.

varjax keeps everything a model needs to continue -- including its dropout stream's key and
count in collection ``rngs`` -- in the plain variables dict, so a standard Orbax checkpoint of
that dict is a complete one: resuming from it reproduces the uninterrupted run bitwise.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from orbax_io import restore, save

import varjax as vj
import varjax.nn as nn


class Classifier(nn.Module):
    """Dense + BatchNorm + Dropout: params, batch_stats and (with a ``vj.Rngs`` init) RNG
    state, the three kinds of state a checkpoint has to carry."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
        return nn.Dense(3)(x)


MODEL = Classifier()
TX = optax.adam(1e-2)


def _data(seed: int = 0) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((8, 5)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 8), jnp.int32)
    return x, y


def _init(x: jax.Array, params_seed: int = 0, dropout_seed: int = 1) -> dict:
    return MODEL.init(vj.Rngs(params=params_seed, dropout=dropout_seed), x)


def _comparable(leaf: jax.Array) -> np.ndarray:
    """Typed PRNG keys have no NumPy form; their key data is what identifies them."""
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(leaf))
    return np.asarray(leaf)


def _assert_bit_exact(restored: Any, original: Any) -> None:
    assert jax.tree.structure(restored) == jax.tree.structure(original)
    flat_restored = jax.tree_util.tree_leaves_with_path(restored)
    for (path, got), want in zip(flat_restored, jax.tree.leaves(original)):
        where = jax.tree_util.keystr(path)
        assert got.dtype == want.dtype, where
        assert got.shape == want.shape, where
        np.testing.assert_array_equal(_comparable(got), _comparable(want), err_msg=where)


def test_variables_with_params_batch_stats_and_rng_state_restore_bit_exactly(tmp_path: Path) -> None:
    x, _ = _data()
    variables = _init(x)
    assert set(variables) == {"params", "batch_stats", "rngs"}
    assert jnp.issubdtype(variables["rngs"]["dropout"]["key"].dtype, jax.dtypes.prng_key)
    # Move batch_stats and the dropout count off their initial values, as training would, so
    # that a restore which kept the target's values would be caught.
    noise = np.random.default_rng(1)
    moved = jax.tree.map(lambda s: s + noise.random(s.shape, np.float32), variables["batch_stats"])
    variables = {
        **variables,
        "batch_stats": moved,
        "rngs": {"dropout": {**variables["rngs"]["dropout"], "count": jnp.uint32(5)}},
    }

    save(tmp_path / "ckpt", variables)
    # A target from other seeds: every restored value must come from the checkpoint.
    restored = restore(tmp_path / "ckpt", _init(x, params_seed=7, dropout_seed=8))

    _assert_bit_exact(restored, variables)


def _loss_fn(params: dict, variables: dict, x: jax.Array, y: jax.Array) -> tuple[jax.Array, dict]:
    logits, updates = MODEL.apply({**variables, "params": params}, x, train=True,
                                  mutable=["batch_stats", "rngs"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, updates


@jax.jit
def _train_step(state: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
    """One Adam step; dropout draws from the implicit ``rngs`` state, so its count is part of
    ``state`` and advances with it."""
    variables = state["variables"]
    (loss, updates), grads = jax.value_and_grad(_loss_fn, has_aux=True)(variables["params"], variables,
                                                                         x, y)
    with jax.numpy_dtype_promotion("standard"):      # Adam's bias correction: float ** int32 count
        param_updates, opt_state = TX.update(grads, state["opt_state"], variables["params"])
    params = optax.apply_updates(variables["params"], param_updates)
    new_state = {"variables": {**variables, **updates, "params": params}, "opt_state": opt_state,
                 "step": state["step"] + 1}
    return new_state, loss


def _fresh_state(x: jax.Array, params_seed: int = 0, dropout_seed: int = 1) -> dict:
    """Committed to one device, as Orbax restores arrays: the uninterrupted and the resumed run
    then share one compilation of ``_train_step``, so bitwise equality is well posed."""
    variables = _init(x, params_seed, dropout_seed)
    state = {"variables": variables, "opt_state": TX.init(variables["params"]), "step": jnp.int32(0)}
    return jax.device_put(state, jax.devices()[0])


def test_resuming_training_from_a_checkpoint_reproduces_the_next_loss_bitwise(tmp_path: Path) -> None:
    x, y = _data()
    steps_before_checkpoint = 3
    state = _fresh_state(x)
    for _ in range(steps_before_checkpoint):
        state, _ = _train_step(state, x, y)
    assert int(state["variables"]["rngs"]["dropout"]["count"]) == steps_before_checkpoint
    save(tmp_path / "ckpt", state)
    _, uninterrupted_loss = _train_step(state, x, y)

    restored = restore(tmp_path / "ckpt", _fresh_state(x, params_seed=7, dropout_seed=8))
    assert int(restored["step"]) == steps_before_checkpoint
    _, resumed_loss = _train_step(restored, x, y)
    np.testing.assert_array_equal(np.asarray(resumed_loss), np.asarray(uninterrupted_loss))

    # The RNG state is what makes this exact: restarting the dropout stream changes the loss.
    reseeded = jax.device_put({**restored, "variables": vj.reseed(restored["variables"], dropout=1)},
                              jax.devices()[0])
    _, reseeded_loss = _train_step(reseeded, x, y)
    assert not np.array_equal(np.asarray(reseeded_loss), np.asarray(uninterrupted_loss))
