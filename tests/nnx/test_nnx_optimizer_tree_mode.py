"""``nnx.Optimizer`` in tree mode (``graph=False``, or ``graph=None`` under
``nnx.set_graph_mode(False)``) against flax.nnx 0.12.8: three Adam steps of a tiny MLP give
flax.nnx's parameters, optimizer state and step bit for bit, eagerly and under ``nnx.jit``,
in tree mode and in graph mode; a Variable reached at two paths is refused in tree mode, as
flax.nnx refuses it, with an error naming both paths."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.metrics import Accuracy, Average, MultiMetric
from varjax.nnx.optimizer import ModelAndOptimizer, Optimizer

X = jax.random.normal(jax.random.key(1), (4, 2))
Y = jax.random.normal(jax.random.key(2), (4, 2))


def _standard(fn, *args, **kwargs):
    """Optax mixes dtypes (Adam's ``b1 ** count``), so it runs under standard promotion;
    varjax's own code runs under the suite's strict promotion."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        return fn(*args, **kwargs)


ADAM = optax.GradientTransformationExtraArgs(
    lambda params: _standard(optax.adam(1e-2).init, params),
    lambda *args, **kwargs: _standard(optax.adam(1e-2).update, *args, **kwargs))


def _mlp(lib):
    class MLP(lib.Module):
        def __init__(self, rngs):
            self.lin1 = lib.Linear(2, 3, rngs=rngs)
            self.lin2 = lib.Linear(3, 2, rngs=rngs)

        def __call__(self, x):
            return self.lin2(jnp.tanh(self.lin1(x)))
    return MLP(lib.Rngs(0))


def _shared(lib, what):
    """A model whose Param is reached at two paths: a submodule held twice, or a Variable
    held twice."""
    class Shared(lib.Module):
        def __init__(self, rngs):
            self.a = lib.Linear(2, 2, rngs=rngs)
            self.b = self.a if what == "module" else lib.Linear(2, 2, rngs=rngs)
            if what == "variable":
                self.b.kernel = self.a.kernel

        def __call__(self, x):
            return self.b(self.a(x))
    return Shared(lib.Rngs(0))


def _loss(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


# Each mode: the ``graph`` passed to the Optimizer, nnx.grad and nnx.jit, and the context it
# runs in; "set_graph_mode_false" passes nothing and lets the setting decide, as flax.nnx's
# graph=None does.
MODES = {"graph_false": (False, False), "graph_true": (True, False),
         "set_graph_mode_false": (None, True)}


def _in_mode(lib, mode):
    return lib.set_graph_mode(False) if MODES[mode][1] else contextlib.nullcontext()


def _bitwise(ours, theirs):
    """Two states (ours varjax's, theirs flax.nnx's): the same paths, dtypes and bits."""
    a, b = nnx.to_pure_dict(ours), flax_nnx.to_pure_dict(theirs)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def _same_state(ours, opt, theirs, fopt, graph):
    _bitwise(nnx.state(ours, graph=graph), flax_nnx.state(theirs, graph=graph))
    _bitwise(nnx.state(opt, graph=graph), flax_nnx.state(fopt, graph=graph))


@pytest.mark.parametrize("mode", list(MODES))
def test_eager_adam_steps_match_flax_nnx_bitwise_in_each_mode(mode):
    graph = MODES[mode][0]
    ours, theirs = _mlp(nnx), _mlp(flax_nnx)
    with _in_mode(nnx, mode), _in_mode(flax_nnx, mode):
        opt = Optimizer(ours, ADAM, wrt=nnx.Param, graph=graph)
        fopt = flax_nnx.Optimizer(theirs, ADAM, wrt=flax_nnx.Param, graph=graph)
        for _ in range(3):
            grads = nnx.grad(_loss, graph=graph)(ours, X, Y)
            fgrads = flax_nnx.grad(_loss, graph=graph)(theirs, X, Y)
            # Tree mode's gradient is a model, graph mode's a State; either way ours gets
            # flax.nnx's values, so both optimizers step on the same gradient.
            nnx.state(grads, graph=graph).replace_by_pure_dict(
                flax_nnx.to_pure_dict(flax_nnx.state(fgrads, graph=graph)))
            updates = opt.update(ours, grads)
            fupdates = fopt.update(theirs, fgrads)
            for u, f in zip(jax.tree.leaves(updates), jax.tree.leaves(fupdates), strict=True):
                np.testing.assert_array_equal(u, f)
        _same_state(ours, opt, theirs, fopt, graph)
    assert opt.graph is graph and int(opt.step[...]) == 3


def _train_step(lib, graph):
    @lib.jit(graph=graph)
    def step(model, opt, x, y):
        loss, grads = lib.value_and_grad(_loss, graph=graph)(model, x, y)
        opt.update(model, grads)
        return loss
    return step


@pytest.mark.parametrize("mode", list(MODES))
def test_jitted_adam_steps_match_flax_nnx_jit_bitwise_in_each_mode(mode):
    graph = MODES[mode][0]
    ours, theirs = _mlp(nnx), _mlp(flax_nnx)
    with _in_mode(nnx, mode), _in_mode(flax_nnx, mode):
        opt = Optimizer(ours, ADAM, wrt=nnx.Param, graph=graph)
        fopt = flax_nnx.Optimizer(theirs, ADAM, wrt=flax_nnx.Param, graph=graph)
        step, fstep = _train_step(nnx, graph), _train_step(flax_nnx, graph)
        losses = [(step(ours, opt, X, Y), fstep(theirs, fopt, X, Y)) for _ in range(3)]
        _same_state(ours, opt, theirs, fopt, graph)
    np.testing.assert_array_equal(*zip(*losses))
    assert int(opt.step[...]) == 3 and losses[2][0] < losses[0][0]


def test_model_and_optimizer_under_set_graph_mode_false_matches_flax_nnx_jit():
    ours, theirs = _mlp(nnx), _mlp(flax_nnx)

    def step(lib):
        return lambda o, x, y: o.update(lib.grad(_loss)(o.model, x, y))
    with nnx.set_graph_mode(False), flax_nnx.set_graph_mode(False):
        opt, fopt = ModelAndOptimizer(ours, ADAM), flax_nnx.ModelAndOptimizer(theirs, ADAM)
        for _ in range(2):
            nnx.jit(step(nnx))(opt, X, Y)
            flax_nnx.jit(step(flax_nnx))(fopt, X, Y)
        _bitwise(nnx.state(opt), flax_nnx.state(fopt))
    assert opt.model is ours and opt.graph is None


def test_a_tree_mode_optimizer_takes_a_graph_mode_gradient_state_as_flax_nnx():
    ours, theirs = _mlp(nnx), _mlp(flax_nnx)
    opt = Optimizer(ours, ADAM, wrt=nnx.Param, graph=False)
    fopt = flax_nnx.Optimizer(theirs, ADAM, wrt=flax_nnx.Param, graph=False)
    grads = nnx.grad(_loss)(ours, X, Y)
    fgrads = flax_nnx.grad(_loss)(theirs, X, Y)
    assert isinstance(grads, nnx.State)
    nnx.replace_by_pure_dict(grads, flax_nnx.to_pure_dict(fgrads))
    opt.update(ours, grads)
    fopt.update(theirs, fgrads)
    _same_state(ours, opt, theirs, fopt, None)


@pytest.mark.parametrize("what,leaf", [("module", "bias"), ("variable", "kernel")])
def test_tree_mode_refuses_a_shared_variable_naming_both_paths_as_flax_nnx(what, leaf):
    with pytest.raises(ValueError, match="Tree mode"):
        flax_nnx.Optimizer(_shared(flax_nnx, what), ADAM, wrt=flax_nnx.Param, graph=False)
    with pytest.raises(errors.InconsistentAliasError, match=f"two paths, a/{leaf} and b/{leaf}"
                       ) as e:
        Optimizer(_shared(nnx, what), ADAM, wrt=nnx.Param, graph=False)
    assert isinstance(e.value, ValueError) and "test_nnx_optimizer_tree_mode.py" in e.value.source


def test_graph_none_follows_set_graph_mode_at_each_call_as_flax_nnx():
    """An optimizer made in graph mode takes a shared model there; its update in tree mode
    refuses it, as flax.nnx's, whose ``graph=None`` is read at each call."""
    for lib, error in ((flax_nnx, ValueError), (nnx, errors.InconsistentAliasError)):
        model = _shared(lib, "module")
        opt = lib.Optimizer(model, ADAM, wrt=lib.Param)
        grads = lib.grad(_loss)(model, X, Y)
        with lib.set_graph_mode(False), pytest.raises(error):
            opt.update(model, grads)
        with lib.set_graph_mode(False), pytest.raises(error):
            lib.Optimizer(model, ADAM, wrt=lib.Param)
        opt.update(model, grads)
        assert int(opt.step[...]) == 1


def test_graph_mode_optimizer_over_a_shared_module_matches_flax_nnx_bitwise():
    ours, theirs = _shared(nnx, "module"), _shared(flax_nnx, "module")
    opt = Optimizer(ours, ADAM, wrt=nnx.Param, graph=True)
    fopt = flax_nnx.Optimizer(theirs, ADAM, wrt=flax_nnx.Param, graph=True)
    grads, fgrads = nnx.grad(_loss)(ours, X, Y), flax_nnx.grad(_loss)(theirs, X, Y)
    nnx.replace_by_pure_dict(grads, flax_nnx.to_pure_dict(fgrads))
    opt.update(ours, grads)
    fopt.update(theirs, fgrads)
    _same_state(ours, opt, theirs, fopt, True)
    assert sorted(opt.opt_state[0].mu) == ["a"]


def test_tree_mode_jit_refuses_a_model_and_the_optimizer_holding_it_as_flax_nnx():
    def step(model, opt, x, y):
        opt.update(nnx.grad(_loss, graph=False)(model, x, y))
    with pytest.raises(ValueError, match="aliasing"):
        fopt = flax_nnx.ModelAndOptimizer(_mlp(flax_nnx), ADAM)
        flax_nnx.jit(step, graph=False)(fopt.model, fopt, X, Y)
    opt = ModelAndOptimizer(_mlp(nnx), ADAM)
    with pytest.raises(errors.InconsistentAliasError, match="args/0/lin1/bias and at "
                       "args/1/model/lin1/bias") as e:
        nnx.jit(step, graph=False)(opt.model, opt, X, Y)
    assert "test_nnx_optimizer_tree_mode.py" in e.value.source


def test_metrics_updated_in_a_tree_mode_jitted_step_match_flax_nnx():
    """``Metric.split`` and a metric's Variables follow the mode as flax.nnx's do."""
    logits = jax.random.normal(jax.random.key(0), (5, 2))
    labels = jnp.array([0, 1, 1, 1, 0])
    ours = MultiMetric(accuracy=Accuracy(), loss=Average())
    theirs = flax_nnx.MultiMetric(accuracy=flax_nnx.metrics.Accuracy(),
                                  loss=flax_nnx.metrics.Average())

    def step(m, logits, labels):
        m.update(logits=logits, labels=labels, values=jnp.sum(logits, axis=-1))
    with nnx.set_graph_mode(False), flax_nnx.set_graph_mode(False):
        for k in range(2):
            nnx.jit(step)(ours, logits * k, labels)
            _standard(flax_nnx.jit(step), theirs, logits * k, labels)
        _bitwise(nnx.state(ours), flax_nnx.state(theirs))
        g, s = ours.loss.split()
        fg, fs = theirs.loss.split()
        _bitwise(s, fs)
        assert nnx.merge(g, s).total is ours.loss.total


def test_update_without_grads_is_a_type_error_naming_model_and_optimizer_as_flax_nnx():
    """flax.nnx's pre-0.11 call ``update(grads)`` is refused by both, pointing at
    ``ModelAndOptimizer``."""
    fopt = flax_nnx.Optimizer(_mlp(flax_nnx), ADAM, wrt=flax_nnx.Param)
    with pytest.raises(TypeError, match="ModelAndOptimizer"):
        fopt.update(flax_nnx.State({}))
    opt = Optimizer(_mlp(nnx), ADAM, wrt=nnx.Param)
    with pytest.raises(errors.InvalidVariablesError, match="takes \\(model, grads\\)") as e:
        opt.update(nnx.State({}))
    assert isinstance(e.value, TypeError) and "ModelAndOptimizer" in e.value.fix
    assert "test_nnx_optimizer_tree_mode.py" in e.value.source and int(opt.step[...]) == 0


def test_train_state_of_a_tree_mode_split_steps_and_applies_as_flax_nnx_bitwise():
    """``TrainState`` keeps the GraphDef of a tree-mode ``split`` and ``apply`` merges by
    it; three jitted Adam steps give flax.nnx's params, optimizer state and output."""
    def run(lib):
        with lib.set_graph_mode(False):
            graphdef, params, rest = lib.split(_mlp(lib), lib.Param, ...)
            state = lib.TrainState.create(graphdef, params=params, tx=ADAM)

            @jax.jit
            def step(state):
                grads = jax.grad(lambda p: _loss(lambda x: state.apply(p, rest)(x)[0], X, Y))(
                    state.params)
                return state.apply_gradients(grads)
            for _ in range(3):
                state = step(state)
            return state, state.apply("params", rest)(X)[0]
    (ours, out), (theirs, fout) = run(nnx), run(flax_nnx)
    _bitwise(ours.params, theirs.params)
    for a, b in zip(jax.tree.leaves((ours.opt_state, ours.step, out)),
                    jax.tree.leaves((theirs.opt_state, theirs.step, fout)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(ours.step) == 3
