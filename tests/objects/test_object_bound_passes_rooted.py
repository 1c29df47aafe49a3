"""A bound module's passes see its variables in object mode as in an eager call: paths
relative to the module (``under=Dense_0``, not ``under=m/Dense_0``), and only its own
variables, not those of other arguments.

The oracle of each test is the same pass run by ``apply(..., passes=...)`` (or the eager
call of the bound module) on the same variables.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn
from varjax.passes import Pass

X = jnp.arange(8.0).reshape(2, 4) / 8


class Two(nn.Module):
    """Dense(3) then Dense(4): Dense_1's kernel (3, 4) is Dense_0's (4, 3) transposed."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = jnp.tanh(nn.Dense(3)(x))
        return nn.Dense(4)(hidden)


V = Two().init(jax.random.key(0), X)


def _loss(m: nn.Module) -> jax.Array:
    return (m(X) ** 2).sum()


def _grads_in_object_mode(model: nn.Module, collection: str) -> dict[str, dict]:
    """The gradient of ``_loss`` with respect to ``collection``, under ``vj.grad`` and
    nested in ``vj.jit``."""
    return {name: vj.state(grads, collection)[collection] for name, grads in [
        ("grad", vj.grad(_loss)(model)),
        ("jit(grad)", vj.jit(lambda m: vj.grad(_loss)(m))(model)),
    ]}


def _assert_trees_close(got: object, want: object, name: str) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want), name
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=name),
                 got, want)


def test_stop_gradient_under_is_relative_to_the_bound_module() -> None:
    passes = "stop-gradient{collection=params,under=Dense_0}"
    want = jax.grad(lambda p: (Two().apply({"params": p}, X, passes=passes) ** 2).sum())(V["params"])
    assert np.abs(want["Dense_1"]["kernel"]).sum() > 0       # only Dense_0 is frozen
    for name, got in _grads_in_object_mode(Two().bind(V, passes=passes), "params").items():
        _assert_trees_close(got, want, name)


def test_tie_src_and_dst_are_relative_to_the_bound_module() -> None:
    passes = "tie{src=Dense_0/kernel,dst=Dense_1/kernel}"
    tied = Two().init(jax.random.key(1), X, passes=passes)
    assert "kernel" not in tied["params"]["Dense_1"]
    model = Two().bind(tied, passes=passes)
    want_out = Two().apply(tied, X, passes=passes)
    np.testing.assert_allclose(model(X), want_out, rtol=1e-6)
    np.testing.assert_allclose(vj.jit(lambda m: m(X))(model), want_out, rtol=1e-6)
    want = jax.grad(lambda p: (Two().apply({"params": p}, X, passes=passes) ** 2).sum())(tied["params"])
    for name, got in _grads_in_object_mode(model, "params").items():
        _assert_trees_close(got, want, name)


LORA = "lora{rank=2,targets=^Dense_0/kernel$}"


def test_anchored_lora_targets_are_relative_to_the_bound_module() -> None:
    trained = jax.tree.map(lambda a: a + 0.25, Two().init(jax.random.key(2), X, passes=LORA))
    assert set(trained["lora"]) == {"Dense_0"}
    model = Two().bind(trained, passes=LORA)
    want_out = Two().apply(trained, X, passes=LORA)
    assert not np.allclose(want_out, Two().apply({"params": trained["params"]}, X))
    np.testing.assert_allclose(vj.jit(lambda m: m(X))(model), want_out, rtol=1e-6)
    want = jax.grad(lambda a: (Two().apply({**trained, "lora": a}, X, passes=LORA) ** 2).sum()
                    )(trained["lora"])
    for name, got in _grads_in_object_mode(model, "lora").items():
        _assert_trees_close(got, want, name)


def test_lora_adapters_created_under_a_transform_land_in_the_module() -> None:
    params = {"params": V["params"]}
    model = Two().bind(params, passes=LORA, mutable=["lora"], rngs={"params": jax.random.key(3)})
    # B starts at zero: the adapted model computes what the base model does
    np.testing.assert_allclose(vj.jit(lambda m: m(X))(model), Two().apply(params, X), rtol=1e-6)
    created = vj.state(model, "lora")["lora"]
    assert jax.tree.map(jnp.shape, created) == {"Dense_0": {"kernel": {"a": (4, 2), "b": (2, 3)}}}
    # the module now holds them where apply with the pass reads them
    trained = {**params, "lora": jax.tree.map(lambda a: a + 0.5, created)}
    vj.update(model, {"lora": trained["lora"]})
    np.testing.assert_allclose(vj.jit(lambda m: m(X))(model), Two().apply(trained, X, passes=LORA),
                               rtol=1e-6)


def test_variable_beside_a_module_bound_with_stop_gradient_keeps_its_gradient() -> None:
    model = Two().bind(V, passes="stop-gradient{collection=params}")
    scale = vj.Variable(jnp.full((4,), 2.0), collection="params")

    def loss(m: nn.Module, s: vj.Variable) -> jax.Array:
        return (m(X) * s.value[None]).sum()
    grad_m, grad_s = vj.grad(loss, argnums=(0, 1))(model, scale)
    for leaf in jax.tree.leaves(vj.state(grad_m, "params")):
        np.testing.assert_array_equal(leaf, 0.0)
    np.testing.assert_allclose(grad_s.value, Two().apply(V, X).sum(0), rtol=1e-6)


