"""cast-params keeps the dtypes JAX fixes: variables written under the pass keep theirs.

The pass computes in the low dtype, but a value written to a variable is cast back to the
dtype the variable was declared (or, when the write creates it, initialized) with, as a
region's outputs are: a stored variable never changes dtype, and a second read of it
still type-checks.
"""
import jax
import jax.numpy as jnp
import numpy as np

from varjax import nn

KEY = jax.random.key(0)
BF16 = "cast-params{dtype=bfloat16}"
X = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), jnp.float32)


def dtypes(tree):
    return jax.tree.map(lambda a: a.dtype, tree)


class TwoBatchNorms(nn.Module):
    @nn.compact
    def __call__(self, x):
        bn = nn.BatchNorm(use_running_average=False)
        return bn(bn(nn.Dense(3)(x)))


def test_batch_stats_keep_float32_under_cast_params_and_batchnorm_twice_runs():
    plain = TwoBatchNorms().init(KEY, X)
    cast = TwoBatchNorms().init(KEY, X, passes=BF16)
    assert dtypes(cast) == dtypes(plain)
    out, upd = TwoBatchNorms().apply(plain, X, mutable=["batch_stats"], passes=BF16)
    _, want = TwoBatchNorms().apply(plain, X, mutable=["batch_stats"])
    assert out.dtype == jnp.float32
    assert dtypes(upd) == dtypes(want)
    # the statistics of bfloat16 activations: equal to float32's at bfloat16's precision
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2), upd, want)


class Ema(nn.Module):
    """A running statistic updated from a product with a param: read back after the write."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", jax.nn.initializers.normal(1.0), (1, 3))
        s = self.variable("batch_stats", "s", lambda: x * w)   # created from cast values
        s.value = 0.9 * s.value + x * w
        return s.value * w


def ema_by_hand(w, s, x):
    """What the pass computes for ``Ema`` twice: ``w`` and whatever meets it in
    bfloat16, ``s`` stored in float32 between the calls."""
    lw = w.astype(jnp.bfloat16)
    for _ in range(2):
        s = ((0.9 * s).astype(jnp.bfloat16) + x.astype(jnp.bfloat16) * lw).astype(jnp.float32)
        x = (s.astype(jnp.bfloat16) * lw).astype(jnp.float32)
    return x, s


class EmaTwice(nn.Module):
    @nn.compact
    def __call__(self, x):
        ema = Ema()
        return ema(ema(x))


def test_variable_written_under_cast_params_equals_hand_model_with_float32_state():
    v = EmaTwice().init(KEY, X, passes=BF16)
    w, s = v["params"]["Ema_0"]["w"], v["batch_stats"]["Ema_0"]["s"]
    assert s.dtype == jnp.float32     # created from a bfloat16 product, stored as initialized
    created = (X.astype(jnp.bfloat16) * w.astype(jnp.bfloat16)).astype(jnp.float32)
    np.testing.assert_array_equal(s, ema_by_hand(w, created, X)[1])   # init runs both updates
    out, upd = jax.jit(lambda v, x: EmaTwice().apply(v, x, mutable=["batch_stats"],
                                                     passes=BF16))(v, X)
    want_y, want_s = jax.jit(ema_by_hand)(w, s, X)   # compiled like the pass: XLA may round alike
    assert upd["batch_stats"]["Ema_0"]["s"].dtype == jnp.float32
    np.testing.assert_array_equal(upd["batch_stats"]["Ema_0"]["s"], want_s)
    np.testing.assert_array_equal(out, want_y)
