"""The ``lora`` pass, and what it needs from the framework: ``passes=`` on modules and
lifted transforms, variables created by a pass at the module of the equation it rewrites
(``PassContext.in_module``), and the pipeline naming the pass a misordered one must
precede."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn
from varjax import errors
from varjax.ir import streams
from varjax.passes import Lora, PassContext, Pipeline
from varjax.passes.library.lora import merge

LORA = "lora{rank=2}"


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(jax.nn.relu(nn.Dense(3)(x)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return jax.nn.relu(nn.Dense(4)(x)), None


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=3)
        x, _ = blocks()(x, None)
        return nn.Dense(2)(x)


X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
KEY = jax.random.key(0)


def perturbed(variables):
    """Adapters that do something (``B`` starts at zero)."""
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys)])


def test_init_creates_adapters_at_the_module_of_each_kernel():
    net = MLP()
    v = net.init(KEY, X, passes=LORA)
    shapes = jax.tree.map(jnp.shape, v["lora"])
    assert shapes == {"Dense_0": {"kernel": {"a": (3, 2), "b": (2, 2)}},
                      "Dense_1": {"kernel": {"a": (4, 2), "b": (2, 3)}}}
    base = net.init(KEY, X)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), base["params"], v["params"]))
    assert not v["lora"]["Dense_0"]["kernel"]["b"].any()
    np.testing.assert_array_equal(net.apply(v, X, passes=LORA), net.apply(base, X))


def test_adapter_a_is_the_modules_next_params_draw_under_linens_convention():
    v = MLP().init(KEY, X, passes=LORA)
    # Dense_1 drew its kernel (#1) and bias (#2); A is its third draw.
    want = jax.nn.initializers.lecun_normal()(streams.derive_at(KEY, ("Dense_1",), 3), (4, 2))
    np.testing.assert_array_equal(v["lora"]["Dense_1"]["kernel"]["a"], want)


def test_apply_computes_the_hand_written_adapted_model():
    v = perturbed(MLP().init(KEY, X, passes=LORA))
    p, lo = v["params"], v["lora"]

    def dense(name, h):
        w = p[name]["kernel"] + lo[name]["kernel"]["a"] @ lo[name]["kernel"]["b"]
        return h @ w + p[name]["bias"][None]
    want = dense("Dense_0", jax.nn.relu(dense("Dense_1", X)))
    np.testing.assert_allclose(MLP().apply(v, X, passes=LORA), want, rtol=1e-6, atol=1e-6)


def test_gradients_reach_only_the_adapters_and_merge_matches():
    net = MLP()
    v = net.init(KEY, X, passes=LORA)

    def loss(lora):
        return jnp.sum(net.apply({"params": v["params"], "lora": lora}, X, passes=LORA) ** 2)
    g = jax.grad(loss)(v["lora"])
    assert g["Dense_0"]["kernel"]["b"].any()          # B is trained from zero
    trained = perturbed(v)
    np.testing.assert_allclose(net.apply(merge(trained), X),
                               net.apply(trained, X, passes=LORA), rtol=1e-6, atol=1e-6)
    assert "lora" not in merge(trained)


def test_adapters_in_a_scanned_remat_body_are_stacked_per_layer():
    net = Stack()
    v = net.init(KEY, X, passes=LORA)
    a = v["lora"]["ScanCheckpointBlock_0"]["Dense_0"]["kernel"]["a"]
    assert a.shape == (3, 4, 2)                       # one adapter per layer: lifted as params
    assert not jnp.allclose(a[0], a[1])               # split params keys
    assert v["lora"]["Dense_0"]["kernel"]["a"].shape == (4, 2)
    trained = perturbed(v)
    np.testing.assert_allclose(net.apply(merge(trained), X),
                               net.apply(trained, X, passes=LORA), rtol=1e-5, atol=1e-6)


def test_attention_kernels_factor_by_their_contracted_axes():
    att = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4)
    x = jnp.ones((1, 3, 6))
    lora = att.init(KEY, x, passes=LORA)["lora"]
    assert jax.tree.map(jnp.shape, lora["query"]) == {"kernel": {"a": (6, 2), "b": (2, 4)}}
    assert jax.tree.map(jnp.shape, lora["out"]) == {"kernel": {"a": (4, 2), "b": (2, 6)}}


def test_apply_without_adapters_names_the_missing_one():
    base = MLP().init(KEY, X)
    with pytest.raises(errors.MissingVariableError) as e:
        MLP().apply(base, X, passes=LORA)
    assert "collection: lora" in str(e.value) and "Dense_1/kernel/a" in str(e.value)
    assert "test_lora.py" in str(e.value)


def test_bind_and_functionalize_take_passes():
    net = MLP()
    v = perturbed(net.init(KEY, X, passes=LORA))
    np.testing.assert_array_equal(net.bind(v, passes=LORA)(X), net.apply(v, X, passes=LORA))
    fz = net.functionalize(passes=LORA)
    assert "lora{rank=2" in str(fz.pipeline)
    assert fz.traced(X, variables=v).stats["lora.adapted"] == 2


def test_a_lifted_transforms_passes_run_in_its_body_only():
    class Ensemble(nn.Module):
        @nn.compact
        def __call__(self, x):
            members = nn.vmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True},
                              in_axes=None, axis_size=2, passes=LORA)
            return nn.Dense(3)(members(4)(x).sum(0))
    v = Ensemble().init(KEY, X)
    assert jax.tree.map(jnp.shape, v["lora"]) == {"VmapDense_0": {"kernel": {"a": (2, 4, 2),
                                                                             "b": (2, 2, 4)}}}
    assert Ensemble().apply(perturbed(v), X).shape == (2, 3)


def test_a_pass_creating_variables_after_lower_rng_names_the_pass_to_precede():
    @dataclasses.dataclass(frozen=True)
    class LateLora(Lora):
        name = "late-lora"
        before = ("forward-stores", "discharge")
        after = ("lower-rng",)
    with pytest.raises(errors.PipelineError) as e:
        MLP().init(KEY, X, passes="late-lora")
    assert "after pass 'lower-rng'" in str(e.value)
    assert "before = ('lower-rng',) on LateLora" in str(e.value)


def test_in_module_outside_a_varjax_trace_is_an_error():
    jaxpr = MLP().functionalize().jaxpr(X, variables=MLP().init(KEY, X))
    ctx = PassContext(variables={}, mutable=True)
    with pytest.raises(errors.PassError, match="did not come from a varjax trace"):
        Pipeline([Lora()], verify=False).run(jaxpr, ctx)


def test_in_module_needs_an_equation_that_names_a_module():
    eqn = next(e for e in vj.functionalize(lambda x: x * 2).jaxpr(X).jaxpr.eqns)
    with pytest.raises(errors.PassError, match="cannot tell which module"):
        PassContext(modules=lambda path: None).in_module(eqn)


def test_passes_none_means_no_pass():
    base = MLP().init(KEY, X, passes=None)
    assert set(base) == {"params"}
    np.testing.assert_array_equal(MLP().apply(base, X, passes=None), MLP().apply(base, X))


def test_merge_infers_an_attention_kernels_leading_contracted_axes():
    att = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4)
    x = jnp.linspace(-1.0, 1.0, 18).reshape(1, 3, 6)
    trained = perturbed(att.init(KEY, x, passes=LORA))
    np.testing.assert_allclose(att.apply(merge(trained), x), att.apply(trained, x, passes=LORA),
                               rtol=1e-5, atol=1e-6)


def test_merge_refuses_contracted_axes_that_do_not_fit_the_adapter():
    v = MLP().init(KEY, X, passes=LORA)
    with pytest.raises(errors.VariableShapeError, match="cannot merge the LoRA adapter of Dense_1/kernel"):
        merge(v, contracted={"Dense_1/kernel": (1,)})


def test_cond_and_while_loop_run_their_passes_in_their_bodies():
    class Branchy(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = nn.Dense(4)
            h = nn.cond(x.sum() > 0, lambda m, x: m(x), lambda m, x: -m(x), dense, x,
                        passes=LORA)
            step = nn.Dense(4)
            h = step(h)                   # created before the loop, which may run zero times
            return nn.while_loop(lambda m, c: c[0] < 2, lambda m, c: (c[0] + 1, m(c[1])),
                                 step, (0, h), passes="cast-params{dtype=bfloat16}")[1]
    v = Branchy().init(KEY, X)
    assert jax.tree.map(jnp.shape, v["lora"]) == {"Dense_0": {"kernel": {"a": (4, 2), "b": (2, 4)}}}
    out = Branchy().apply(perturbed(v), X)
    assert out.dtype == jnp.float32 and out.shape == (2, 4)
