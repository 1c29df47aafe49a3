"""The fixes a training step's errors give to someone who called ``bind``: they show the
``bind`` call that fixes them (``mutable=``, ``rngs=``), not ``apply``'s, eagerly and under the
object-mode transforms a training step uses (``vj.jit`` over ``vj.value_and_grad``)."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import pytest

import varjax as vj
import varjax.nn as nn

X = jnp.ones((2, 3))


class Net(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(2)(x))
        return nn.Dropout(0.5, deterministic=not train)(x)


VARIABLES = Net().init(jax.random.key(0), X)


def _loss(m: nn.Module) -> jax.Array:
    return jnp.mean(m(X, train=True) ** 2)


CALLS: dict[str, Callable[[nn.Module], Any]] = {
    "eager": lambda m: m(X, train=True),
    "jit(value_and_grad)": lambda m: vj.jit(lambda m: vj.value_and_grad(_loss)(m))(m),
}


@pytest.mark.parametrize("call", CALLS)
def test_missing_dropout_stream_of_a_bound_module_shows_bind_with_rngs(call: str) -> None:
    with pytest.raises(vj.errors.MissingRngError) as caught:
        CALLS[call](Net().bind(VARIABLES, mutable=True))
    assert caught.value.fix == ("bind the module with the stream: "
                                "module.bind(variables, rngs=vj.Rngs(dropout=0))")
    assert caught.value.collection == "dropout"
    assert "test_object_bound_fixes.py" in caught.value.source


@pytest.mark.parametrize("call", CALLS)
def test_immutable_batch_stats_of_a_bound_module_shows_bind_with_mutable(call: str) -> None:
    with pytest.raises(vj.errors.ImmutableCollectionError) as caught:
        CALLS[call](Net().bind(VARIABLES, rngs=vj.Rngs(dropout=1)))
    assert "module.bind(variables, mutable=['batch_stats'])" in caught.value.fix
    assert "apply" not in caught.value.fix
    assert caught.value.collection == "batch_stats"


def test_missing_stream_under_apply_still_names_init_apply() -> None:
    with pytest.raises(vj.errors.MissingRngError) as caught:
        Net().apply(VARIABLES, X, train=True, mutable=["batch_stats"])
    assert caught.value.fix == "pass rngs={'dropout': jax.random.key(0)} (or a vj.Rngs) to init/apply"


def test_the_fixed_bind_runs_the_step() -> None:
    """Following both fixes gives the working training step of the README."""
    bound = Net().bind(VARIABLES, rngs=vj.Rngs(dropout=1), mutable=True)
    loss, grads = CALLS["jit(value_and_grad)"](bound)
    assert jnp.isfinite(loss)
    assert sorted(vj.state(grads)["params"]) == ["BatchNorm_0", "Dense_0"]
    mean = bound.variables["batch_stats"]["BatchNorm_0"]["mean"]
    assert not jnp.allclose(mean, VARIABLES["batch_stats"]["BatchNorm_0"]["mean"])
