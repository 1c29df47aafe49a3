"""Lifted ``cond`` and ``switch``: Linen's docstring examples, branches that mutate
different variables (beyond Linen), and the error for a variable created in some branches."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transform_checks import close as _close
from transform_checks import shape_layout as _layout

import varjax as vj
import varjax.nn as nn
from varjax.errors import VariableCreationError

F = 3


def _x(shape=(2, F), seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _dense(p, x):
    return x @ p["kernel"] + p["bias"][None]


def _cond_example(lib):
    """Linen's ``cond`` docstring example, verbatim but for ``nn`` -> ``lib``."""
    class CondExample(lib.Module):
        @lib.compact
        def __call__(self, x, pred):
            self.variable('state', 'true_count', lambda: 0)
            self.variable('state', 'false_count', lambda: 0)

            def true_fn(mdl, x):
                mdl.variable('state', 'true_count').value += 1
                return lib.Dense(2, name='dense')(x)

            def false_fn(mdl, x):
                mdl.variable('state', 'false_count').value += 1
                return -lib.Dense(2, name='dense')(x)
            return lib.cond(pred, true_fn, false_fn, self, x)
    return CondExample()


def test_cond_docstring_example_matches_linen():
    _check_cond_parity(_cond_example)


def _cond_setup_example(lib):
    """The same model with the counters and the Dense made in ``setup``."""
    class CondSetupExample(lib.Module):
        def setup(self):
            self.true_count = self.variable('state', 'true_count', lambda: 0)
            self.false_count = self.variable('state', 'false_count', lambda: 0)
            self.dense = lib.Dense(2)

        def __call__(self, x, pred):
            def true_fn(mdl, x):
                mdl.true_count.value += 1
                return mdl.dense(x)

            def false_fn(mdl, x):
                mdl.false_count.value += 1
                return -mdl.dense(x)
            return lib.cond(pred, true_fn, false_fn, self, x)
    return CondSetupExample()


def test_cond_with_a_setup_submodule_matches_linen():
    _check_cond_parity(_cond_setup_example)


def _check_cond_parity(example):
    x = _x()
    flax_vars = example(flax_nn).init(jax.random.key(0), x, True)
    vj_vars = example(nn).init(jax.random.key(0), x, True)
    assert _layout(vj_vars) == _layout(flax_vars)
    assert list(vj_vars["params"]) == ["dense"]
    assert {k: int(v) for k, v in vj_vars["state"].items()} == {"true_count": 1, "false_count": 0}
    # one traced pred, both values: the same compiled apply
    apply = jax.jit(lambda v, pred: example(nn).apply(v, x, pred, mutable=["state"]))
    p = flax_vars["params"]["dense"]
    state = flax_vars
    for pred in (True, False, True):
        expected = example(flax_nn).apply(state, x, pred, mutable=["state"])
        out, updated = apply(state, jnp.asarray(pred))
        _close(out, expected[0])
        _close(out, _dense(p, x) if pred else -_dense(p, x))
        assert {k: int(v) for k, v in updated["state"].items()} == \
            {k: int(v) for k, v in expected[1]["state"].items()}
        state = {**state, **updated}
    # init ran the true branch once
    assert {k: int(v) for k, v in state["state"].items()} == {"true_count": 3, "false_count": 1}


def _switch_example(lib):
    """Linen's ``switch`` docstring example, verbatim but for ``nn`` -> ``lib``."""
    class SwitchExample(lib.Module):
        @lib.compact
        def __call__(self, x, index):
            self.variable('state', 'a_count', lambda: 0)
            self.variable('state', 'b_count', lambda: 0)
            self.variable('state', 'c_count', lambda: 0)

            def a_fn(mdl, x):
                mdl.variable('state', 'a_count').value += 1
                return lib.Dense(2, name='dense')(x)

            def b_fn(mdl, x):
                mdl.variable('state', 'b_count').value += 1
                return -lib.Dense(2, name='dense')(x)

            def c_fn(mdl, x):
                mdl.variable('state', 'c_count').value += 1
                return lib.Dense(2, name='dense')(x)
            return lib.switch(index, [a_fn, b_fn, c_fn], self, x)
    return SwitchExample()


def test_switch_docstring_example_matches_linen_with_a_traced_index():
    x = _x()
    flax_vars = _switch_example(flax_nn).init(jax.random.key(0), x, 0)
    vj_vars = _switch_example(nn).init(jax.random.key(0), x, 0)
    assert _layout(vj_vars) == _layout(flax_vars)
    p, state = flax_vars["params"]["dense"], flax_vars
    apply = jax.jit(lambda v, i: _switch_example(nn).apply(v, x, i, mutable=["state"]))
    for index in (2, 1, 1, 0):
        expected = _switch_example(flax_nn).apply(state, x, index, mutable=["state"])
        out, updated = apply(state, jnp.int32(index))
        _close(out, expected[0])
        _close(out, -_dense(p, x) if index == 1 else _dense(p, x))
        assert {k: int(v) for k, v in updated["state"].items()} == \
            {k: int(v) for k, v in expected[1]["state"].items()}
        state = {**state, **updated}
    # init ran branch 0 once
    assert {k: int(v) for k, v in state["state"].items()} == {"a_count": 2, "b_count": 2,
                                                              "c_count": 1}


# -- beyond Linen ---------------------------------------------------------------------------

