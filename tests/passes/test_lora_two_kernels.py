"""lora on a module with two kernels, one applied inside an ``nn.cond`` and one outside it.

The cond's lift creates the adapter of the kernel handed to its branches during the trace
(before the cond); the enclosing program's ``lora`` makes the other after the trace.  Both
draw from the module's ``params`` counts, and the lift's draws are not counted in the
trace, so both adapters took the same key: identical ``A`` matrices.  The reference is the
model without the cond, the branch's call made where the cond is: every adapter of a
module is drawn by the program's pass, in the order the program reaches it.
"""
from __future__ import annotations

import flax.linen as ln
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax.nn as nn
from varjax.passes.library.lora import merge

PASS = "lora{rank=2,scale=0.5,targets=kernel}"
X = jnp.array([[0.5, -1.0]])


def _pair(mod):
    class Pair(mod.Module):
        """Two kernels; a call applies the one named ``which`` (``''``: none)."""

        @mod.compact
        def __call__(self, x, which: str):
            init = jax.nn.initializers.lecun_normal()
            k = {n: self.param(n, init, (2, 2)) for n in ("kernel", "kernel2")}
            return x @ k[which] if which else x
    return Pair


def _model(mod, order: str, cond: bool = True):
    """``l``'s ``kernel`` applied in a cond's true branch (without ``cond``: in its place),
    ``kernel2`` before or after it (``order``)."""
    pair = _pair(mod)

    class Model(mod.Module):
        @mod.compact
        def __call__(self, x):
            layer = pair(name="l")
            if self.is_initializing():
                layer(x, "")      # the kernels exist before the cond, as nn.cond requires
            if order == "before":
                x = layer(x, "kernel2")
            if cond:
                x = mod.cond(jnp.sum(x) > 0, lambda m, x: layer(x, "kernel"),
                             lambda m, x: -x, self, x)
            else:
                x = layer(x, "kernel")
            if order == "after":
                x = layer(x, "kernel2")
            return x
    return Model()


@pytest.fixture(scope="module", params=["before", "after"])
def inits(request):
    order = request.param
    got = _model(nn, order).init(jax.random.key(0), X, passes=PASS)
    want = _model(nn, order, cond=False).init(jax.random.key(0), X, passes=PASS)
    return order, dict(got), dict(want)


def test_lora_adapters_of_two_kernels_of_a_module_inside_and_outside_a_cond_differ(inits):
    # They had the same A: the lift's draw at the cond and the program's pass after the
    # trace both started from the module's count after its params.
    _, got, _ = inits
    adapters = got["lora"]["l"]
    assert not np.array_equal(adapters["kernel"]["a"], adapters["kernel2"]["a"])


def test_lora_adapters_around_a_cond_are_those_of_the_model_without_the_cond(inits):
    _, got, want = inits
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert jax.tree.all(jax.tree.map(np.array_equal, got, want))


def test_lora_adapters_around_a_cond_compute_linens_model_on_the_merged_kernels(inits):
    order, got, _ = inits
    v = {**got, "lora": jax.tree.map(lambda t: t + 0.25, got["lora"])}     # B nonzero
    merged = {"params": merge(v, scale=0.5)["params"]}
    outs = set()
    for x in (X, -X):
        out = _model(nn, order).apply(v, x, passes=PASS)
        np.testing.assert_allclose(out, _model(ln, order).apply(merged, x), rtol=1e-6, atol=1e-6)
        outs.add(float(jnp.sum(out)))
    assert len(outs) == 2      # both branches ran


class _SetupPair(nn.Module):
    """Two kernels declared (and so read) in ``setup``, applied by two methods."""

    def setup(self):
        init = jax.nn.initializers.lecun_normal()
        self.k1 = self.param("kernel", init, (2, 2))
        self.k2 = self.param("kernel2", init, (2, 2))

    def inner(self, x):
        return x @ self.k1

    def outer(self, x):
        return x @ self.k2


def _setup_model(cond: bool):
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            layer = _SetupPair(name="l")
            x = layer.outer(x)
            if not cond:
                return layer.inner(x)
            return nn.cond(jnp.sum(x) > 0, lambda m, x: layer.inner(x), lambda m, x: x, self, x)
    return Model()


def test_lora_adapters_are_drawn_in_the_order_the_program_reaches_them():
    # The setup reads both kernels, so without the cond the adapters are drawn in that
    # order (kernel, kernel2).  With it, kernel's adapted read is in the branch: the program
    # reaches kernel2's read (setup) before the cond, so kernel2 takes the module's first
    # adapter draws and kernel the next ones.
    got = _setup_model(True).init(jax.random.key(0), X, passes=PASS)["lora"]["l"]
    without = _setup_model(False).init(jax.random.key(0), X, passes=PASS)["lora"]["l"]
    for a, b in (("kernel", "kernel2"), ("kernel2", "kernel")):
        assert jax.tree.all(jax.tree.map(np.array_equal, got[a], without[b]))
