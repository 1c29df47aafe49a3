"""``nnx.TrainState`` (``varjax/nnx/training.py``) against flax.nnx 0.12.8's: the same model
split in both, three Adam steps under ``jax.jit`` with gradients from ``apply``, then params,
optimizer state and step compared bitwise; a subclass with a field of its own; the pytree's
static part; a bad field name."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx as fnnx

from varjax import errors
from varjax import nnx as vnnx
from varjax.nnx.training import TrainState

X = jnp.arange(6.0).reshape(2, 3) / 6


def standard(tx):
    """``tx`` run under standard promotion: Optax mixes dtypes (Adam's ``b1 ** count``),
    and the suite runs under strict promotion."""
    def run(fn):
        def wrapped(*args, **kwargs):
            with jax.numpy_dtype_promotion("standard"):
                return fn(*args, **kwargs)
        return wrapped
    return optax.GradientTransformation(run(tx.init), run(tx.update))


def bitwise(ours, theirs) -> None:
    a, b = jax.tree.leaves(ours), jax.tree.leaves(theirs)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def split_model(nnx):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.norm = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.lin(x))
    return nnx.split(Net(nnx.Rngs(0)), nnx.Param, ...)


def train(nnx, cls):
    """Three jitted Adam steps; the batch statistics carried in ``rest``."""
    graphdef, params, rest = split_model(nnx)
    state = cls.create(graphdef, params=params, tx=standard(optax.adam(1e-2)), rest=rest)

    @jax.jit
    def step(state):
        def loss(params, rest):
            rest = jax.tree.map(jnp.asarray, rest)   # Variables of this trace: flax.nnx
            y, (_, new) = state.apply(params, rest)(X)   # writes batch statistics to them
            return jnp.sum(y ** 2), new
        grads, new = jax.grad(loss, has_aux=True)(state.params, state.rest)
        _, _, rest = nnx.split(nnx.merge(state.graphdef, new), nnx.Param, ...)
        return state.apply_gradients(grads, rest=rest)
    for _ in range(3):
        state = step(state)
    return state


class Ours(TrainState):
    rest: vnnx.State


class Theirs(fnnx.TrainState):
    rest: fnnx.State


@pytest.fixture(scope="module")
def trained():
    return train(vnnx, Ours), train(fnnx, Theirs)


def test_adam_steps_match_flax_nnx_bitwise(trained):
    ours, theirs = trained
    assert int(ours.step) == int(theirs.step) == 3
    assert vnnx.to_pure_dict(ours.params).keys() == fnnx.to_pure_dict(theirs.params).keys()
    bitwise(ours.params, theirs.params)
    bitwise(ours.opt_state, theirs.opt_state)


def test_a_subclass_field_is_carried_and_replaced(trained):
    ours, theirs = trained
    bitwise(ours.rest, theirs.rest)     # the batch statistics the steps wrote
    assert isinstance(ours, Ours) and isinstance(ours.rest, vnnx.State)


def test_graphdef_and_tx_are_static(trained):
    ours, _ = trained
    leaves, treedef = jax.tree.flatten(ours)
    again = jax.tree.unflatten(treedef, leaves)
    assert again.graphdef == ours.graphdef and again.tx is ours.tx
    assert all(isinstance(x, jax.Array) for x in leaves)


def test_create_starts_at_step_and_is_frozen():
    graphdef, params, _ = split_model(vnnx)
    state = TrainState.create(graphdef, params=params, tx=optax.sgd(0.1), step=5)
    assert int(state.step) == 5
    with pytest.raises(AttributeError):
        state.step = 6


def test_apply_by_name_of_a_field_that_is_not_a_state_is_refused():
    graphdef, params, rest = split_model(vnnx)
    state = TrainState.create(graphdef, params=params, tx=optax.sgd(0.1))
    with pytest.raises(errors.InvalidVariablesError, match="'step' holds a"):
        state.apply("params", "step")


def test_a_subclass_field_made_with_nnx_static_is_in_the_treedef():
    class Named(TrainState):
        name: str = vnnx.static(default="run")
    graphdef, params, _ = split_model(vnnx)
    state = Named.create(graphdef, params=params, tx=optax.sgd(0.1), name="a")
    leaves, treedef = jax.tree.flatten(state)
    assert "a" not in leaves and jax.tree.unflatten(treedef, leaves).name == "a"
    assert len(leaves) == len(jax.tree.leaves(params)) + 1     # params and step (sgd: none)


def test_training_holds_metrics_and_optimizer_as_flax_nnx_training_does():
    from flax.nnx import training as flax_training

    from varjax.nnx import training
    assert training.optimizer.Optimizer is vnnx.Optimizer
    assert training.metrics.Average is vnnx.metrics.Average
    assert {"metrics", "optimizer"} <= set(dir(flax_training))