class _Different(nn.Module):
    """The true branch writes state/a, the false one state/b."""

    @nn.compact
    def __call__(self, x, pred):
        self.variable("state", "a", lambda: jnp.zeros((), jnp.float32))
        self.variable("state", "b", lambda: jnp.zeros((), jnp.float32))

        def true_fn(mdl, x):
            a = mdl.variable("state", "a")
            a.value = a.value + x.sum()
            return x * 2.0

        def false_fn(mdl, x):
            b = mdl.variable("state", "b")
            b.value = b.value - 1.0
            return x
        return nn.cond(pred, true_fn, false_fn, self, x)


def test_cond_branches_may_mutate_different_variables():
    x = _x((F,))
    variables = {"state": {"a": jnp.float32(10.0), "b": jnp.float32(20.0)}}
    apply = jax.jit(lambda v, pred: _Different().apply(v, x, pred, mutable=["state"]))
    out, updated = apply(variables, jnp.asarray(True))
    _close(out, x * 2.0)
    _close(updated["state"], {"a": 10.0 + x.sum(), "b": jnp.float32(20.0)})
    out, updated = apply(variables, jnp.asarray(False))
    _close(out, x)
    _close(updated["state"], {"a": jnp.float32(10.0), "b": jnp.float32(19.0)})


class _CreatesIn(nn.Module):
    """``switch`` (or ``cond`` for two branches) whose branches in ``creators`` create
    ``state/made``."""
    creators: tuple = (1,)
    n: int = 2

    @nn.compact
    def __call__(self, x, index):
        def branch(i):
            def fn(mdl, x):
                if i in self.creators:
                    mdl.variable("state", "made", lambda: jnp.ones((), jnp.float32))
                return x + float(i)
            return fn
        if self.n == 2:
            return nn.cond(index, branch(1), branch(0), self, x)
        return nn.switch(index, [branch(i) for i in range(self.n)], self, x)


def test_variable_created_in_only_the_true_branch_raises_naming_it_and_the_branch():
    with pytest.raises(VariableCreationError) as info:
        _CreatesIn().init(jax.random.key(0), _x((F,)), True)
    message = str(info.value)
    assert "variable made is created in true_fun of vj.cond but not in false_fun" in message
    assert "collection: state" in message
    assert "create it in every branch, or before the cond" in message


def test_variable_created_in_only_one_switch_branch_raises_naming_it_and_the_branch():
    with pytest.raises(VariableCreationError,
                       match="variable made is created in branch 1 of vj.switch but not in "
                             "branch 0, branch 2"):
        _CreatesIn(creators=(1,), n=3).init(jax.random.key(0), _x((F,)), 0)


def test_variable_created_in_every_branch_works_at_init():
    x = _x((F,))
    out, variables = _CreatesIn(creators=(0, 1, 2), n=3).init_with_output(
        jax.random.key(0), x, jnp.int32(2))
    assert float(variables["state"]["made"]) == 1.0
    _close(out, x + 2.0)
    out, variables = _CreatesIn(creators=(0, 1)).init_with_output(jax.random.key(0), x, False)
    assert float(variables["state"]["made"]) == 1.0
    _close(out, x)


def test_switch_with_three_branches_and_a_traced_index():
    class Three(nn.Module):
        def setup(self):
            self.hits = self.variable("state", "hits", lambda: jnp.zeros((3,), jnp.int32))
            self.shared = nn.Dense(F)

        def __call__(self, x, index):
            def branch(i, scale):
                def fn(mdl, x):
                    mdl.hits.value = mdl.hits.value.at[i].add(1)
                    return mdl.shared(x) * scale
                return fn
            return nn.switch(index, [branch(0, 1.0), branch(1, -1.0), branch(2, 3.0)], self, x)

    x = _x()
    variables = Three().init(jax.random.key(0), x, jnp.int32(0))
    assert _layout(variables)["['params']['shared']['kernel']"] == (F, F)
    apply = jax.jit(lambda v, i: Three().apply(v, x, i, mutable=["state"]))
    base = _dense(variables["params"]["shared"], x)
    state = variables
    for index, scale in ((2, 3.0), (0, 1.0), (1, -1.0), (2, 3.0)):
        out, updated = apply(state, jnp.int32(index))
        _close(out, base * scale)
        state = {**state, **updated}
    np.testing.assert_array_equal(state["state"]["hits"], [1 + 1, 1, 2])   # init ran branch 0


def test_cond_over_plain_functions_with_vj_param():
    def true_fn(x):
        return x * vj.param("w", lambda k: jax.random.normal(k, (F,)))

    def false_fn(x):
        return x + vj.param("w", lambda k: jax.random.normal(k, (F,)))

    @vj.functionalize
    def run(x, pred):
        return vj.cond(pred, true_fn, false_fn, None, x)

    x = _x((F,))
    variables = run.init(jax.random.key(0), x, True)
    w = variables["params"]["w"]
    assert w.shape == (F,)
    apply = jax.jit(run.apply)
    _close(apply(variables, x, jnp.asarray(True)), x * w)
    _close(apply(variables, x, jnp.asarray(False)), x + w)


def test_cond_branch_may_close_over_an_outer_array():
    @vj.functionalize
    def run(x, pred):
        y = x * 2.0
        return vj.cond(pred, lambda: y + 1.0, lambda: y - 1.0, None)

    x = _x((F,))
    _close(run.apply({}, x, jnp.asarray(True)), x * 2.0 + 1.0)
