"""LayerNorm, RMSNorm, BatchNorm and GroupNorm against flax.linen."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import assert_close, check_parity

from varjax import errors
from varjax.nn.normalization import BatchNorm, GroupNorm, LayerNorm, RMSNorm

KEY = jax.random.key(7)
# Non-zero mean, so that centring and fast vs two-pass variance matter.
X = 2.0 + 3.0 * jax.random.normal(KEY, (4, 3, 6))


@pytest.mark.parametrize("kwargs", [
    {},
    {"use_bias": False, "use_scale": False},
    {"epsilon": 1e-2, "use_fast_variance": False},
    {"reduction_axes": (1, 2), "feature_axes": -1},
    {"reduction_axes": -1, "feature_axes": (1, 2)},
    {"force_float32_reductions": False},
])
def test_layer_norm_matches_linen(kwargs):
    check_parity(LayerNorm(**kwargs), flax_nn.LayerNorm(**kwargs), X)


@pytest.mark.parametrize("kwargs", [
    {"dtype": jnp.float16, "param_dtype": jnp.float16},
    {"dtype": jnp.float16, "param_dtype": jnp.float16, "force_float32_reductions": False},
    {"param_dtype": jnp.bfloat16},
])
def test_layer_norm_low_precision_runs_under_strict_promotion_and_matches_linen(kwargs):
    # Linen itself mixes float32 statistics with float16 parameters implicitly,
    # so it is compared under standard promotion; varjax must run under strict.
    v = LayerNorm(**kwargs).init(KEY, X)
    assert LayerNorm(**kwargs).apply(v, X).dtype == (kwargs.get("dtype") or jnp.float32)
    with jax.numpy_dtype_promotion("standard"):
        check_parity(LayerNorm(**kwargs), flax_nn.LayerNorm(**kwargs), X, atol=1e-2)


def test_layer_norm_output_is_normalized():
    y = LayerNorm(use_bias=False, use_scale=False).apply({}, X)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.std(-1), 1.0, atol=1e-3)


def test_layer_norm_mask_excludes_entries_from_the_statistics():
    mask = jnp.arange(6) < 4
    mask = jnp.broadcast_to(mask, X.shape)
    check_parity(LayerNorm(), flax_nn.LayerNorm(), X, init_kwargs={"mask": mask}, apply_kwargs={"mask": mask})
    y = LayerNorm(use_bias=False, use_scale=False).apply({}, X, mask=mask)
    np.testing.assert_allclose(y[..., :4].mean(-1), 0.0, atol=1e-5)


def test_layer_norm_bf16_input_under_strict_promotion_matches_linen_standard():
    x = X.astype(jnp.bfloat16)
    v = LayerNorm().init(KEY, x)
    with jax.numpy_dtype_promotion("standard"):
        want = flax_nn.LayerNorm().apply(v, x)
    got = LayerNorm().apply(v, x)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=1e-2)


def test_layer_norm_axis_name_reduces_across_the_mapped_axis_too():
    v = LayerNorm().init(KEY, X[0])
    y = jax.vmap(lambda x: LayerNorm(axis_name="i").apply(v, x), axis_name="i")(X)
    want = flax_nn.LayerNorm(reduction_axes=(0, -1)).apply(v, X)
    np.testing.assert_allclose(y, want, atol=1e-5)


@pytest.mark.parametrize("kwargs", [{}, {"use_scale": False}, {"reduction_axes": (1, 2), "feature_axes": -1}])
def test_rms_norm_matches_linen(kwargs):
    check_parity(RMSNorm(**kwargs), flax_nn.RMSNorm(**kwargs), X)


def test_rms_norm_has_no_bias_and_does_not_centre():
    v = RMSNorm().init(KEY, X)
    assert set(v["params"]) == {"scale"}
    y = RMSNorm().apply(v, X)
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(y * y, -1)), 1.0, atol=1e-4)
    assert float(jnp.abs(y.mean(-1)).max()) > 0.1


TRAIN = {"use_running_average": False}


@pytest.mark.parametrize("kwargs", [
    {},
    {"momentum": 0.5, "epsilon": 1e-3},
    {"axis": 1},
    {"axis": (1, 2)},
    {"use_fast_variance": False},
    {"use_bias": False, "use_scale": False},
])
def test_batch_norm_train_mode_matches_linen_output_and_updated_stats(kwargs):
    _, (_, stats), _ = check_parity(BatchNorm(**kwargs), flax_nn.BatchNorm(**kwargs), X,
                                    mutable=["batch_stats"], init_kwargs=TRAIN, apply_kwargs=TRAIN)
    assert set(stats["batch_stats"]) == {"mean", "var"}


def test_batch_norm_train_step_moves_running_stats_by_momentum():
    v = BatchNorm(momentum=0.9).init(KEY, X, use_running_average=False)
    assert set(v) == {"params", "batch_stats"}
    np.testing.assert_array_equal(v["batch_stats"]["mean"], jnp.zeros(6))  # init does not update
    _, new = BatchNorm(momentum=0.9).apply(v, X, use_running_average=False, mutable=["batch_stats"])
    np.testing.assert_allclose(new["batch_stats"]["mean"], 0.1 * X.mean((0, 1)), atol=1e-5)
    np.testing.assert_allclose(new["batch_stats"]["var"], 0.9 + 0.1 * X.var((0, 1)), atol=1e-4)


def test_batch_norm_eval_mode_uses_running_stats():
    flax_layer, layer = flax_nn.BatchNorm(use_running_average=True), BatchNorm(use_running_average=True)
    v, _, _ = check_parity(layer, flax_layer, X)
    k1, k2 = jax.random.split(KEY)
    stats = {"mean": jax.random.normal(k1, (6,)), "var": jnp.exp(jax.random.normal(k2, (6,)))}
    v = {**v, "batch_stats": stats}
    got, want = layer.apply(v, X), flax_layer.apply(v, X)
    assert_close(got, want, 1e-5)
    with jax.numpy_rank_promotion("allow"):
        p = v["params"]
        manual = (X - stats["mean"]) / jnp.sqrt(stats["var"] + 1e-5) * p["scale"] + p["bias"]
    np.testing.assert_allclose(got, manual, atol=1e-4)


def test_batch_norm_call_arg_selects_mode_per_call():
    layer = BatchNorm()
    v = layer.init(KEY, X, use_running_average=True)
    y_eval = layer.apply(v, X, use_running_average=True)
    np.testing.assert_allclose(y_eval, X / jnp.sqrt(1 + 1e-5), atol=1e-5)
    y_train, _ = layer.apply(v, X, use_running_average=False, mutable=["batch_stats"])
    np.testing.assert_allclose(y_train.mean((0, 1)), 0.0, atol=1e-5)


def test_batch_norm_mask_matches_linen():
    mask = jnp.broadcast_to((jnp.arange(4) < 3)[:, None, None], X.shape)
    kw = {**TRAIN, "mask": mask}
    check_parity(BatchNorm(), flax_nn.BatchNorm(), X, mutable=["batch_stats"], init_kwargs=kw,
                 apply_kwargs=kw)


def test_batch_norm_axis_name_averages_stats_across_vmapped_replicas():
    xs = X.reshape(2, 2, 3, 6)  # 2 replicas of a (2, 3, 6) batch
    layer, flax_layer = BatchNorm(axis_name="batch"), flax_nn.BatchNorm(axis_name="batch")
    v = flax_layer.init(KEY, xs[0], use_running_average=False)
    assert jax.tree.structure(layer.init(KEY, xs[0], use_running_average=False)) == jax.tree.structure(v)

    def run(mdl):
        return jax.vmap(lambda x: mdl.apply(v, x, use_running_average=False, mutable=["batch_stats"]),
                        axis_name="batch")(xs)

    (y, stats), (want_y, want_stats) = run(layer), run(flax_layer)
    assert_close((y, stats), (want_y, dict(want_stats)), 1e-5)
    # Global statistics: the same as one BatchNorm over the whole batch.
    full_y, full_stats = BatchNorm().apply(v, X, use_running_average=False, mutable=["batch_stats"])
    np.testing.assert_allclose(y.reshape(X.shape), full_y, atol=1e-5)
    np.testing.assert_allclose(stats["batch_stats"]["mean"][0], full_stats["batch_stats"]["mean"], atol=1e-5)


def test_batch_norm_train_mode_needs_mutable_batch_stats():
    v = BatchNorm().init(KEY, X, use_running_average=False)
    with pytest.raises(errors.ImmutableCollectionError, match="batch_stats"):
        BatchNorm().apply(v, X, use_running_average=False)


def test_batch_norm_use_running_average_given_twice_is_an_error():
    with pytest.raises(errors.ConfigError, match="both as a module field and as a call argument"):
        BatchNorm(use_running_average=True).init(KEY, X, use_running_average=True)


def test_batch_norm_use_running_average_given_nowhere_is_an_error():
    with pytest.raises(errors.ConfigError, match="use_running_average' was given neither"):
        BatchNorm().init(KEY, X)


@pytest.mark.parametrize("kwargs", [
    {"num_groups": 2},
    {"num_groups": None, "group_size": 2},
    {"num_groups": 3, "reduction_axes": (-1,)},
    {"num_groups": 1, "use_fast_variance": False, "use_bias": False},
])
def test_group_norm_matches_linen(kwargs):
    x = X.reshape(2, 2, 3, 6)
    check_parity(GroupNorm(**kwargs), flax_nn.GroupNorm(**kwargs), x)


def test_group_norm_normalizes_each_group_of_each_example():
    y = GroupNorm(num_groups=2, use_bias=False, use_scale=False).apply({}, X)
    groups = y.reshape(4, 3, 2, 3)
    np.testing.assert_allclose(groups.mean((1, 3)), 0.0, atol=1e-5)
    np.testing.assert_allclose(groups.var((1, 3)), 1.0, atol=1e-3)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_groups": 4}, "does not divide"),
    ({"num_groups": None, "group_size": 4}, "not a multiple"),
    ({"num_groups": 2, "group_size": 3}, "exactly one"),
    ({"num_groups": None}, "exactly one"),
    ({"num_groups": 2, "reduction_axes": (1,)}, "last axis"),
])
def test_group_norm_rejects_inconsistent_groups(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GroupNorm(**kwargs).init(KEY, X)
