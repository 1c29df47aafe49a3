"""An NNX model pickles and unpickles as flax.nnx's does: the same state, the same outputs,
shared submodules still shared; a Variable handle of a running trace is refused by name."""
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from varjax import errors, nnx


class Model(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(2, 3, rngs=rngs)
        self.again = self.linear
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.norm = nnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.norm(self.linear(x)))


def _arrays(model):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
                       else x) for x in jax.tree.leaves(nnx.state(model))]


def test_a_pickled_model_keeps_its_state_sharing_and_outputs():
    model = Model(nnx.Rngs(0, dropout=1))
    model(jnp.ones((2, 2)))
    copy = pickle.loads(pickle.dumps(model))
    assert copy.again is copy.linear and type(copy.linear.kernel) is nnx.Param
    for ours, theirs in zip(_arrays(model), _arrays(copy)):
        np.testing.assert_array_equal(ours, theirs)
    step = nnx.jit(lambda m, x: m(x))
    np.testing.assert_array_equal(step(model, jnp.ones((2, 2))), step(copy, jnp.ones((2, 2))))
    assert int(copy.drop.rngs.count[...]) == int(model.drop.rngs.count[...]) == 2
    state = pickle.loads(pickle.dumps(nnx.state(model, nnx.RngState)))
    assert isinstance(state["drop"]["rngs"]["count"], nnx.RngCount)


def test_pickling_a_variable_inside_a_transform_is_refused_naming_it():
    model = Model(nnx.Rngs(0, dropout=1))

    def inside(m, x):
        pickle.dumps(m.linear.kernel)
        return m(x)
    with pytest.raises(errors.TransformError, match="cannot be pickled") as caught:
        nnx.jit(inside)(model, jnp.ones((2, 2)))
    assert "params" in str(caught.value)
