"""The 12-block residual MLP, once in pure JAX and once through ``vj.functionalize``.

Block: Dense -> LayerNorm -> relu -> Dense, plus the residual; width 256, batch 8.
The math is written once (``residual_mlp``) and takes a ``param(name, init_fn,
shape)`` getter: pure JAX looks names up in a dict, varjax passes ``vj.param``.
So both sides trace the same equations and use the same initializers
(``lecun_normal`` kernels, zero biases, LayerNorm scale ones / bias zeros), and
any time difference is varjax's own tracing, pass pipeline and caching.

LayerNorm is computed by hand (eps 1e-6) rather than through a library so the
later Flax comparisons can match it exactly.

Sharp edges:
  * ``pure_init`` runs the forward pass to create parameters, as Flax and
    varjax ``init`` do (shapes come from the inputs), so "init" compares like
    with like; a hand-written init that only allocates would trace less.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import varjax as vj

WIDTH = 256
BATCH = 8
DEPTH = 12
EPS = 1e-6

Param = Callable[[str, Callable[..., Any], tuple[int, ...]], jax.Array]

kernel_init = jax.nn.initializers.lecun_normal()


def dense(x: jax.Array, param: Param, name: str) -> jax.Array:
    kernel = param(f"{name}_kernel", kernel_init, (x.shape[-1], WIDTH))
    bias = param(f"{name}_bias", jax.nn.initializers.zeros, (WIDTH,))
    return x @ kernel + bias


def layer_norm(x: jax.Array, param: Param, name: str) -> jax.Array:
    scale = param(f"{name}_scale", jax.nn.initializers.ones, (x.shape[-1],))
    bias = param(f"{name}_bias", jax.nn.initializers.zeros, (x.shape[-1],))
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    return centered * jax.lax.rsqrt(var + EPS) * scale + bias


def residual_mlp(x: jax.Array, param: Param) -> jax.Array:
    for i in range(DEPTH):
        h = dense(x, param, f"block{i}_dense0")
        h = layer_norm(h, param, f"block{i}_ln")
        h = jax.nn.relu(h)
        x = x + dense(h, param, f"block{i}_dense1")
    return x


def pure_apply(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return residual_mlp(x, lambda name, init_fn, shape: params[name])


def pure_init(key: jax.Array, x: jax.Array) -> dict[str, jax.Array]:
    """Create every parameter while running the model; keys fold a counter
    into ``key``, as ``vj.make_rng`` does."""
    params: dict[str, jax.Array] = {}

    def create(name: str, init_fn: Callable[..., Any], shape: tuple[int, ...]) -> jax.Array:
        params[name] = init_fn(jax.random.fold_in(key, len(params)), shape)
        return params[name]

    residual_mlp(x, create)
    return params


def varjax_mlp() -> Any:
    """A new functionalized model around a new function object: empty caches."""
    def model(x: jax.Array) -> jax.Array:
        return residual_mlp(x, vj.param)
    return vj.functionalize(model)


def inputs() -> tuple[jax.Array, jax.Array]:
    """``(key, x)`` for every benchmark of this model."""
    key = jax.random.key(0)
    return key, jax.random.normal(jax.random.fold_in(key, 1), (BATCH, WIDTH))


def check_same_model(key: jax.Array, x: jax.Array) -> dict[str, jax.Array]:
    """Fail loudly unless both models have the same parameters and outputs;
    return the parameters the benchmarks use."""
    params = pure_init(key, x)
    model = varjax_mlp()
    variables = model.init(key, x)
    def shapes(tree):
        return jax.tree.map(lambda a: (a.shape, a.dtype), tree)

    if shapes(variables) != shapes({"params": params}):
        raise AssertionError("varjax init and pure JAX init disagree on parameter names/shapes")
    np.testing.assert_allclose(model.apply({"params": params}, x), pure_apply(params, x),
                               rtol=1e-5, atol=1e-5)
    return params


def module_mlp(nn: Any) -> Any:
    """The same residual MLP as a Linen-style module class, written once for any ``nn``
    namespace: ``module_mlp(varjax.nn)`` and ``module_mlp(flax.linen)`` differ only in
    that argument -- the one-import port the Module system promises."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(WIDTH)(x)
            h = nn.relu(nn.LayerNorm(epsilon=EPS)(h))
            return x + nn.Dense(WIDTH)(h)

    class ResidualMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(DEPTH):
                x = Block()(x)
            return x

    return ResidualMLP
