"""Passes that draw randomness: a rule reaches its pass's context as ``region.ctx`` and
draws keys as the module that traced the equation (``region.ctx.in_module(eqn)``); model
code a rule runs on its own is a ``ScopeError`` naming the rule and that API."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import varjax as vj
from varjax import errors, nn
from varjax.ir.primitives import var_get_p
from varjax.passes import Pass, PassContext, Region, Rewriter, Rule

NOISE = jax.random.key(5)


@dataclasses.dataclass(frozen=True)
class AddNoise(Rule):
    """``w + sigma * normal(key)`` for every ``params`` read; ``key`` is the reading
    module's next ``noise`` draw, or (``alone``) a draw with no module, which is refused."""

    primitive = var_get_p
    sigma: float
    api: str = "in_module"

    def match(self, eqn):
        return eqn.params["collection"] == "params"

    def rewrite(self, eqn, invals, region: Region):
        (w,) = region.bind(eqn, invals)
        if self.api == "in_module":
            with region.ctx.in_module(eqn):
                key = vj.make_rng("noise")
        elif self.api == "make_rng":
            key = vj.make_rng("noise")
        else:
            key = vj.param("noise_key", lambda k: k)
        return [w + self.sigma * jax.random.normal(key, w.shape, w.dtype)]


@dataclasses.dataclass(frozen=True)
class NoiseReads(Pass):
    name = "noise-reads"
    summary = "add sigma * normal noise to every params read (tests)"
    before = ("lower-rng", "forward-stores", "discharge")
    sigma: float = 1.0
    api: str = "in_module"
    with_ctx: bool = True

    def run(self, jaxpr, ctx: PassContext):
        rules = [AddNoise(self.sigma, self.api)]
        return Rewriter(rules, ctx if self.with_ctx else None).run(jaxpr)


@vj.functionalize
def two_params():
    a = vj.param("a", jax.nn.initializers.zeros, (2,))
    b = vj.param("b", jax.nn.initializers.zeros, (2,))
    return a, b, vj.make_rng("noise")


@vj.functionalize
def three_draws():
    return [vj.make_rng("noise") for _ in range(3)]


ZEROS = {"params": {"a": jnp.zeros(2), "b": jnp.zeros(2)}}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.Dense(3)(x))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(2)(x), None


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        scan = nn.scan(Block, variable_axes={"params": 0},
                       split_rngs={"params": True, "noise": True}, length=2)
        return scan()(x, None)[0]


X = jnp.ones((1, 2))


@pytest.fixture(scope="module")
def mlp():
    net = MLP()
    return net, net.init(jax.random.key(0), X)


def test_noise_of_each_read_is_the_reading_modules_next_draw():
    noisy = vj.functionalize(two_params.fn, passes="noise-reads")
    a, b, _ = noisy.apply(ZEROS, rngs={"noise": NOISE})
    # The module drew once itself; the pass's draws continue its counts, one per read.
    _, k1, k2 = three_draws.apply({}, rngs={"noise": NOISE})
    assert jnp.array_equal(a, jax.random.normal(k1, (2,)))
    assert jnp.array_equal(b, jax.random.normal(k2, (2,)))
    assert not jnp.array_equal(a, b)


def test_noise_is_deterministic_per_seed_and_differs_across_seeds(mlp):
    net, v = mlp
    clean = net.apply(v, X)
    one = net.apply(v, X, passes="noise-reads{sigma=0.1}", rngs={"noise": NOISE})
    again = net.apply(v, X, passes="noise-reads{sigma=0.1}", rngs={"noise": NOISE})
    other = net.apply(v, X, passes="noise-reads{sigma=0.1}", rngs={"noise": jax.random.key(6)})
    assert jnp.array_equal(one, again)
    assert not jnp.array_equal(one, other)
    assert not jnp.array_equal(one, clean)


def test_noise_under_jit_with_the_key_an_argument_is_the_eager_noise(mlp):
    net, v = mlp
    step = jax.jit(lambda v, k: net.apply(v, X, passes="noise-reads{sigma=0.1}", rngs={"noise": k}))
    eager = net.apply(v, X, passes="noise-reads{sigma=0.1}", rngs={"noise": NOISE})
    assert jnp.allclose(step(v, NOISE), eager, atol=1e-6)


def test_noise_without_the_stream_names_the_stream_and_module(mlp):
    net, v = mlp
    with pytest.raises(errors.MissingRngError, match="'noise'") as e:
        net.apply(v, X, passes="noise-reads")
    assert "module:     MLP/Dense_" in str(e.value)


@pytest.mark.parametrize("api, called", [("make_rng", "vj.make_rng"), ("param", "vj.param")])
def test_model_code_in_a_rule_names_the_rule_and_in_module(mlp, api, called):
    net, v = mlp
    with pytest.raises(errors.ScopeError) as e:
        net.apply(v, X, passes=f"noise-reads{{api={api}}}", rngs={"noise": NOISE})
    text = str(e.value)
    assert f"{called} was called in AddNoise.rewrite, a rule of a pass" in text
    assert "region.ctx.in_module(eqn)" in text
    assert "test_pass_randomness.py" in text and "(AddNoise.rewrite)" in text   # the rule's line
    assert "MLP/Dense_" in text                                                # the read's module
    assert "decorate the enclosing function" not in text


def test_model_code_in_a_rule_of_a_lifted_bodys_pass_is_refused():
    # The body's pipeline runs while the enclosing trace is active: the rule's draw used
    # to come from that trace, silently.
    net = Stack()
    v = net.init(jax.random.key(0), X)
    with pytest.raises(errors.ScopeError, match="AddNoise.rewrite, a rule of a pass"):
        net.apply(v, X, passes="noise-reads{api=make_rng}", rngs={"noise": NOISE})
    noisy = net.apply(v, X, passes="noise-reads{sigma=0.1}", rngs={"noise": NOISE})
    assert not jnp.array_equal(noisy, net.apply(v, X))


def test_a_refused_rule_leaves_no_rule_behind(mlp):
    net, v = mlp
    with pytest.raises(errors.ScopeError):
        net.apply(v, X, passes="noise-reads{api=make_rng}", rngs={"noise": NOISE})
    with pytest.raises(errors.ScopeError, match="outside a functionalized function"):
        vj.make_rng("noise")


def test_region_ctx_of_a_rewriter_made_without_it_is_a_pass_error(mlp):
    net, v = mlp
    with pytest.raises(errors.PassError, match=r"made without the pass context") as e:
        net.apply(v, X, passes="noise-reads{with_ctx=false}", rngs={"noise": NOISE})
    assert "Rewriter(rules, ctx)" in str(e.value)
