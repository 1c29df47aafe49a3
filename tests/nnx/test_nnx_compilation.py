"""``jit_partial``, ``cached_partial``, ``make_jaxpr``, ``checkify`` and ``call`` over NNX
objects, against flax.nnx: the same losses and parameters after Adam steps, the same
jaxpr inputs and values, the same checks, the same refusals (a ``ValueError`` there, a
``varjax.errors.ConfigError``, also a ``ValueError``, here)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx as flax_nnx
from jax.experimental import checkify as checkify_lib

import varjax as vj
from varjax import errors, nnx
from varjax.nnx.compilation import cached_partial, checkify, jit_partial, make_jaxpr
from varjax.nnx.proxy_caller import call

X, Y = jnp.arange(8.0).reshape(4, 2) / 7, jnp.ones((4, 3))


def _standard(fn, *args, **kwargs):
    """Optax mixes dtypes (Adam's ``b1 ** count``): it runs under standard promotion, as in
    ``test_nnx_training``; varjax's own code under the suite's strict promotion."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        return fn(*args, **kwargs)


ADAM = optax.GradientTransformationExtraArgs(
    lambda params: _standard(optax.adam(1e-2).init, params),
    lambda *args, **kwargs: _standard(optax.adam(1e-2).update, *args, **kwargs))


def _objects(lib):
    model = lib.Linear(2, 3, rngs=lib.Rngs(0))
    return model, lib.Optimizer(model, ADAM, wrt=lib.Param)


def _train_step(lib):
    def train_step(model, optimizer, x, y):
        loss, grads = lib.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss
    return train_step


def _three_steps(fn):
    return [float(fn(X, Y)) for _ in range(3)]


def test_jit_partial_trains_bitwise_as_flax_jit_partial_and_writes_back():
    ours, theirs = _objects(nnx), _objects(flax_nnx)
    losses = _three_steps(jit_partial(_train_step(nnx), *ours, graph_updates=False))
    flax_losses = _three_steps(flax_nnx.jit_partial(_train_step(flax_nnx), *theirs,
                                                    graph_updates=False))
    assert losses == flax_losses
    np.testing.assert_array_equal(ours[0].kernel[...], theirs[0].kernel[...])
    assert int(ours[1].step[...]) == int(theirs[1].step[...]) == 3


def test_jit_partial_in_tree_mode_writes_back_too():
    ours = _objects(nnx)
    before = np.asarray(ours[0].kernel[...])
    jit_partial(_train_step(nnx), *ours, graph=False)(X, Y)
    assert not np.array_equal(before, ours[0].kernel[...]) and int(ours[1].step[...]) == 1


def test_jit_partial_refuses_graph_updates_as_flax_does():
    with pytest.raises(ValueError):
        flax_nnx.jit_partial(_train_step(flax_nnx), *_objects(flax_nnx))
    with pytest.raises(errors.ConfigError, match="graph_updates=False"):
        jit_partial(_train_step(nnx), *_objects(nnx))


def test_jit_partial_refuses_an_object_among_the_call_arguments():
    model = _objects(nnx)[0]
    with pytest.raises(ValueError, match="Variable"):
        flax_nnx.jit_partial(lambda m, x: m(x), graph_updates=False)(_objects(flax_nnx)[0], X)
    with pytest.raises(errors.ConfigError, match="argument 0 .* holds a Linear"):
        jit_partial(lambda m, x: m(x), graph_updates=False)(model, X)


def test_jit_partial_static_argnums_counts_the_bound_arguments_as_one():
    def scaled(model, x, twice):
        return model(x) * (2 if twice else 1)
    ours, theirs = _objects(nnx)[0], _objects(flax_nnx)[0]
    got = jit_partial(scaled, ours, static_argnums=2, graph_updates=False)(X, True)
    want = flax_nnx.jit_partial(scaled, theirs, static_argnums=2, graph_updates=False)(X, True)
    np.testing.assert_array_equal(got, want)


def test_cached_partial_of_nnx_jit_trains_as_flax_cached_partial():
    ours, theirs = _objects(nnx), _objects(flax_nnx)
    losses = _three_steps(cached_partial(nnx.jit(_train_step(nnx)), *ours))
    flax_losses = _three_steps(flax_nnx.cached_partial(flax_nnx.jit(_train_step(flax_nnx)),
                                                       *theirs))
    assert losses == flax_losses
    np.testing.assert_array_equal(ours[0].bias[...], theirs[0].bias[...])


def test_cached_partial_refuses_tree_mode_as_flax_does():
    with pytest.raises(ValueError):
        flax_nnx.cached_partial(flax_nnx.jit(_train_step(flax_nnx)), *_objects(flax_nnx),
                                graph=False)
    with pytest.raises(errors.ConfigError, match="graph mode with graph updates"):
        cached_partial(nnx.jit(_train_step(nnx)), *_objects(nnx), graph=False)


def _counted(lib):
    class Counted(lib.Module):
        def __init__(self):
            self.a = lib.Param(jnp.array([1.0, jnp.inf]))
            self.calls = lib.BatchStat(jnp.array(0))

        def __call__(self):
            self.calls[...] += 1
            return jnp.sin(self.a[...])
    return Counted()


def test_make_jaxpr_has_flax_inputs_and_values_and_keeps_no_update():
    ours, theirs = _counted(nnx), _counted(flax_nnx)
    got = make_jaxpr(lambda m: m(), graph_updates=False)(ours)
    want = flax_nnx.make_jaxpr(lambda m: m(), graph_updates=False)(theirs)
    assert got.in_avals == want.in_avals and got.out_avals == want.out_avals
    leaves = jax.tree.leaves(flax_nnx.state(theirs))
    np.testing.assert_array_equal(jax.core.eval_jaxpr(got.jaxpr, got.consts, *leaves)[0],
                                  jax.core.eval_jaxpr(want.jaxpr, want.consts, *leaves)[0])
    assert int(ours.calls[...]) == int(theirs.calls[...]) == 0


def test_make_jaxpr_of_an_nnx_step_prints_with_vj_pretty():
    text = vj.pretty(make_jaxpr(lambda m: m(), graph_updates=False)(_counted(nnx)), color=False)
    assert "sin" in text


def test_make_jaxpr_refuses_graph_updates_as_flax_does():
    with pytest.raises(ValueError):
        flax_nnx.make_jaxpr(lambda m: m())(_counted(flax_nnx))
    with pytest.raises(errors.ConfigError, match="graph_updates=False"):
        make_jaxpr(lambda m: m())(_counted(nnx))


def test_checkify_reports_flax_error_and_writes_updates_back():
    ours, theirs = _counted(nnx), _counted(flax_nnx)
    err, out = checkify(lambda m: m(), errors=checkify_lib.float_checks)(ours)
    flax_err, flax_out = flax_nnx.checkify(lambda m: m(),
                                           errors=checkify_lib.float_checks)(theirs)
    assert str(err) == str(flax_err) and "sin" in str(err)
    np.testing.assert_array_equal(out, flax_out)
    assert int(ours.calls[...]) == int(theirs.calls[...]) == 1


def _stateful(lib):
    class StatefulLinear(lib.Module):
        def __init__(self, rngs):
            self.w = lib.Param(jax.random.uniform(rngs(), (3, 2)))
            self.count = lib.Variable(jnp.array(0, dtype=jnp.uint32))

        def increment(self):
            self.count[...] += 1

        def __call__(self, x):
            self.increment()
            return x @ self.w
    return StatefulLinear(lib.Rngs(0))


def test_call_runs_a_method_of_a_split_object_inside_raw_jit_as_flax():
    results = []
    for lib, call_ in ((nnx, call), (flax_nnx, flax_nnx.call)):
        graphdef, state = lib.split(_stateful(lib))

        @jax.jit
        def forward(x, state):
            y, (_, state) = call_((graphdef, state))(x)
            return y, state
        y, state = forward(jnp.ones((1, 3)), state)
        y, state = forward(jnp.ones((1, 3)), state)
        results.append((np.asarray(y), int(lib.merge(graphdef, state).count[...])))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1] == 2


