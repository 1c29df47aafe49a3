"""The recurrent pieces added for Linen parity (issue 18), against flax.linen on the same
variables: OptimizedLSTMCell, MGUCell, ConvLSTMCell (one step and under RNN), Bidirectional.
Init values are not compared (the RNG derivation is separate work), layouts are."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import assert_close, check_parity

import varjax.nn as nn

B, T, F, H = 2, 4, 3, 5


def _x(shape, seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _cells(name, *args, **kw):
    return getattr(nn, name)(*args, **kw), getattr(flax_nn, name)(*args, **kw)


VECTOR_CELLS = [("OptimizedLSTMCell", {}), ("MGUCell", {}), ("MGUCell", {"reset_gate": False})]


@pytest.mark.parametrize("name, kw", VECTOR_CELLS)
def test_vector_cell_step_matches_linen_with_grads(name, kw):
    vj_cell, flax_cell = _cells(name, H, **kw)
    carry = vj_cell.initialize_carry(jax.random.key(3), (B, F))
    assert_close(carry, flax_cell.initialize_carry(jax.random.key(3), (B, F)), 0)
    carry = jax.tree.map(lambda c: c + 0.5, carry)
    variables, _, _ = check_parity(vj_cell, flax_cell, carry, _x((B, F)))
    grads = [jax.grad(lambda p, m=m: jnp.sum(m.apply({"params": p}, carry, _x((B, F)))[1]))(
        variables["params"]) for m in (vj_cell, flax_cell)]
    assert_close(grads[0], grads[1], 1e-5)


@pytest.mark.parametrize("name", ["OptimizedLSTMCell", "MGUCell"])
def test_vector_cell_over_a_sequence_matches_linen(name):
    vj_cell, flax_cell = _cells(name, H)
    check_parity(nn.RNN(vj_cell), flax_nn.RNN(flax_cell), _x((B, T, F)))


def test_optimized_lstm_cell_has_lstm_cell_s_parameters_and_outputs():
    opt, plain = nn.OptimizedLSTMCell(H), nn.LSTMCell(H)
    carry = jax.tree.map(lambda c: c + 0.5, plain.initialize_carry(jax.random.key(0), (B, F)))
    variables = plain.init(jax.random.key(0), carry, _x((B, F)))
    assert jax.tree.map(jnp.shape, opt.init(jax.random.key(0), carry, _x((B, F)))) == \
        jax.tree.map(jnp.shape, variables)
    assert_close(opt.apply(variables, carry, _x((B, F))), plain.apply(variables, carry, _x((B, F))), 1e-5)


def test_mgu_cell_forget_bias_starts_at_one_as_in_linen():
    # Constant initializers: init values are comparable without the RNG work.
    vj_cell, flax_cell = _cells("MGUCell", H)
    carry = vj_cell.initialize_carry(jax.random.key(0), (B, F))
    biases = [{k: v["bias"] for k, v in cell.init(jax.random.key(0), carry, _x((B, F)))["params"].items()
               if "bias" in v} for cell in (vj_cell, flax_cell)]
    assert_close(biases[0], biases[1], 0)
    assert float(biases[0]["if"][0]) == 1.0


@pytest.mark.parametrize("kw, shape, over_sequence", [
    ({"kernel_size": (3,)}, (B, T, 6, 2), True),
    ({"kernel_size": (2, 2), "use_bias": False}, (B, T, 4, 3, 2), False),
])
def test_conv_lstm_cell_matches_linen(kw, shape, over_sequence):
    vj_cell, flax_cell = _cells("ConvLSTMCell", 4, **kw)
    step_shape = shape[:1] + shape[2:]
    carry = vj_cell.initialize_carry(jax.random.key(3), step_shape)
    assert_close(carry, flax_cell.initialize_carry(jax.random.key(3), step_shape), 0)
    assert vj_cell.num_feature_axes == flax_cell.num_feature_axes == len(kw["kernel_size"]) + 1
    check_parity(vj_cell, flax_cell, jax.tree.map(lambda c: c + 0.3, carry), _x(step_shape))
    if over_sequence:
        check_parity(nn.RNN(vj_cell), flax_nn.RNN(flax_cell), _x(shape))


def _bidirectional(lib, **kw):
    return lib.Bidirectional(lib.RNN(lib.LSTMCell(H)), lib.RNN(lib.SimpleCell(H)), **kw)


@pytest.mark.parametrize("apply_kwargs", [
    {"seq_lengths": jnp.array([4, 2]), "return_carry": True},
    {"time_major": True},
])
def test_bidirectional_matches_linen(apply_kwargs):
    x = _x((T, B, F)) if apply_kwargs.get("time_major") else _x((B, T, F))
    variables, _, _ = check_parity(_bidirectional(nn), _bidirectional(flax_nn), x, apply_kwargs=apply_kwargs)
    assert set(variables["params"]) == {"forward_rnn", "backward_rnn"}


def test_bidirectional_fields_initial_carry_and_merge_fn_match_linen():
    x = _x((B, T, F))
    carry = (tuple(jnp.full((B, H), 0.1 * k) for k in (1, 2)), jnp.full((B, H), 0.3))  # (LSTM, Simple)
    kw = {"merge_fn": lambda a, b: a + b, "return_carry": True}
    _, (vj_carry, vj_out), _ = check_parity(_bidirectional(nn, **kw), _bidirectional(flax_nn, **kw), x,
                                            apply_kwargs={"initial_carry": carry})
    assert vj_out.shape == (B, T, H)


def test_flip_sequences_keeps_padding_at_the_end():
    x = jnp.array([[1, 0, 0], [2, 3, 0], [4, 5, 6]])
    out = nn.recurrent.flip_sequences(x, jnp.array([1, 2, 3]), num_batch_dims=1, time_major=False)
    assert out.tolist() == [[1, 0, 0], [3, 2, 0], [6, 5, 4]]


def _sst2_encoder(lib):
    """The SST-2 example's encoder shape: a compact cell method under ``nn.transforms.scan``."""
    import functools

    class SimpleLSTM(lib.Module):
        @functools.partial(lib.transforms.scan, variable_broadcast="params", in_axes=1, out_axes=1,
                           split_rngs={"params": False})
        @lib.compact
        def __call__(self, carry, x):
            return lib.OptimizedLSTMCell(features=carry[0].shape[-1])(carry, x)

    class Encoder(lib.Module):
        @lib.compact
        def __call__(self, x):
            carry = lib.OptimizedLSTMCell(H, parent=None).initialize_carry(jax.random.key(0), (B, F))
            carry, ys = SimpleLSTM()(carry, x)
            return carry[1], ys
    return Encoder()


