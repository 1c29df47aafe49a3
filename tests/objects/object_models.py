"""Small models and helpers shared by the object-mode tests (``tests/objects``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import varjax.nn as nn


class Lin(nn.Module):
    """One Dense layer: params ``Dense_0/{kernel,bias}``."""

    features: int = 2

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features)(x)


class MLP(nn.Module):
    """Dense -> BatchNorm (batch_stats updated when training) -> Dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.5)(x)
        return nn.Dense(2)(x)


class Foo(nn.Module):
    """The design note's two-variable module: params ``x`` and ``y`` made in setup."""

    def setup(self):
        self.x = self.param("x", lambda key: jnp.array([0.5, 1.0]))
        self.y = self.param("y", lambda key: jnp.array([2.0, -1.0]))

    def __call__(self):
        return jnp.sin(self.x) * self.y


class Probe(nn.Module):
    """Sows the input mean and the hidden layer; perturbs the input and the hidden layer."""

    @nn.compact
    def __call__(self, x):
        self.sow("intermediates", "y_mean", jnp.mean(x))
        x = self.perturb("grad_of_x", x)
        h = nn.Dense(3)(x)
        h = self.perturb("h", h)
        self.sow("intermediates", "h", h)
        return nn.Dense(2)(h)


X = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3) / 6.0


def bound(module, x=X, seed=0, **bind_kw):
    """``module`` initialised on ``x`` and bound to its variables; also the variables."""
    variables = module.init(jax.random.key(seed), x)
    return module.bind(variables, **bind_kw), variables


def assert_tree_close(actual, expected, atol=1e-6):
    assert jax.tree.structure(actual) == jax.tree.structure(expected), (
        jax.tree.structure(actual), jax.tree.structure(expected))
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5)
