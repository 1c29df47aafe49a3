"""Every varjax error path: the message names the collection, the variable and this file's line."""
import os
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn
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


# --- tracebacks: varjax's frames are hidden, as JAX hides its own ---------------------------

_VARJAX_DIRS = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d)
                     + os.sep for d in ("varjax", "passes"))


def _frames(exc: BaseException) -> tuple[int, int, int]:
    """(varjax frames, JAX frames, frames in this file) of ``exc``'s traceback."""
    files = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    return (sum(f.startswith(_VARJAX_DIRS) for f in files),
            sum(f"{os.sep}jax{os.sep}" in f for f in files),
            sum(f == __file__ for f in files))


class _Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(x)


def _missing_variable():
    _Dense().apply({"params": {}}, X)


def _missing_param():
    @vj.functionalize
    def f(x):
        return x * vj.param("w", jax.nn.initializers.ones, (3,))
    f.apply({}, X)


def _bad_pipeline():
    vj.functionalize(lambda x: x, passes="no-such-pass")


def _missing_rng():
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(x)
    Drop().apply({}, X)


@pytest.mark.parametrize("trigger", [_missing_variable, _missing_param, _bad_pipeline, _missing_rng])
def test_traceback_hides_varjax_frames(trigger, monkeypatch):
    monkeypatch.delenv(errors.TRACEBACK_FILTERING_ENV, raising=False)
    with pytest.raises(errors.VarjaxError) as info:
        trigger()
    filtered = _frames(info.value)
    monkeypatch.setenv(errors.TRACEBACK_FILTERING_ENV, "off")
    with pytest.raises(errors.VarjaxError) as info_off:
        trigger()
    full = _frames(info_off.value)
    # Before filtering: 5 to 23 varjax frames; now the entry point that did not filter its
    # own frame, if any, and the raise site.
    assert filtered[0] <= 2 < full[0], (filtered, full)
    assert filtered[2] == full[2]          # every frame of the user's code is kept
    assert filtered[1] <= full[1]          # and no JAX frame comes back
    tb = traceback.extract_tb(info.value.__traceback__)
    assert tb[-1].filename.startswith(_VARJAX_DIRS) and "raise" in tb[-1].line
    assert any("VARJAX_TRACEBACK_FILTERING=off" in n for n in info.value.__notes__)
    assert not any("VARJAX_TRACEBACK" in n for n in getattr(info_off.value, "__notes__", ()))


def test_traceback_under_jax_jit_keeps_jax_filtering(monkeypatch):
    monkeypatch.delenv(errors.TRACEBACK_FILTERING_ENV, raising=False)
    with pytest.raises(errors.VarjaxError) as info:
        jax.jit(lambda x: _Dense().apply({"params": {}}, x))(X)
    varjax_frames, jax_frames, own = _frames(info.value)
    assert varjax_frames <= 2 and own >= 2
    assert jax_frames == 0       # JAX's filtering of its own frames still applies


def test_other_exceptions_keep_every_frame(monkeypatch):
    """A bug or an error in user code is not varjax's to trim."""
    monkeypatch.delenv(errors.TRACEBACK_FILTERING_ENV, raising=False)

    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            raise ValueError("user bug")

    with pytest.raises(ValueError, match="user bug") as info:
        Bad().init(jax.random.key(0), X)
    assert _frames(info.value)[0] > 5


def test_boundary_costs_one_call_and_keeps_the_signature():
    import inspect
    assert "variables" in inspect.signature(vj.functionalize(lambda x: x).apply).parameters
    assert vj.functionalize.__name__ == "functionalize" and vj.functionalize.__doc__
