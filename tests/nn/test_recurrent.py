"""Recurrent cells and RNN: parity with flax.linen.recurrent."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import assert_close, check_parity

from varjax.nn import recurrent as vj_rnn
from varjax.nn.module import Module, compact
from varjax.nn.stochastic import Dropout

B, T, F, H = 2, 4, 3, 5
CELLS = ["LSTMCell", "GRUCell", "SimpleCell"]


def _x(seed=1, shape=(B, T, F)):
    # NumPy draws: no XLA compile per input shape.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _cells(name, **kw):
    return getattr(vj_rnn, name)(H, **kw), getattr(flax_nn, name)(H, **kw)


@pytest.mark.parametrize("name", CELLS)
def test_initialize_carry_matches_flax(name):
    vj_cell, flax_cell = _cells(name, carry_init=jax.nn.initializers.normal())
    assert_close(vj_cell.initialize_carry(jax.random.key(3), (B, F)),
                 flax_cell.initialize_carry(jax.random.key(3), (B, F)), 0)
    assert vj_cell.num_feature_axes == 1


@pytest.mark.parametrize("name", CELLS)
def test_cell_step_matches_flax(name):
    vj_cell, flax_cell = _cells(name)
    carry = jax.tree.map(lambda c: c + 0.5, vj_cell.initialize_carry(jax.random.key(3), (B, F)))
    check_parity(vj_cell, flax_cell, carry, _x()[:, 0])


@pytest.mark.parametrize("name, kw", [("LSTMCell", {}), ("GRUCell", {}), ("SimpleCell", {"residual": True})])
def test_bfloat16_cell_matches_flax_without_implicit_promotion(name, kw):
    vj_cell, flax_cell = _cells(name, dtype=jnp.bfloat16, **kw)
    carry = vj_cell.initialize_carry(jax.random.key(3), (B, F))     # float32, like the params
    x = _x()[:, 0]
    variables = vj_cell.init(jax.random.key(0), carry, x)
    out = vj_cell.apply(variables, carry, x)                         # strict promotion (conftest)
    with jax.numpy_dtype_promotion("standard"):                      # Linen mixes dtypes implicitly
        expected = flax_cell.apply(variables, carry, x)
    assert jax.tree.map(jnp.result_type, out) == jax.tree.map(jnp.result_type, expected)
    assert_close(out, expected, 2e-2)


def test_simple_cell_residual_matches_flax():
    vj_cell, flax_cell = _cells("SimpleCell", residual=True)
    check_parity(vj_cell, flax_cell, jnp.ones((B, H)), _x()[:, 0])


def test_lstm_parameter_names_match_linen():
    vj_cell, _ = _cells("LSTMCell")
    carry = vj_cell.initialize_carry(jax.random.key(0), (B, F))
    variables = vj_cell.init(jax.random.key(0), carry, _x()[:, 0])
    assert set(variables["params"]) == {"ii", "if", "ig", "io", "hi", "hf", "hg", "ho"}
    assert set(variables["params"]["ii"]) == {"kernel"}
    assert set(variables["params"]["hi"]) == {"kernel", "bias"}


@pytest.mark.parametrize("name", CELLS)
def test_rnn_over_sequence_matches_flax(name):
    vj_cell, flax_cell = _cells(name)
    variables, _, _ = check_parity(vj_rnn.RNN(vj_cell), flax_nn.RNN(flax_cell), _x())
    assert list(variables["params"]) == ["cell"]


@pytest.mark.parametrize("kwargs", [
    {"return_carry": True},
    {"reverse": True},
    {"reverse": True, "keep_order": True, "return_carry": True},
    {"time_major": True},
    {"unroll": 2},
])
def test_rnn_options_match_flax(kwargs):
    vj_cell, flax_cell = _cells("SimpleCell")
    check_parity(vj_rnn.RNN(vj_cell, **kwargs), flax_nn.RNN(flax_cell, **kwargs), _x())


@pytest.mark.parametrize("cell, kwargs", [
    ("LSTMCell", {"return_carry": True}),
    ("SimpleCell", {"return_carry": True, "reverse": True}),
    ("SimpleCell", {"reverse": True, "keep_order": True}),
])
def test_rnn_seq_lengths_match_flax(cell, kwargs):
    lengths = jnp.array([2, 4])
    kw = {"seq_lengths": lengths, **kwargs}
    vj_cell, flax_cell = _cells(cell)
    check_parity(vj_rnn.RNN(vj_cell), flax_nn.RNN(flax_cell), _x(), init_kwargs=kw, apply_kwargs=kw)


def test_rnn_initial_carry_and_call_overrides_match_flax():
    vj_cell, flax_cell = _cells("SimpleCell")
    kw = {"initial_carry": jnp.full((B, H), 0.3), "return_carry": True, "reverse": True}
    check_parity(vj_rnn.RNN(vj_cell), flax_nn.RNN(flax_cell), _x(), init_kwargs=kw, apply_kwargs=kw)


def test_rnn_single_step_sequence_matches_flax():
    vj_cell, flax_cell = _cells("SimpleCell")
    check_parity(vj_rnn.RNN(vj_cell), flax_nn.RNN(flax_cell), _x(shape=(B, 1, F)))


def test_rnn_init_equals_apply_with_mutable_params_on_empty_variables():
    rnn = vj_rnn.RNN(vj_rnn.GRUCell(H))
    x = _x()
    out, variables = rnn.init_with_output(jax.random.key(0), x)
    out2, created = rnn.apply({}, x, rngs={"params": jax.random.key(0)}, mutable=True)
    assert_close(out, out2, 0)
    assert_close(variables, created, 0)
    np.testing.assert_allclose(rnn.apply(variables, x), out, atol=1e-6)


def test_rnn_parameter_gradients_match_flax():
    vj_cell, flax_cell = _cells("GRUCell")
    x = _x()
    params = flax_nn.RNN(flax_cell).init(jax.random.key(0), x)["params"]

    def grads(rnn):
        return jax.grad(lambda p: jnp.sum(rnn.apply({"params": p}, x) ** 2))(params)

    assert_close(grads(vj_rnn.RNN(vj_cell)), grads(flax_nn.RNN(flax_cell)), 1e-5)


def test_cell_built_in_a_compact_method_belongs_to_that_module_as_in_linen():
    # Linen adopts the cell into the module whose compact method built it
    # (SimpleCell_0), not into the RNN: checkpoints depend on it.
    class VjNet(Module):
        @compact
        def __call__(self, x):
            fwd = vj_rnn.RNN(vj_rnn.SimpleCell(H))(x)
            return fwd + vj_rnn.RNN(vj_rnn.SimpleCell(H), reverse=True, keep_order=True)(x)

    class FlaxNet(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            fwd = flax_nn.RNN(flax_nn.SimpleCell(H))(x)
            return fwd + flax_nn.RNN(flax_nn.SimpleCell(H), reverse=True, keep_order=True)(x)

    variables, _, _ = check_parity(VjNet(), FlaxNet(), _x())
    assert list(variables["params"]) == ["SimpleCell_0", "SimpleCell_1"]


class _DropCell(vj_rnn.RNNCellBase):
    num_feature_axes = 1

    @compact
    def __call__(self, carry, inputs):
        return carry, Dropout(0.5, deterministic=False)(inputs)


def _dropout_masks(rnn):
    x = jnp.ones((1, T, 16))
    rngs = {"dropout": jax.random.key(2)}
    out = rnn.apply({}, x, rngs=rngs, initial_carry=jnp.zeros(()))
    np.testing.assert_array_equal(out, rnn.apply({}, x, rngs=rngs, initial_carry=jnp.zeros(())))
    return {np.asarray(out[0, t]).tobytes() for t in range(T)}


def test_dropout_in_cell_gets_a_fresh_key_each_step_when_its_stream_is_split():
    rnn = vj_rnn.RNN(_DropCell(), split_rngs={"params": False, "dropout": True})
    assert len(_dropout_masks(rnn)) == T


def test_dropout_in_cell_uses_one_mask_for_every_step_by_default():
    # Linen's default split_rngs={'params': False}: other streams are broadcast.
    assert len(_dropout_masks(vj_rnn.RNN(_DropCell()))) == 1
