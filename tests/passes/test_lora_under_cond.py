"""lora under ``nn.cond``/``nn.switch``: an adapter of a kernel created before the branches is
created before them too and handed to every branch, as the kernel is.

Linen's ``nn.cond`` needs a branch's variables to exist before it, so models create their
layers first (``if self.is_initializing(): layer(x)``) and call them in the branches.  The
oracle is Linen's model applied to the merged kernels ``W + scale * A @ B``, with ``B``
made nonzero so that the adapters matter.
"""
from __future__ import annotations

import flax.linen as ln
import jax
import jax.numpy as jnp
import numpy as np

import varjax.nn as nn
from varjax.passes.lora import merge

PASS = "lora{rank=2,scale=0.5}"
X = jnp.array([[0.5, -1.0]])


def _branched(mod, n_branches: int, reads: tuple[str, ...]):
    """A model making Dense layers ``a``, ``b`` before a cond (two branches) or a switch,
    whose branch ``i`` applies layer ``reads[i]`` (``''``: none, the identity)."""
    class Model(mod.Module):
        @mod.compact
        def __call__(self, x):
            layers = {n: mod.Dense(2, name=n) for n in ("a", "b")}
            if self.is_initializing():
                for layer in layers.values():
                    layer(x)
            fns = [lambda m, x, n=n: layers[n](x) if n else x for n in reads]
            if n_branches == 2:
                return mod.cond(jnp.sum(x) > 0, fns[0], fns[1], self, x)
            return mod.switch(jnp.argmax(x[0]), fns, self, x)
    return Model()


def _check_against_linen(n_branches: int, reads: tuple[str, ...], inputs) -> None:
    v = dict(_branched(nn, n_branches, reads).init(jax.random.key(0), X, passes=PASS))
    shapes = jax.tree.map(jnp.shape, v["lora"])
    assert shapes == {n: {"kernel": {"a": (2, 2), "b": (2, 2)}} for n in ("a", "b")}
    v["lora"] = jax.tree.map(lambda t: t + 0.25, v["lora"])        # B nonzero
    merged = {"params": merge(v, scale=0.5)["params"]}
    for x in inputs:
        got = _branched(nn, n_branches, reads).apply(v, x, passes=PASS)
        want = _branched(ln, n_branches, reads).apply(merged, x)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_lora_adapters_of_kernels_made_before_a_cond_are_handed_to_both_branches():
    _check_against_linen(2, ("a", "b"), (X, -X))


def test_lora_adapters_under_switch_match_linen_on_every_branch():
    _check_against_linen(3, ("a", "b", "a"), (X, X[:, ::-1]))


def test_lora_adapter_of_a_kernel_one_branch_reads_exists_after_the_cond():
    _check_against_linen(2, ("a", ""), (X, -X))
