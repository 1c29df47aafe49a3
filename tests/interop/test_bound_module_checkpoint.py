"""Orbax checkpoints of a bound module: ``Module.bind`` gives a pytree, so a standard
checkpointer saves it and restores it into a bound module target, bit for bit.

Orbax maps every childless node of a tree as a leaf (the empty RNG part of a module bound
without rngs included), so the module must give back whatever a map put there.
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from orbax_io import restore, save

import varjax as vj
import varjax.nn as nn


class Noisy(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.BatchNorm(use_running_average=False)(nn.Dense(3)(x))
        return nn.Dropout(0.5, deterministic=False)(x)


X = jnp.arange(8.0).reshape(2, 4)
VARIABLES = Noisy().init(jax.random.key(0), X)


def _bits(leaf: jax.Array | int) -> np.ndarray:
    leaf = jnp.asarray(leaf)
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


def _assert_same_module(restored: nn.Module, saved: nn.Module) -> None:
    assert type(restored) is type(saved)
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        assert jnp.result_type(a) == jnp.result_type(b)
        np.testing.assert_array_equal(_bits(a), _bits(b))


def _blank(**bind: object) -> nn.Module:
    return Noisy().bind(jax.tree.map(jnp.zeros_like, VARIABLES), **bind)


def test_bound_module_without_rngs_saves_and_restores_bitwise(tmp_path: Path) -> None:
    model = Noisy().bind(VARIABLES, mutable=["batch_stats"])
    save(tmp_path / "ckpt", model)
    restored = restore(tmp_path / "ckpt", _blank(mutable=["batch_stats"]))
    _assert_same_module(restored, model)


def test_bound_module_with_rng_keys_and_with_rngs_restores_its_draws(tmp_path: Path) -> None:
    for i, rngs in enumerate([lambda: {"dropout": jax.random.key(3)}, lambda: vj.Rngs(dropout=3)]):
        model = Noisy().bind(VARIABLES, rngs=rngs(), mutable=["batch_stats"])
        model(X)                          # one call: the restored module continues after it
        save(tmp_path / f"ckpt{i}", model)
        restored = restore(tmp_path / f"ckpt{i}", _blank(rngs=rngs(), mutable=["batch_stats"]))
        _assert_same_module(restored, model)
        np.testing.assert_array_equal(restored(X), model(X))
