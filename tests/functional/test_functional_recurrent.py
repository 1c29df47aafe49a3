"""``varjax.functional.recurrent``'s cell steps against the cell equations in ``jnp``."""
import jax
import jax.numpy as jnp
import numpy as np

from varjax import functional as F

A, B, C, D, H = (jax.random.normal(k, (2, 3)) for k in jax.random.split(jax.random.key(0), 5))
sig = jax.nn.sigmoid


def test_lstm_step_gates_the_cell_and_the_output():
    new_c, new_h = F.lstm_step(H, A, B, C, D)
    want_c = sig(B) * H + sig(A) * jnp.tanh(C)
    np.testing.assert_allclose(new_c, want_c, rtol=1e-6)
    np.testing.assert_allclose(new_h, sig(D) * jnp.tanh(want_c), rtol=1e-6)


def test_lstm_step_mixes_a_float32_carry_with_bfloat16_gates_explicitly():
    gates = [g.astype(jnp.bfloat16) for g in (A, B, C, D)]
    new_c, new_h = F.lstm_step(H, *gates)     # strict promotion: no implicit bf16 * f32
    assert new_c.dtype == jnp.float32 and new_h.dtype == jnp.float32


def test_gru_step_interpolates_between_the_candidate_and_the_old_state():
    z = sig(B)
    n = jnp.tanh(C + sig(A) * D)
    np.testing.assert_allclose(F.gru_step(H, A, B, C, D), (1.0 - z) * n + z * H, rtol=1e-6)


def test_mgu_step_with_and_without_the_reset_gate():
    f = sig(A)
    for reset, hidden in ((True, C * f), (False, C)):
        n = jnp.tanh(B + hidden)
        np.testing.assert_allclose(F.mgu_step(H, A, B, C, reset_gate=reset), (1.0 - f) * n + f * H,
                                   rtol=1e-6)


def test_simple_step_adds_the_old_state_inside_the_activation_when_residual():
    np.testing.assert_allclose(F.simple_step(H, A, B), jnp.tanh(A + B), rtol=1e-6)
    np.testing.assert_allclose(F.simple_step(H, A, B, residual=True), jnp.tanh(A + B + H), rtol=1e-6)


def test_fused_dense_is_one_dense_per_kernel():
    k1, k2, b1, b2 = jnp.ones((3, 2)), 2 * jnp.ones((3, 4)), -jnp.ones(2), jnp.arange(4.0)
    y1, y2 = F.fused_dense(A, [(k1, b1), (k2, b2)])
    np.testing.assert_allclose(y1, A @ k1 + b1.reshape(1, 2), rtol=1e-6)
    np.testing.assert_allclose(y2, A @ k2 + b2.reshape(1, 4), rtol=1e-6)
    y1, y2 = F.fused_dense(A, [(k1, None), (k2, None)])
    np.testing.assert_allclose(y2, A @ k2, rtol=1e-6)
