"""Sequential: parity with flax.linen.Sequential (names, chaining, unpacking)."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import check_parity

from varjax.nn.combinators import Sequential
from varjax.nn.linear import Dense
from varjax.nn.module import Module, compact


def _x(shape=(2, 3)):
    return jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)


def test_layers_are_named_by_index_and_outputs_match_flax():
    flax_seq = flax_nn.Sequential([flax_nn.Dense(4), jax.nn.relu, flax_nn.Dense(2)])
    variables, _, _ = check_parity(Sequential([Dense(4), jax.nn.relu, Dense(2)]), flax_seq, _x())
    assert list(variables["params"]) == ["layers_0", "layers_2"]


def test_layers_built_in_a_compact_method_are_named_by_that_module():
    class VjNet(Module):
        @compact
        def __call__(self, x):
            return Sequential([Dense(4), jnp.tanh, Dense(2)])(x)

    class FlaxNet(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            return flax_nn.Sequential([flax_nn.Dense(4), jnp.tanh, flax_nn.Dense(2)])(x)

    # As in Linen, layers built in a compact method belong to that module.
    variables, _, _ = check_parity(VjNet(), FlaxNet(), _x())
    assert list(variables["params"]) == ["Dense_0", "Dense_1"]


def test_tuple_and_dict_outputs_are_unpacked_into_the_next_layer():
    def split(x):
        return x[:, :1], x[:, 1:]

    def as_dict(a, b):
        return {"a": a, "b": b}

    def join(a, b):
        return a * jnp.sum(b, axis=-1, keepdims=True)

    x = _x()
    check_parity(Sequential([Dense(4), split, as_dict, join]),
                 flax_nn.Sequential([flax_nn.Dense(4), split, as_dict, join]), x)


def test_first_layer_gets_all_call_arguments():
    layers = [lambda a, b: a + b, Dense(2)]
    check_parity(Sequential(layers), flax_nn.Sequential([lambda a, b: a + b, flax_nn.Dense(2)]), _x(), _x())


def test_empty_sequential_raises():
    with pytest.raises(ValueError, match="no layers"):
        Sequential([]).init(jax.random.key(0), _x())


def test_layers_not_a_sequence_raises():
    with pytest.raises(ValueError, match="must be a sequence"):
        Sequential(Dense(2))


def test_sequential_assigned_in_setup_is_named_by_its_attribute():
    class VjNet(Module):
        def setup(self):
            self.encoder = Sequential([Dense(4), jnp.tanh, Dense(2)])

        def __call__(self, x):
            return self.encoder(x)

    class FlaxNet(flax_nn.Module):
        def setup(self):
            self.encoder = flax_nn.Sequential([flax_nn.Dense(4), jnp.tanh, flax_nn.Dense(2)])

        def __call__(self, x):
            return self.encoder(x)

    variables, _, _ = check_parity(VjNet(), FlaxNet(), _x())
    assert list(variables["params"]["encoder"]) == ["layers_0", "layers_2"]
