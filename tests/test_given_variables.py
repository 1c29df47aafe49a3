"""What a given variables dict may hold: the shape the code expects in every collection (a
mismatch is a ``VariableShapeError``, never a silent broadcast), any floating dtype where a
floating one is expected (half-precision inference from an f32 checkpoint, as in Linen), and
array values only.  Model inputs may be array-likes where Linen's layers take them."""
import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn
from varjax import errors

X = jnp.arange(6.0).reshape(2, 3)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(4)(x)
        return nn.BatchNorm(use_running_average=not train)(x)


class LinenBlock(fnn.Module):
    @fnn.compact
    def __call__(self, x, train: bool = False):
        x = fnn.Dense(4)(x)
        return fnn.BatchNorm(use_running_average=not train)(x)


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype), tree)


@pytest.mark.parametrize("collections", [("params",), ("params", "batch_stats")])
def test_bfloat16_variables_from_a_float32_checkpoint_apply_as_in_linen(collections):
    variables = LinenBlock().init(jax.random.key(0), X)
    half = {c: _cast(v, jnp.bfloat16) if c in collections else v for c, v in variables.items()}
    with jax.numpy_dtype_promotion("standard"):   # mixed bf16/f32, as users run it
        ours = Block().apply(half, X)
        theirs = LinenBlock().apply(half, X)
    assert ours.dtype == theirs.dtype
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))


def test_train_step_with_bfloat16_batch_stats_updates_them():
    variables = Block().init(jax.random.key(0), X)
    variables["batch_stats"] = _cast(variables["batch_stats"], jnp.bfloat16)
    _, updates = Block().apply(variables, X, train=True, mutable=["batch_stats"])
    assert updates["batch_stats"]["BatchNorm_0"]["mean"].shape == (4,)


@pytest.mark.parametrize("mutable", [False, ["batch_stats"], True])
@pytest.mark.parametrize("train", [False, True])
def test_batch_stats_of_another_models_shape_is_an_error_not_a_broadcast(train, mutable):
    variables = Block().init(jax.random.key(0), X)
    variables["batch_stats"]["BatchNorm_0"]["mean"] = jnp.zeros((1,))
    if train and mutable is False:
        mutable = ["batch_stats"]     # a train step must be able to update them
    with pytest.raises(errors.VariableShapeError, match=r"float32\[1\].*float32\[4\]") as info:
        Block().apply(variables, X, train=train, mutable=mutable)
    assert info.value.collection == "batch_stats"
    assert info.value.path == ("BatchNorm_0", "mean")


class Counter(nn.Module):
    """A user collection declared with its shape: a given value must have it."""

    @nn.compact
    def __call__(self, x):
        total = self.variable("stats", "total", jnp.zeros, x.shape[-1:])
        if self.is_mutable_collection("stats"):
            total.value = total.value + x.sum(0)
        return x * total.value


@pytest.mark.parametrize("mutable", [False, ["stats"]])
def test_every_collection_checks_the_declared_shape(mutable):
    with pytest.raises(errors.VariableShapeError) as info:
        Counter().apply({"stats": {"total": jnp.zeros((1,))}}, X, mutable=mutable)
    assert (info.value.collection, info.value.path) == ("stats", ("total",))
    assert "test_given_variables.py" in info.value.source


def test_an_int_given_where_the_code_creates_floats_is_an_error():
    with pytest.raises(errors.VariableShapeError, match="dtype is of another kind"):
        Counter().apply({"stats": {"total": jnp.zeros((3,), jnp.int32)}}, X)


class DecodeCache(nn.Module):
    """Linen's decode-cache pattern: the variable is declared with the one-step shape and
    holds the full length, which the step writes back."""

    @nn.compact
    def __call__(self, x):
        cache = self.variable("cache", "keys", jnp.zeros, x.shape)
        index = self.variable("cache", "index", lambda: jnp.array(0, jnp.int32))
        if self.is_initializing():
            return x
        cache.value = jax.lax.dynamic_update_slice(cache.value, x, (index.value, 0))
        index.value = index.value + 1
        return cache.value


def test_a_variable_declared_with_another_shape_but_written_back_at_its_own_is_accepted():
    full = DecodeCache().init(jax.random.key(0), jnp.zeros((4, 3)))
    out, updates = DecodeCache().apply(full, jnp.ones((1, 3)), mutable=["cache"])
    assert out.shape == (4, 3)
    np.testing.assert_allclose(updates["cache"]["keys"][0], jnp.ones(3))


def test_a_nested_python_list_is_a_model_input_as_in_linen():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

    class LinenNet(fnn.Module):
        @fnn.compact
        def __call__(self, x):
            return fnn.Dense(2)(x)

    rows = [[1.0, 2.0, 3.0]]
    variables = LinenNet().init(jax.random.key(0), rows)
    assert jax.tree.map(jnp.shape, Net().init(jax.random.key(0), rows)) == \
        jax.tree.map(jnp.shape, variables)
    np.testing.assert_allclose(Net().apply(variables, rows), LinenNet().apply(variables, rows),
                               rtol=1e-6)


def test_shape_dtype_structs_are_variables_for_abstract_tracing():
    @vj.functionalize
    def f(x):
        return x * vj.param("w", jax.nn.initializers.ones, (3,))

    abstract = {"params": {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}}
    assert f.jaxpr(X[0], variables=abstract).out_avals[0].shape == (3,)
