"""The small model the transform-option tests share: a Linear and a BatchStat counter its
call increments, built the same way on flax.nnx and varjax.nnx, and the check that two
models' states are bitwise equal."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx as flax_nnx

from varjax import nnx

X = jnp.arange(6.0).reshape(3, 2) / 7


def counting_model(lib, seed=0):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
            self.count = lib.BatchStat(jnp.array(0))

        def __call__(self, x):
            self.count[...] += 1
            return jnp.tanh(self.lin(x))
    return Model(lib.Rngs(seed))


def same_state(ours, theirs):
    a, b = nnx.to_pure_dict(nnx.state(ours)), flax_nnx.to_pure_dict(flax_nnx.state(theirs))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