def test_modules_bound_with_different_passes_each_run_their_own() -> None:
    student = Two().bind(V, passes="stop-gradient{collection=params,under=Dense_0}")
    teacher = Two().bind(V, passes="stop-gradient{collection=params,under=Dense_1}")
    grad_s, grad_t = vj.grad(lambda s, t: _loss(s) + _loss(t), argnums=(0, 1))(student, teacher)
    frozen = {"Dense_0": vj.state(grad_s, "params")["params"]["Dense_0"],
              "Dense_1": vj.state(grad_t, "params")["params"]["Dense_1"]}
    for leaf in jax.tree.leaves(frozen):
        np.testing.assert_array_equal(leaf, 0.0)
    want = jax.grad(lambda p: _loss(Two().bind({"params": p})))(V["params"])
    _assert_trees_close(vj.state(grad_s, "params")["params"]["Dense_1"], want["Dense_1"], "student")
    _assert_trees_close(vj.state(grad_t, "params")["params"]["Dense_0"], want["Dense_0"], "teacher")


def test_option_that_selects_nothing_in_the_bound_module_lists_its_own_paths() -> None:
    model = Two().bind(V, passes="stop-gradient{collection=params,under=Dense_9}")
    with pytest.raises(vj.errors.PipelineError) as caught:
        vj.grad(_loss)(model)
    message = str(caught.value)
    assert "under=Dense_9" in message and "Dense_0, Dense_1" in message
    assert "test_object_bound_passes_rooted.py" in message


@dataclasses.dataclass(frozen=True)
class _CountParams(Pass):
    """A pass written without roots in mind: it cannot say which variables are the module's."""

    name = "test-count-params"
    before = ("discharge",)

    def run(self, jaxpr, ctx):  # noqa: ANN001, ANN201
        return jaxpr


def test_pass_that_cannot_be_rooted_is_an_error_in_object_mode() -> None:
    model = Two().bind(V, passes="test-count-params")
    model(X)     # eagerly the pass sees the module's own paths
    with pytest.raises(vj.errors.PipelineError) as caught:
        vj.jit(lambda m: m(X))(model)
    message = str(caught.value)
    assert "test-count-params" in message and "rootable" in str(caught.value.fix)
    assert "test_object_bound_passes_rooted.py" in message


def test_modules_bound_with_lora_of_different_ranks_each_use_their_adapters() -> None:
    passes = {2: "lora{rank=2}", 4: "lora{rank=4}"}
    variables = {r: jax.tree.map(lambda a: a + 0.25, Two().init(jax.random.key(r), X, passes=p))
                 for r, p in passes.items()}
    small, big = (Two().bind(variables[r], passes=passes[r]) for r in (2, 4))
    got = vj.jit(lambda s, b: (s(X), b(X)))(small, big)
    for out, r in zip(got, (2, 4)):
        np.testing.assert_allclose(out, Two().apply(variables[r], X, passes=passes[r]), rtol=1e-6)


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, c: jax.Array, _: None) -> tuple[jax.Array, None]:
        return jnp.tanh(nn.Dense(4)(c)), None


class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        layers = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return layers(name="layers")(x, None)[0]


def test_nested_call_runs_the_module_passes_once() -> None:
    # The enclosing trace reads the stacked kernel only to hand the module in: quantizing
    # that read too (one scale for all layers) would change the inner call's values.
    passes = "fake-quant{bits=2,per_channel=true}"
    variables = jax.tree.map(lambda a: a + 0.1, Scanned().init(jax.random.key(0), X))
    want = jax.grad(lambda v: (Scanned().apply(v, X, passes=passes) ** 2).sum())(variables)
    model = Scanned().bind(variables, passes=passes)
    got = vj.jit(lambda m: vj.grad(_loss)(m))(model)
    _assert_trees_close(vj.state(got, "params")["params"], want["params"], "jit(grad)")


class Pair(nn.Module):
    def setup(self) -> None:
        self.enc = nn.Dense(3)
        self.dec = nn.Dense(4)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dec(jnp.tanh(self.enc(x)))


def test_submodule_passed_alone_is_named_as_in_the_bound_module() -> None:
    passes = "fake-quant{bits=2,collection=params},stop-gradient{collection=params,under=enc/bias}"
    variables = jax.tree.map(lambda a: a + 0.1, Pair().init(jax.random.key(0), X))
    want = jax.grad(lambda p: Pair().apply({"params": p}, X, passes=passes,
                                           method=lambda m, x: (m.enc(x) ** 2).sum()))(variables["params"])
    assert np.abs(want["enc"]["kernel"]).sum() > 0 and not np.abs(want["enc"]["bias"]).any()
    encoder = Pair().bind(variables, passes=passes).enc
    for name, call in [("grad", vj.grad(lambda e: (e(X) ** 2).sum())),
                       ("jit(grad)", vj.jit(lambda e: vj.grad(lambda f: (f(X) ** 2).sum())(e)))]:
        _assert_trees_close(vj.state(call(encoder), "params")["params"], want["enc"], name)
