"""Checkpoints move between Flax Linen and varjax: the same architecture, written once and
instantiated with ``flax.linen`` and ``varjax.nn``, has the same variable layout, so an Orbax
or msgpack checkpoint of one restores into the other and both compute the same function.

This is what lets a user load a pretrained Linen checkpoint into the varjax port of the model
(and go back) with the standard tools, no conversion code.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import flax.linen
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax_io import restore, save

import varjax.nn

ATOL = 1e-5


def make_model(nn: Any) -> type:
    """The architecture, written once against the ``nn`` namespace it is given."""

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, train: bool = False, deterministic: bool | None = None) -> jax.Array:
            deterministic = not train if deterministic is None else deterministic
            x = nn.Conv(4, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))
            x = nn.Dense(8)(x.reshape((x.shape[0], -1)))
            x = nn.LayerNorm()(x)
            x = nn.Dropout(0.5, deterministic=deterministic)(nn.relu(x))
            return nn.Dense(3)(x)

    return CNN


LINEN = make_model(flax.linen)()
VARJAX = make_model(varjax.nn)()
# An RBG key: XLA:CPU compiles threefry's init programs several times slower, and the key
# implementation has nothing to do with checkpoints.
KEY = jax.random.key(0, impl="rbg")
X = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 8, 1)), jnp.float32)


def _layout(variables: Any) -> dict:
    """``{path: (shape, dtype)}``: the structure a checkpoint has to match."""
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    return {jax.tree_util.keystr(p): (np.shape(x), jnp.result_type(x)) for p, x in flat}


def _trained_looking(variables: dict, seed: int) -> dict:
    """Noise on params and batch statistics (variances kept positive), so no value is an
    initial one that both libraries would produce anyway."""
    rng = np.random.default_rng(seed)

    def noisy(path: tuple, x: jax.Array) -> jax.Array:
        delta = 0.3 * rng.standard_normal(np.shape(x)).astype(np.float32)
        if jax.tree_util.keystr(path).endswith("['var']"):
            delta = np.abs(delta)
        return jnp.asarray(np.asarray(x) + delta)

    return jax.tree_util.tree_map_with_path(noisy, dict(variables))


@functools.cache
def _linen_variables() -> dict:
    return _trained_looking(jax.jit(LINEN.init)(KEY, X), seed=1)     # jit: one compile, not one per op


def _varjax_target() -> dict:
    target = VARJAX.init(KEY, X)
    assert _layout(target) == _layout(_linen_variables())
    return target


def _assert_close(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=ATOL, rtol=ATOL)


TRAIN = dict(train=True, deterministic=True, mutable=["batch_stats"])


@jax.jit
def _linen_eval(variables: dict) -> jax.Array:
    """Linen under ``jax.jit``: one compile instead of one per op."""
    return LINEN.apply(variables, X)


@jax.jit
def _linen_train(variables: dict) -> tuple[jax.Array, dict]:
    return LINEN.apply(variables, X, **TRAIN)


def _assert_same_eval_outputs(linen_variables: dict, varjax_variables: dict) -> None:
    _assert_close(VARJAX.apply(varjax_variables, X), _linen_eval(linen_variables))


def test_linen_orbax_checkpoint_restores_into_varjax_model_with_same_outputs_and_batch_stats(
        tmp_path: Path) -> None:
    linen_variables = _linen_variables()
    save(tmp_path / "ckpt", linen_variables)
    restored = restore(tmp_path / "ckpt", _varjax_target())
    _assert_close(restored, linen_variables)

    _assert_same_eval_outputs(linen_variables, restored)
    linen_out, linen_updates = _linen_train(linen_variables)
    varjax_out, varjax_updates = VARJAX.apply(restored, X, **TRAIN)
    _assert_close(varjax_out, linen_out)
    _assert_close(varjax_updates, linen_updates)
    # The update is a real one (the check above could not pass on stale statistics).
    with pytest.raises(AssertionError):
        _assert_close(varjax_updates["batch_stats"], restored["batch_stats"])


def test_varjax_orbax_checkpoint_restores_into_linen_model_with_same_outputs(tmp_path: Path) -> None:
    varjax_variables = _trained_looking(_varjax_target(), seed=2)
    save(tmp_path / "ckpt", varjax_variables)
    # An abstract target: Linen's init is never run, only its layout is needed.
    restored = restore(tmp_path / "ckpt", jax.eval_shape(LINEN.init, KEY, X))
    _assert_close(restored, varjax_variables)
    _assert_same_eval_outputs(restored, varjax_variables)


def test_linen_msgpack_bytes_restore_into_varjax_model_with_same_outputs() -> None:
    linen_variables = _linen_variables()
    restored = flax.serialization.from_bytes(_varjax_target(), flax.serialization.to_bytes(linen_variables))
    _assert_close(restored, linen_variables)
    _assert_same_eval_outputs(linen_variables, restored)
