"""Helpers the lifted-transform tests share (imported as ``transform_checks``: pytest puts
this folder on ``sys.path``, as it does ``tests/nn`` for ``parity``)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ATOL = 1e-5


def data(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    """Standard-normal test input (NumPy draws: no XLA compile per input shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def close(a: Any, b: Any, atol: float = ATOL) -> None:
    """``a`` and ``b`` (arrays or pytrees of them) have one structure and agree within ``atol``."""
    a, b = jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b)
    assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a),
                                                            jax.tree.structure(b))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, atol=atol, rtol=atol)


def shapes(tree: Any) -> Any:
    return jax.tree.map(jnp.shape, tree)


def layout(tree: Any) -> dict:
    """``{path: (shape, dtype)}`` of a variables dict, for comparing with flax's."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): (tuple(np.shape(x)), jnp.result_type(x)) for p, x in flat}


def shape_layout(tree: Any) -> dict:
    """``{path: shape}`` of a variables dict."""
    return {path: shape for path, (shape, _) in layout(tree).items()}


def plain(tree: Any) -> Any:
    """Nested dicts all the way down (Linen may return FrozenDicts)."""
    if hasattr(tree, "items"):
        return {k: plain(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(plain(v) for v in tree)
    return tree