def test_call_reaches_a_method_by_key_and_attribute():
    nodes = nnx.Dict(a=_stateful(nnx), b=_stateful(nnx))
    _, (graphdef, state) = call(nnx.split(nodes))["b"].increment()
    merged = nnx.merge(graphdef, state)
    assert int(merged["a"].count[...]) == 0 and int(merged["b"].count[...]) == 1


def test_an_nnx_jit_steps_effectful_ir_is_dumped_with_its_variable_reads_and_writes(
        tmp_path, monkeypatch):
    monkeypatch.setenv("VARJAX_DUMP_DIR", str(tmp_path))

    def counted_step(m):
        return m()
    nnx.jit(counted_step)(_counted(nnx))
    (effectful,) = tmp_path.glob("*counted_step*/00-effectful.txt")
    text = effectful.read_text()
    assert "var_get[batch_stats:m/calls]" in text and "var_set[batch_stats:m/calls]" in text
    assert "var_get[params:m/a]" in text and "sin" in text


def test_jit_partial_refuses_a_structural_change_to_a_bound_module_flax_loses():
    def grow(model, x):
        model.extra = nnx.Param(jnp.ones(1))
        return model(x)
    with pytest.raises(errors.TransformError, match="'extra' of .* was added"):
        jit_partial(grow, _objects(nnx)[0], graph_updates=False)(X)