def test_sst2_style_scanned_optimized_lstm_matches_linen():
    x = _x((B, T, F))
    variables, _, _ = check_parity(_sst2_encoder(nn), _sst2_encoder(flax_nn), x)
    assert set(variables["params"]["SimpleLSTM_0"]["OptimizedLSTMCell_0"]) == {
        "hf", "hg", "hi", "ho", "if", "ig", "ii", "io"}


def test_bidirectional_with_one_rnn_twice_shares_its_parameters_as_in_linen():
    def model(lib):
        rnn = lib.RNN(lib.SimpleCell(H))
        return lib.Bidirectional(rnn, rnn)
    variables, _, _ = check_parity(model(nn), model(flax_nn), _x((B, T, F)))
    assert list(variables["params"]) == ["forward_rnn"]


@pytest.mark.parametrize("name, args", [("OptimizedLSTMCell", (H,)), ("ConvLSTMCell", (H, (2,)))])
def test_bfloat16_cells_run_under_strict_promotion_and_match_linen(name, args):
    vj_cell, flax_cell = _cells(name, *args, dtype=jnp.bfloat16)
    shape = (B, 4, F) if name == "ConvLSTMCell" else (B, F)
    carry = vj_cell.initialize_carry(jax.random.key(3), shape)        # float32, like the params
    variables = vj_cell.init(jax.random.key(0), carry, _x(shape))
    out = vj_cell.apply(variables, carry, _x(shape))                  # strict promotion (conftest)
    with jax.numpy_dtype_promotion("standard"):                       # Linen mixes dtypes implicitly
        expected = flax_cell.apply(variables, carry, _x(shape))
    assert jax.tree.map(jnp.result_type, out) == jax.tree.map(jnp.result_type, expected)
    assert_close(out, expected, 2e-2)
