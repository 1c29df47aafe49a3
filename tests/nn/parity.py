"""Checking a varjax.nn layer against the same layer in flax.linen.

``check_parity(vj_layer, flax_layer, *inputs)``:

1. initializes both with the same key and asserts the variable dicts have the
   same layout (collections, paths, shapes, dtypes);
2. perturbs Flax's parameters with noise, so values that happen to be trivial
   at init (zero biases, unit scales) cannot hide a bug;
3. applies both to the *same* perturbed variables and asserts the outputs,
   and every updated mutable collection, agree within ``atol``.

Returns ``(variables, vj_out, flax_out)`` for further checks.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def layout(variables: Any) -> dict:
    """``{path: (shape, dtype)}`` of a variables dict."""
    flat = jax.tree_util.tree_flatten_with_path(variables)[0]
    return {jax.tree_util.keystr(p): (tuple(np.shape(x)), jnp.result_type(x)) for p, x in flat}


def perturb(variables: dict, seed: int = 1, scale: float = 0.3) -> dict:
    """Adds noise to every float leaf of ``params``; other collections are kept.
    (NumPy noise: jax.random would compile once per parameter shape.)"""
    leaves, tree = jax.tree.flatten(variables.get("params", {}))
    rng = np.random.default_rng(seed)
    noisy = [jnp.asarray(np.asarray(x, np.float32) + scale * rng.standard_normal(np.shape(x)),
                         dtype=x.dtype)
             if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x for x in leaves]
    return {**variables, "params": jax.tree.unflatten(tree, noisy)}


def assert_close(a: Any, b: Any, atol: float) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a), jax.tree.structure(b))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), atol=atol,
                                   rtol=atol)


def check_parity(vj_layer, flax_layer, *inputs, rngs=None, init_rngs=None, mutable=False,
                 method=None, init_kwargs=None, apply_kwargs=None, atol: float = 1e-5):
    init_rngs = jax.random.key(0) if init_rngs is None else init_rngs
    init_kwargs = init_kwargs or {}
    apply_kwargs = apply_kwargs or {}
    kw = {} if method is None else {"method": method}
    flax_vars = flax_layer.init(init_rngs, *inputs, **kw, **init_kwargs)
    vj_vars = vj_layer.init(init_rngs, *inputs, **kw, **init_kwargs)
    assert layout(vj_vars) == layout(flax_vars), (layout(vj_vars), layout(flax_vars))
    variables = perturb(jax.tree.map(jnp.asarray, dict(flax_vars)))
    flax_out = flax_layer.apply(variables, *inputs, rngs=rngs, mutable=mutable, **kw, **apply_kwargs)
    vj_out = vj_layer.apply(variables, *inputs, rngs=rngs, mutable=mutable, **kw, **apply_kwargs)
    if mutable is not False:
        assert layout(vj_out[1]) == layout(flax_out[1])
    assert_close(vj_out, flax_out, atol)
    return variables, vj_out, flax_out
