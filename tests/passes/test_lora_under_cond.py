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
from varjax.passes.library.lora import merge

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


def _used_before(mod, cond: bool = True):
    """A model whose Dense ``a`` computes ``h`` before a cond whose true branch applies
    ``a`` again (without ``cond``: the true branch, unconditionally)."""
    class Model(mod.Module):
        @mod.compact
        def __call__(self, x):
            a = mod.Dense(2, name="a")
            h = a(x)
            if not cond:
                return h + a(h)
            return h + mod.cond(jnp.sum(h) > 0, lambda m, h: a(h), lambda m, h: -h, self, h)
    return Model()


def test_lora_adapter_of_a_kernel_used_before_the_cond_is_created_at_that_use():
    # The program's lora adapted the read before the cond with the adapter the cond's lift
    # created later, at the cond: init raised VariableCreationError ("read where it has no
    # value").  Created once, at the first read, it is what the model without the cond makes.
    v = dict(_used_before(nn).init(jax.random.key(0), X, passes=PASS))
    want = _used_before(nn, cond=False).init(jax.random.key(0), X, passes=PASS)
    assert jax.tree.all(jax.tree.map(np.array_equal, v, dict(want)))
    v["lora"] = jax.tree.map(lambda t: t + 0.25, v["lora"])        # B nonzero
    merged = {"params": merge(v, scale=0.5)["params"]}
    h = {}
    for x in (X, -X):
        got = _used_before(nn).apply(v, x, passes=PASS)
        np.testing.assert_allclose(got, _used_before(ln).apply(merged, x), rtol=1e-6, atol=1e-6)
        h[float(jnp.sum(got))] = x
    assert len(h) == 2      # both branches ran


class _Tower(nn.Module):
    """A scan body making layers ``a``, ``b`` before a cond whose branches apply one each."""
    cond: bool = True

    @nn.compact
    def __call__(self, c, x):
        a, b = nn.Dense(2, use_bias=False, name="a"), nn.Dense(2, name="b")
        h = c + x
        if not self.cond:
            return a(h) + b(h), h
        if self.is_initializing():
            a(h), b(h)
        h = nn.cond(jnp.sum(h) > 0, lambda m, h: a(h), lambda m, h: b(h), self, h)
        return h, h


def _scanned_init(cond: bool, passes: str = ""):
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(_Tower, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=2)
            return scan(cond, name="t")(jnp.zeros(x.shape[1:]), x)
    xs = jnp.ones((2, 2, 2)) * jnp.array([[[1.0, -1.0]]])
    return Model().init(jax.random.key(428), xs, passes=passes)


def test_lora_under_cond_in_scan_keeps_the_base_params_and_the_adapters_of_the_model_without_cond():
    # The adapters are created at the cond without counting their draws: counted, scan's
    # loop trace (moved by the counts its first trace took) gave every kernel another key.
    with_cond = _scanned_init(True, "lora{rank=1}")
    assert jax.tree.all(jax.tree.map(np.array_equal, with_cond["params"],
                                     _scanned_init(True)["params"]))
    assert jax.tree.all(jax.tree.map(np.array_equal, with_cond,
                                     _scanned_init(False, "lora{rank=1}")))


def test_lora_adapter_in_scan_body_is_not_drawn_from_its_kernels_key():
    # scan's loop trace is its first trace with the counts moved; its passes ran with the
    # counts at its start, so an adapter took the kernel's draw (same key, same numbers).
    v = _scanned_init(False, "lora{rank=1}")
    kernel, adapter = v["params"]["t"]["a"]["kernel"], v["lora"]["t"]["a"]["kernel"]["a"]
    for layer in range(2):
        assert not np.allclose(adapter[layer, :, 0], kernel[layer].reshape(-1)[:2])


class _TwoKernels(nn.Module):
    """One module with two kernels, so that its adapters are four draws of one module."""

    @nn.compact
    def __call__(self, x):
        init = jax.nn.initializers.lecun_normal()
        k1, k2 = self.param("kernel", init, (2, 2)), self.param("kernel2", init, (2, 2))
        return x @ k1 @ k2


def test_lora_adapters_created_at_a_cond_take_distinct_draws_as_without_the_cond():
    # Each adapter is a separate CreateOutside: each continues the draws of the one before
    # rather than starting from the cond's counts again (same key: identical A matrices).
    class Model(nn.Module):
        cond: bool

        @nn.compact
        def __call__(self, x):
            layer = _TwoKernels(name="l")
            if not self.cond:
                return layer(x)
            if self.is_initializing():
                layer(x)
            return nn.cond(jnp.sum(x) > 0, lambda m, x: layer(x), lambda m, x: x, self, x)
    passes = "lora{rank=2,targets=kernel}"
    got, want = (Model(c).init(jax.random.key(0), X, passes=passes) for c in (True, False))
    assert jax.tree.all(jax.tree.map(np.array_equal, got, want))
