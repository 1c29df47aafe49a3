"""Every varjax error path: the message names the collection, the variable and this file's line."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from varjax import errors

X = jnp.ones((3,), jnp.float32)
HERE = "test_errors.py:"


def _assert_names(exc: errors.VarjaxError, collection: str, path: str) -> None:
    text = str(exc)
    assert f"collection: {collection}" in text
    assert f"variable:   {path}" in text
    assert HERE in text, text
    assert "fix:" in text


def test_write_to_immutable_collection():
    @vj.functionalize
    def f(x):
        n = vj.variable("counters", "n", lambda: jnp.zeros(()))
        n.value = n.value + 1.0
        return x

    v = f.init(jax.random.key(0), X)
    with pytest.raises(errors.ImmutableCollectionError) as info:
        f.apply(v, X)
    _assert_names(info.value, "counters", "n")
    assert "mutable=['counters']" in str(info.value)


def test_missing_variable_outside_init():
    @vj.functionalize
    def f(x):
        return x * vj.param("w", jax.nn.initializers.ones, (3,))

    with pytest.raises(errors.MissingVariableError) as info:
        f.apply({}, X)
    _assert_names(info.value, "params", "w")


def test_missing_variable_without_init_fn():
    @vj.functionalize
    def f(x):
        return x * vj.variable("stats", "mean").value

    with pytest.raises(errors.MissingVariableError) as info:
        f.apply({}, X, mutable=True)
    _assert_names(info.value, "stats", "mean")


def test_missing_rng_stream():
    @vj.functionalize
    def f(x):
        return jax.random.bernoulli(vj.make_rng("dropout"), 0.5, x.shape)

    with pytest.raises(errors.MissingRngError) as info:
        f.apply({}, X)
    assert "RNG stream 'dropout'" in str(info.value) and HERE in str(info.value)


def test_param_creation_needs_the_params_stream():
    @vj.functionalize
    def f(x):
        return x * vj.param("w", jax.nn.initializers.ones, (3,))

    with pytest.raises(errors.MissingRngError) as info:
        f.apply({}, X, mutable=True)
    _assert_names(info.value, "params", "w")


def test_given_variable_with_the_wrong_shape():
    @vj.functionalize
    def f(x):
        return x * vj.param("w", jax.nn.initializers.ones, (3,))

    with pytest.raises(errors.VariableShapeError) as info:
        f.apply({"params": {"w": jnp.ones((4,))}}, X)
    _assert_names(info.value, "params", "w")
    assert "float32[4]" in str(info.value) and "float32[3]" in str(info.value)


def test_given_variable_with_the_wrong_dtype():
    @vj.functionalize
    def f(x):
        return x * vj.param("w", jax.nn.initializers.ones, (3,), jnp.float32)

    with pytest.raises(errors.VariableShapeError):
        f.apply({"params": {"w": jnp.ones((3,), jnp.int32)}}, X)


def test_creation_inside_a_raw_loop_is_impossible():
    @vj.functionalize
    def f(xs):
        def body(c, x):
            s = vj.variable("state", "s", lambda: jnp.zeros(()))
            s.value = s.value + x
            return c, None
        return jax.lax.scan(body, 0.0, xs)[0]

    with pytest.raises(errors.VariableCreationError) as info:
        f.init(jax.random.key(0), X)
    _assert_names(info.value, "state", "s")
    assert "'scan' (a loop)" in str(info.value)


def test_creation_in_only_one_branch_names_the_branches():
    @vj.functionalize
    def f(p, x):
        def yes(x):
            vj.variable("state", "s", lambda: jnp.zeros(())).value = x.sum()
            return x
        return jax.lax.cond(p, yes, lambda x: x, x)

    with pytest.raises(errors.VariableCreationError) as info:
        f.init(jax.random.key(0), jnp.bool_(True), X)
    _assert_names(info.value, "state", "s")
    assert "created in branch 1 " in str(info.value) and "not in branch 0," in str(info.value)


def test_structure_change_inside_a_loop():
    @vj.functionalize
    def f(xs):
        vj.sow("intermediates", "h", xs[0])

        def body(c, x):
            vj.sow("intermediates", "h", x)   # appends: the tuple grows every step
            return c, None
        return jax.lax.scan(body, 0.0, xs)[0]

    with pytest.raises(errors.VariableStructureError) as info:
        f.apply({}, X, mutable=["intermediates"])
    _assert_names(info.value, "intermediates", "h")


def test_variable_api_outside_functionalize():
    with pytest.raises(errors.ScopeError) as info:
        vj.param("w", jax.nn.initializers.ones, (3,))
    assert HERE in str(info.value) and "@vj.functionalize" in str(info.value)


def test_raw_vmap_with_a_batched_write_is_rejected():
    @vj.functionalize
    def f(xs):
        s = vj.variable("state", "s", lambda: jnp.zeros(()))

        def per_example(x):
            s.value = x
            return x
        return jax.vmap(per_example)(xs)

    with pytest.raises(errors.TransformError) as info:
        f.init(jax.random.key(0), X)
    _assert_names(info.value, "state", "s")
    assert "raw jax.vmap" in str(info.value) and "vj.vmap" in str(info.value)


def test_while_cond_fun_must_not_write():
    @vj.functionalize
    def f(x):
        s = vj.variable("state", "s", lambda: jnp.zeros(()))

        def cond(i):
            s.value = s.value + 1.0
            return i < 3
        return jax.lax.while_loop(cond, lambda i: i + 1, 0)

    with pytest.raises(errors.UnsupportedPrimitiveError) as info:
        f.init(jax.random.key(0), X)
    _assert_names(info.value, "state", "s")
    assert "cond_fun" in str(info.value)


def test_errors_share_one_base_class():
    for cls in (errors.ImmutableCollectionError, errors.MissingVariableError, errors.MissingRngError,
                errors.VariableShapeError, errors.VariableCreationError,
                errors.VariableStructureError, errors.TransformError,
                errors.UnsupportedPrimitiveError, errors.ScopeError, errors.PipelineError,
                errors.PassError, errors.VerificationError):
        assert issubclass(cls, errors.VarjaxError)
    np.testing.assert_equal(errors.format_path(("a", "b")), "a/b")


def test_reserved_collection_names_are_rejected():
    @vj.functionalize
    def f(x):
        return vj.variable("__rng__", "k", jnp.zeros, ()).value

    with pytest.raises(errors.ScopeError, match="reserved") as info:
        f.init(jax.random.key(0), X)
    assert HERE in str(info.value)
