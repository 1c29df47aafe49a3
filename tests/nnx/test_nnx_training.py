"""``nnx.Optimizer``, ``nnx.ModelAndOptimizer`` and ``nnx.metrics`` against flax.nnx 0.12.8:
after the same steps from the same seed and gradients, the parameters, the optimizer's
Variables (paths, types, dtypes, values), the step count and the metrics' Variables and
values are flax.nnx's bit for bit, eagerly and under ``nnx.jit``/``vj.jit``."""
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx as flax_nnx

import varjax as vj
from varjax import errors, nnx
from varjax.nnx import metrics
from varjax.nnx.metrics import Metric, MultiMetric
from varjax.nnx.optimizer import ModelAndOptimizer, OptArray, Optimizer, OptVariable

X = jax.random.normal(jax.random.key(1), (4, 2))
Y = jax.random.normal(jax.random.key(2), (4, 2))


def _standard(fn, *args, **kwargs):
    """Optax and flax.nnx's metrics mix dtypes (Adam's ``b1 ** count``), so they run under
    standard promotion; varjax's own code runs under the suite's strict promotion."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        return fn(*args, **kwargs)


def _tx(tx):
    """``tx`` run under standard promotion (``_standard``), for both libraries."""
    return optax.GradientTransformationExtraArgs(
        lambda params: _standard(tx.init, params),
        lambda *args, **kwargs: _standard(tx.update, *args, **kwargs))


ADAM = _tx(optax.adam(1e-2))


def _model(lib):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.lin1 = lib.Linear(2, 3, rngs=rngs)
            self.lin2 = lib.Linear(3, 2, rngs=rngs)
            self.calls = lib.BatchStat(jnp.zeros(()))

        def __call__(self, x):
            self.calls[...] += 1
            return self.lin2(jnp.tanh(self.lin1(x)))
    return Model(lib.Rngs(0))


def _loss(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


def _bitwise(ours, theirs):
    """Two trees of arrays (ours a varjax state, theirs flax.nnx's): the same paths, dtypes
    and bits."""
    a, b = nnx.to_pure_dict(ours), flax_nnx.to_pure_dict(theirs)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def _same_arrays(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def _same_grads(ours, theirs, only=None):
    """Each library's gradient of ``_loss`` (of the Params, or of those whose path contains
    ``only``), so each model's counter moves, ours then overwritten with flax.nnx's values:
    the same gradient for both optimizers, whatever XLA's fusion of the two backward
    passes."""
    def argnums(lib):
        return 0 if only is None else lib.DiffState(0, lib.PathContains(only))
    grads = nnx.grad(_loss, argnums=argnums(nnx))(ours, X, Y)
    fgrads = flax_nnx.grad(_loss, argnums=argnums(flax_nnx))(theirs, X, Y)
    nnx.replace_by_pure_dict(grads, flax_nnx.to_pure_dict(fgrads))
    return grads, fgrads


# --- Optimizer ------------------------------------------------------------------------------


def test_a_new_optimizer_has_flax_nnx_variables_paths_types_and_values():
    ours, theirs = _model(nnx), _model(flax_nnx)
    opt = Optimizer(ours, ADAM, wrt=nnx.Param)
    fopt = flax_nnx.Optimizer(theirs, ADAM, wrt=flax_nnx.Param)
    _bitwise(nnx.state(opt), flax_nnx.state(fopt))
    assert type(opt.step) is nnx.OptState and opt.step[...].dtype == jnp.uint32
    adam = opt.opt_state[0]
    assert type(adam.count) is OptArray
    assert type(adam.mu["lin1"]["kernel"]) is OptVariable
    assert sorted(nnx.state(opt)) == ["opt_state", "step"]      # tx and wrt are static


@pytest.mark.parametrize("tx", [ADAM, _tx(optax.chain(optax.clip_by_global_norm(0.1),
                                                    optax.adamw(1e-2)))],
                         ids=["adam", "clip_adamw"])
def test_steps_with_the_same_grads_give_flax_nnx_params_state_and_step_bitwise(tx):
    ours, theirs = _model(nnx), _model(flax_nnx)
    opt = Optimizer(ours, tx, wrt=nnx.Param)
    fopt = flax_nnx.Optimizer(theirs, tx, wrt=flax_nnx.Param)
    for _ in range(3):
        grads, fgrads = _same_grads(ours, theirs)
        updates = opt.update(ours, grads)
        fupdates = fopt.update(theirs, fgrads)
        _same_arrays(updates, fupdates)
    _bitwise(nnx.state(ours, nnx.Param), flax_nnx.state(theirs, flax_nnx.Param))
    _bitwise(nnx.state(opt), flax_nnx.state(fopt))
    assert int(opt.step[...]) == 3


def _step(lib):
    def step(model, opt, x, y):
        grads = lib.grad(_loss)(model, x, y)
        opt.update(model, grads)
    return step


@pytest.mark.parametrize("jit", [nnx.jit, vj.jit], ids=["nnx_jit", "vj_jit"])
def test_a_jitted_train_step_updates_model_and_optimizer_in_place_as_flax_nnx_jit(jit):
    ours, theirs = _model(nnx), _model(flax_nnx)
    opt = Optimizer(ours, ADAM, wrt=nnx.Param)
    fopt = flax_nnx.Optimizer(theirs, ADAM, wrt=flax_nnx.Param)
    step, fstep = jit(_step(nnx)), flax_nnx.jit(_step(flax_nnx))
    for _ in range(3):
        step(ours, opt, X, Y)
        fstep(theirs, fopt, X, Y)
    _bitwise(nnx.state(ours), flax_nnx.state(theirs))
    _bitwise(nnx.state(opt), flax_nnx.state(fopt))
    assert int(opt.step[...]) == 3 and float(ours.calls[...]) == 3.0


def test_eager_train_steps_with_each_librarys_own_grads_match_flax_nnx():
    ours, theirs = _model(nnx), _model(flax_nnx)
    opt = Optimizer(ours, _tx(optax.sgd(0.1, momentum=0.9)), wrt=nnx.Param)
    fopt = flax_nnx.Optimizer(theirs, _tx(optax.sgd(0.1, momentum=0.9)), wrt=flax_nnx.Param)
    for _ in range(2):
        _step(nnx)(ours, opt, X, Y)
        _step(flax_nnx)(theirs, fopt, X, Y)
    # Each library's own eager gradient: the two may differ in the last bit.
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(nnx.state(opt))),
                    jax.tree.leaves(flax_nnx.to_pure_dict(flax_nnx.state(fopt)))):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_wrt_selects_the_variables_the_optimizer_keeps_and_updates():
    ours, theirs = _model(nnx), _model(flax_nnx)
    opt = Optimizer(ours, ADAM, wrt=nnx.PathContains("kernel"))
    fopt = flax_nnx.Optimizer(theirs, ADAM, wrt=flax_nnx.PathContains("kernel"))
    bias = ours.lin1.bias[...]
    grads, fgrads = _same_grads(ours, theirs, only="kernel")
    opt.update(ours, grads)
    fopt.update(theirs, fgrads)
    _bitwise(nnx.state(opt), flax_nnx.state(fopt))
    _bitwise(nnx.state(ours, nnx.Param), flax_nnx.state(theirs, flax_nnx.Param))
    np.testing.assert_array_equal(ours.lin1.bias[...], bias)


def test_a_gradient_with_more_variables_than_wrt_is_filtered_by_wrt():
    ours = _model(nnx)
    opt = Optimizer(ours, ADAM, wrt=nnx.PathContains("lin2"))
    kernel1 = ours.lin1.kernel[...]
    opt.update(ours, nnx.grad(_loss)(ours, X, Y))       # the gradient of every Param
    np.testing.assert_array_equal(ours.lin1.kernel[...], kernel1)
    assert sorted(opt.opt_state[0].mu) == ["lin2"]


def test_update_passes_extra_arguments_to_the_transformation():
    def scaled(scale):
        return optax.GradientTransformationExtraArgs(
            lambda params: optax.EmptyState(),
            lambda updates, state, params=None, *, factor: (
                jax.tree.map(lambda u: -scale * factor * u, updates), state))
    ours, theirs = _model(nnx), _model(flax_nnx)
    opt = Optimizer(ours, scaled(0.5), wrt=nnx.Param)
    fopt = flax_nnx.Optimizer(theirs, scaled(0.5), wrt=flax_nnx.Param)
    grads, fgrads = _same_grads(ours, theirs)
    opt.update(ours, grads, factor=jnp.float32(3.0))
    fopt.update(theirs, fgrads, factor=jnp.float32(3.0))
    _bitwise(nnx.state(ours, nnx.Param), flax_nnx.state(theirs, flax_nnx.Param))


def test_model_and_optimizer_holds_the_model_and_updates_it_from_grads_alone():
    ours, theirs = _model(nnx), _model(flax_nnx)
    opt = ModelAndOptimizer(ours, ADAM)
    fopt = flax_nnx.ModelAndOptimizer(theirs, ADAM)
    assert opt.model is ours
    grads, fgrads = _same_grads(ours, theirs)
    opt.update(grads)
    fopt.update(fgrads)
    _bitwise(nnx.state(opt), flax_nnx.state(fopt))


def test_model_and_optimizer_in_a_jitted_step():
    ours, theirs = _model(nnx), _model(flax_nnx)
    opt = ModelAndOptimizer(ours, ADAM)
    fopt = flax_nnx.ModelAndOptimizer(theirs, ADAM)

    def step(lib):
        return lambda o, x, y: o.update(lib.grad(_loss)(o.model, x, y))
    for _ in range(2):
        nnx.jit(step(nnx))(opt, X, Y)
        flax_nnx.jit(step(flax_nnx))(fopt, X, Y)
    _bitwise(nnx.state(opt), flax_nnx.state(fopt))


def test_an_optimizer_does_not_hold_the_model():
    opt = Optimizer(_model(nnx), optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(AttributeError, match="ModelAndOptimizer"):
        opt.model  # noqa: B018


def test_wrt_is_required():
    with pytest.raises(TypeError, match="wrt"):
        Optimizer(_model(nnx), optax.sgd(0.1))


def test_a_gradient_missing_a_variable_is_an_error_naming_it():
    ours = _model(nnx)
    opt = Optimizer(ours, optax.sgd(0.1), wrt=nnx.Param)
    grads = nnx.grad(_loss)(ours, X, Y)
    del grads["lin2"]["bias"]
    with pytest.raises(errors.InvalidVariablesError, match="lin2/bias is missing") as e:
        opt.update(ours, grads)
    assert e.value.path == ("lin2", "bias") and "test_nnx_training.py" in e.value.source


def test_a_gradient_of_a_variable_the_model_lacks_is_an_error_naming_it():
    ours = _model(nnx)
    opt = Optimizer(ours, optax.sgd(0.1), wrt=nnx.Param)
    grads = nnx.grad(_loss)(ours, X, Y)
    grads["extra"] = nnx.Param(jnp.zeros(()))
    with pytest.raises(errors.InvalidVariablesError, match="extra is for no variable"):
        opt.update(ours, grads)


def test_a_variables_metadata_goes_to_its_optimizer_state():
    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2), tag="w", optimizer_sharding=("a",))
    opt = Optimizer(Model(), ADAM, wrt=nnx.Param)
    mu = opt.opt_state[0].mu["w"]
    assert mu.get_metadata() == {"tag": "w", "out_sharding": ("a",)}


# --- metrics --------------------------------------------------------------------------------


def _both(name, *args, **kwargs):
    return getattr(metrics, name)(*args, **kwargs), getattr(flax_nnx.metrics, name)(*args, **kwargs)


def _same_metric(ours, theirs):
    _bitwise(nnx.state(ours), flax_nnx.state(theirs))
    _same_arrays(ours.compute(), theirs.compute())


AVERAGE_UPDATES = [dict(values=jnp.array([1, 2, 3, 4])), dict(values=2.5), dict(values=7),
                   dict(values=jnp.array([[1.5, 2.0], [0.25, 3.0]]),
                        mask=jnp.array([True, False])),
                   dict(values=jnp.arange(3.0, dtype=jnp.bfloat16))]


def test_average_accumulates_as_flax_nnx_bitwise():
    ours, theirs = _both("Average")
    _same_arrays(ours.compute(), _standard(theirs.compute))     # nan before any update
    for kwargs in AVERAGE_UPDATES:
        ours.update(**kwargs)
        _standard(theirs.update, **kwargs)
        _bitwise(nnx.state(ours), flax_nnx.state(theirs))
        _same_arrays(ours.compute(), _standard(theirs.compute))
    ours.reset()
    theirs.reset()
    _bitwise(nnx.state(ours), flax_nnx.state(theirs))


def test_average_reads_the_keyword_its_constructor_names():
    avg = metrics.Average("loss")
    avg.update(loss=jnp.array([1.0, 3.0]))
    assert float(avg.compute()) == 2.0
    with pytest.raises(TypeError, match="'loss'"):
        avg.update(values=jnp.array([1.0]))


def test_average_refuses_a_mask_with_a_python_number():
    with pytest.raises(errors.ConfigError, match="must be an array") as e:
        metrics.Average().update(values=1.0, mask=jnp.array(True))
    assert isinstance(e.value, ValueError) and "test_nnx_training.py" in e.value.source


@pytest.mark.parametrize("threshold,logits,labels,mask", [
    (None, jax.random.normal(jax.random.key(0), (5, 3)), jnp.array([0, 1, 2, 1, 0]), None),
    (None, jax.random.normal(jax.random.key(1), (5, 3)), np.array([0, 2, 2, 1, 1], np.int64),
     jnp.array([1, 1, 0, 1, 0])),
    (0.5, jax.random.normal(jax.random.key(2), (5,)), jnp.array([0, 1, 0, 1, 1]), None),
], ids=["multiclass", "int64_labels_masked", "binary"])
def test_accuracy_counts_correct_predictions_as_flax_nnx(threshold, logits, labels, mask):
    ours, theirs = _both("Accuracy", threshold)
    for _ in range(2):
        ours.update(logits=logits, labels=labels, mask=mask)
        _standard(theirs.update, logits=logits, labels=labels, mask=mask)
    _bitwise(nnx.state(ours), flax_nnx.state(theirs))
    _same_arrays(ours.compute(), _standard(theirs.compute))


@pytest.mark.parametrize("threshold,logits,labels,match", [
    (None, jnp.zeros((5,)), jnp.zeros((5,), jnp.int32), "multi-class"),
    (0.5, jnp.zeros((5, 2)), jnp.zeros((5,), jnp.int32), "binary"),
    (None, jnp.zeros((5, 2)), jnp.zeros((5,)), "labels must be int32"),
], ids=["multiclass_rank", "binary_rank", "float_labels"])
def test_accuracy_refuses_logits_and_labels_that_do_not_fit(threshold, logits, labels, match):
    with pytest.raises(errors.ConfigError, match=match):
        metrics.Accuracy(threshold).update(logits=logits, labels=labels)
    with pytest.raises(ValueError):
        flax_nnx.metrics.Accuracy(threshold).update(logits=logits, labels=labels)


def test_accuracy_threshold_must_be_a_float():
    with pytest.raises(TypeError, match="float"):
        metrics.Accuracy(1)


def test_welford_statistics_are_flax_nnx_bitwise_across_resets():
    ours, theirs = _both("Welford")
    _same_arrays(ours.compute(), _standard(theirs.compute))
    for step in range(2):
        for values in (jnp.array([1.0, 2.0, 3.0, 4.0]), 2, 0.5, jnp.array([[3, 2], [1, 0]])):
            ours.update(values=values)
            _standard(theirs.update, values=values)
            _bitwise(nnx.state(ours), flax_nnx.state(theirs))
            _same_arrays(ours.compute(), _standard(theirs.compute))
        ours.reset()
        _standard(theirs.reset)     # flax.nnx casts the uint32 it writes to the int32 count
        _bitwise(nnx.state(ours), flax_nnx.state(theirs))


LOGITS = jax.random.normal(jax.random.key(0), (5, 2))
LABELS = jnp.array([0, 1, 1, 1, 0])


@pytest.mark.parametrize("mask", [None, jnp.array([1, 0, 1, 1, 1]),
                                  {"accuracy": jnp.array([1, 1, 0, 0, 1])}],
                         ids=["no_mask", "one_mask", "mask_by_metric"])
def test_multi_metric_updates_each_metric_as_flax_nnx(mask):
    ours = MultiMetric(accuracy=metrics.Accuracy(), loss=metrics.Average())
    theirs = flax_nnx.MultiMetric(accuracy=flax_nnx.metrics.Accuracy(),
                                  loss=flax_nnx.metrics.Average())
    for k in range(2):
        kwargs = dict(logits=LOGITS + k, labels=LABELS, values=jnp.arange(5.0) * k, mask=mask)
        ours.update(**kwargs)
        _standard(theirs.update, **kwargs)
    _bitwise(nnx.state(ours), flax_nnx.state(theirs))
    computed, fcomputed = ours.compute(), _standard(theirs.compute)
    assert list(computed) == list(fcomputed) == ["accuracy", "loss"]
    _same_arrays(computed, fcomputed)
    ours.reset()
    theirs.reset()
    _bitwise(nnx.state(ours), flax_nnx.state(theirs))


def test_multi_metric_refuses_a_metric_named_like_its_methods():
    with pytest.raises(errors.ConfigError, match="'update'"):
        MultiMetric(update=metrics.Average())


def test_metrics_updated_in_a_jitted_step_keep_their_totals_as_under_flax_nnx_jit():
    ours = MultiMetric(accuracy=metrics.Accuracy(), loss=metrics.Average(),
                       spread=metrics.Welford())
    theirs = flax_nnx.MultiMetric(accuracy=flax_nnx.metrics.Accuracy(),
                                  loss=flax_nnx.metrics.Average(),
                                  spread=flax_nnx.metrics.Welford())

    def step(m, logits, labels):
        m.update(logits=logits, labels=labels, values=jnp.sum(logits, axis=-1))
    for k in range(3):
        nnx.jit(step)(ours, LOGITS * k, LABELS)
        _standard(flax_nnx.jit(step), theirs, LOGITS * k, LABELS)
    _bitwise(nnx.state(ours), flax_nnx.state(theirs))
    _same_arrays(ours.compute(), _standard(theirs.compute))


def test_metric_is_a_base_class_with_split():
    with pytest.raises(NotImplementedError):
        Metric()
    avg = metrics.Average()
    g, s = avg.split(metrics.MetricState)
    assert sorted(s) == ["count", "total"] and nnx.merge(g, s).total is avg.total


def test_the_training_modules_do_not_import_optax():
    """optax is the user's (an extra of the tests and examples), never varjax's dependency."""
    code = ("import sys, varjax.nnx.optimizer, varjax.nnx.metrics; "
            "assert 'optax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
