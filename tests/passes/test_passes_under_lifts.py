"""Passes under lifted transforms: a pass sees a lifted variable as the body sees it.

The body of ``nn.scan``/``nn.vmap`` runs the program's passes on its own reads, with the
body's shapes (one layer, one ensemble member); the enclosing program reads the stacked
variable only to hand it in, and that read carries ``lift=<transform>`` so that passes leave
it alone.  Each shipped pass that rewrites values is checked here: the scanned model with
the pass equals the same layers unrolled with the pass, and a vmapped ensemble equals its
members run one by one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn
from varjax.ir.primitives import lift_of, var_get_p

LAYERS = 2
X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(3, name="a")(x) + nn.Dense(3, name="b")(x), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=LAYERS)
        return blocks(name="blocks")(x, None)[0]


class Unrolled(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x, _ = Block(name=f"layer{i}")(x, None)
        return x


class Member(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Block(name="block")(x, None)[0]


class Ensemble(nn.Module):
    @nn.compact
    def __call__(self, x):
        members = nn.vmap(Member, variable_axes={"params": 0}, split_rngs={"params": True},
                          in_axes=None, out_axes=0, axis_size=LAYERS)
        return members(name="members")(x)


def stacked_params(model):
    """``model``'s params, the second layer's scaled by 10: one scale shared by the layers
    would then round the first layer's weights to nothing."""
    params = model.init(jax.random.key(0), X)["params"]
    return jax.tree.map(lambda w: w * jnp.array([1.0, 10.0]).reshape((LAYERS,) + (1,) * (w.ndim - 1)),
                        params)


def layer(params, i):
    return jax.tree.map(lambda w: w[i], params)


SCANNED = stacked_params(Scanned())
UNROLLED = {f"layer{i}": layer(SCANNED["blocks"], i) for i in range(LAYERS)}
ENSEMBLE = stacked_params(Ensemble())


@pytest.mark.parametrize("spec", ["fake-quant{bits=2}", "fake-quant{bits=2,per_channel=true}",
                                  "fake-quant{bits=8}", "fake-quant{bits=8,per_channel=true}"])
def test_fake_quant_under_scan_quantizes_each_layer_with_its_own_scale(spec):
    got = Scanned().apply({"params": SCANNED}, X, passes=spec)
    want = Unrolled().apply({"params": UNROLLED}, X, passes=spec)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # and the pass does something: the float model differs
    assert not np.allclose(got, Unrolled().apply({"params": UNROLLED}, X), rtol=1e-4)


@pytest.mark.parametrize("spec", ["fake-quant{bits=2}", "fake-quant{bits=8,per_channel=true}"])
def test_fake_quant_under_vmap_quantizes_each_member_with_its_own_scale(spec):
    got = Ensemble().apply({"params": ENSEMBLE}, X, passes=spec)
    members = ENSEMBLE["members"]
    for i in range(LAYERS):
        want = Member().apply({"params": layer(members, i)}, X, passes=spec)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)


def test_a_lifts_boundary_read_carries_the_lift_and_value_passes_leave_it_alone():
    fn = vj.functionalize(Scanned().functionalize().fn, passes="fake-quant{bits=2}")
    v = {"params": SCANNED}
    effectful = fn.jaxpr(X, variables=v)
    reads = [e for e in effectful.jaxpr.eqns if e.primitive is var_get_p]
    assert len(reads) == 4 and {lift_of(e) for e in reads} == {"scan"}
    assert "var_get[params:blocks/a/kernel lift=scan]" in vj.pretty(effectful)
    quantized, _ = fn.run_pipeline(X, variables=v, pipeline=vj.passes.Pipeline.parse("fake-quant{bits=2}"))
    assert quantized is effectful     # the body quantized its own reads; nothing left here


def test_stop_gradient_under_scan_equals_unrolled():
    spec = "stop-gradient{collection=params,under=blocks/a}"

    def grads(model, params, spec):
        return jax.grad(lambda p: model.apply({"params": p}, X, passes=spec).sum())(params)

    got = grads(Scanned(), SCANNED, spec)
    want = grads(Unrolled(), UNROLLED, "stop-gradient{collection=params,under=layer0/a},"
                                       "stop-gradient{collection=params,under=layer1/a}")
    assert not np.asarray(got["blocks"]["a"]["kernel"]).any()
    for i in range(LAYERS):
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6),
                     layer(got["blocks"], i), want[f"layer{i}"])


def test_cast_params_under_scan_equals_unrolled():
    spec = "cast-params{dtype=bfloat16}"
    got = Scanned().apply({"params": SCANNED}, X, passes=spec)
    want = Unrolled().apply({"params": UNROLLED}, X, passes=spec)
    np.testing.assert_array_equal(got, want)


def test_lora_under_scan_equals_unrolled():
    spec = "lora{rank=2}"
    v = Scanned().init(jax.random.key(0), X, passes=spec)
    lora = jax.tree.map(lambda a: a + 0.1, v["lora"])      # B starts at zero: do something
    got = Scanned().apply({"params": SCANNED, "lora": lora}, X, passes=spec)
    unrolled_lora = {f"layer{i}": layer(lora["blocks"], i) for i in range(LAYERS)}
    want = Unrolled().apply({"params": UNROLLED, "lora": unrolled_lora}, X, passes=spec)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_tie_under_scan_equals_unrolled():
    got = Scanned().apply({"params": SCANNED}, X, passes="tie{src=blocks/a/kernel,dst=blocks/b/kernel}")
    want = Unrolled().apply({"params": UNROLLED}, X, passes=",".join(
        f"tie{{src=layer{i}/a/kernel,dst=layer{i}/b/kernel}}" for i in range(LAYERS)))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
