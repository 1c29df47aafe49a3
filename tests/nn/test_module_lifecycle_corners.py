"""Module lifecycle corners of Linen, checked against flax.linen (issue 18, item 3).

Each model is written once as a function of the library (``nn``), so the same source runs
under ``flax.linen`` and ``varjax.nn``; varjax must give Linen's variable layout, and the same
outputs on Linen's variables.
"""
import dataclasses
import functools

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax.nn as vnn
from tests.nn.parity import assert_close, layout, perturb
from varjax import errors

X = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)
KEY = jax.random.key(0)


def same_as_linen(build, run):
    """``run(model, nn, variables)`` under both libraries, on Linen's (perturbed) variables
    from ``build(nn).init``; asserts the layouts and the results agree."""
    flax_model, vj_model = build(fnn), build(vnn)
    flax_vars = flax_model.init(KEY, X)
    assert layout(vj_model.init(KEY, X)) == layout(flax_vars)
    variables = perturb(jax.tree.map(jnp.asarray, dict(flax_vars)))
    expected = run(flax_model, fnn, variables)
    got = run(vj_model, vnn, variables)
    assert_close(got, expected, 1e-5)
    return got


def two_compact(nn):
    class TwoCompact(nn.Module):
        @nn.compact
        def __call__(self, x):
            return self.head(nn.Dense(3)(x))

        @nn.compact
        def head(self, x):
            return nn.Dense(2)(x) * self.param("scale", nn.initializers.ones, (1, 2))

        @nn.compact
        def tail(self, x):
            return nn.Dense(4, name="tail_dense")(x)
    return TwoCompact()


def test_several_compact_methods_share_the_call_names_when_nested():
    # Linen allows any number of @compact methods; nested calls count names together.
    same_as_linen(two_compact, lambda m, nn, v: m.apply(v, X))


def test_a_second_compact_method_initializes_its_own_variables():
    flax_vars = two_compact(fnn).init(KEY, X, method="tail")
    vj_vars = two_compact(vnn).init(KEY, X, method="tail")
    assert layout(vj_vars) == layout(flax_vars)
    assert list(vj_vars["params"]) == ["tail_dense"]


def test_compact_methods_called_one_after_the_other_restart_auto_names():
    # Both calls build Dense_0, so the second finds the first one's kernel: Linen's shape error.
    def both(m, x):
        return m.head(m(x))
    with pytest.raises(Exception, match="kernel"):
        fnn.init(both, two_compact(fnn))(KEY, X)
    with pytest.raises(errors.VariableShapeError, match="Dense_0/kernel"):
        vnn.init(both, two_compact(vnn))(KEY, X)


def counting(nn, log):
    class Leaf(nn.Module):
        def setup(self):
            log.append("Leaf")
            self.w = self.param("w", nn.initializers.ones, (3,))

        def __call__(self, x):
            return x * self.w[None]

    class Root(nn.Module):
        def setup(self):
            log.append("Root")
            self.leaf = Leaf()
            self.dense = nn.Dense(2)

        def __call__(self, x):
            return self.dense(self.leaf(x))

        def other(self, x):
            return self.leaf(x) * 2.0
    return Root()


def test_setup_runs_once_per_bound_instance():
    for nn in (fnn, vnn):
        log = []
        model = counting(nn, log)
        bound = model.bind(model.init(KEY, X))
        log.clear()
        first = bound.leaf
        assert bound.leaf is first and bound.leaf.w is bound.leaf.w
        assert log == ["Root", "Leaf"], nn
    # varjax traces a bound call once (setup runs again under that trace only); afterwards
    # the eager attributes are the ones from before the call, and setup does not run again.
    log = []
    model = counting(vnn, log)
    bound = model.bind(model.init(KEY, X))
    leaf = bound.leaf
    log.clear()
    bound(X)
    bound(X)
    assert log == ["Root", "Leaf"]
    assert bound.leaf is leaf and isinstance(leaf.w, jax.Array)
    log.clear()
    bound.leaf.w
    assert log == []


def test_setup_submodules_of_a_bound_parent_are_used_from_another_method():
    def run(m, nn, v):
        bound = m.bind(v)
        return bound.other(X), bound.leaf(X), bound(X), bound.dense.variables
    same_as_linen(lambda nn: counting(nn, []), run)


def test_a_field_with_init_false_is_assigned_in_setup():
    def build(nn):
        class Scaled(nn.Module):
            features: int = 2
            width: int = dataclasses.field(init=False)

            def setup(self):
                self.width = 2 * self.features
                self.dense = nn.Dense(self.width)

            def __call__(self, x):
                return self.dense(x) * self.width
        return Scaled()

    same_as_linen(build, lambda m, nn, v: (m.apply(v, X), m.bind(v).dense(X)))
    for nn in (fnn, vnn):
        model = build(nn)
        # Not a field of the template: no part of equality, hashing or repr.
        assert model == type(model)() and hash(model) == hash(type(model)()), nn
        assert "width" not in repr(model)
        assert model.bind(model.init(KEY, X)).width == 4


def test_setting_a_constructor_field_in_setup_raises():
    for nn, error, text in ((fnn, Exception, "construction attributes"),
                            (vnn, errors.FrozenModuleError, "construction arguments")):
        class Resized(nn.Module):
            features: int = 2

            def setup(self):
                self.features = 3

            def __call__(self, x):
                return x
        with pytest.raises(error, match=text):
            Resized().init(KEY, X)


def sharing(nn, form):
    shared = nn.Dense(2)

    class User(nn.Module):
        sub: nn.Module

        def __call__(self, x):
            return self.sub(x)

    class InSetup(nn.Module):
        sub: nn.Module

        def setup(self):
            self.a, self.b = User(self.sub), User(self.sub)

        def __call__(self, x):
            return self.a(x) + self.b(x)

    class InFields(nn.Module):
        a: nn.Module
        b: nn.Module

        def __call__(self, x):
            return self.a(x) + 2.0 * self.b(x)

    class InCompact(nn.Module):
        @nn.compact
        def __call__(self, x):
            return User(shared)(x) - User(shared)(x) * 3.0
    return {"setup": lambda: InSetup(shared), "fields": lambda: InFields(User(shared), User(shared)),
            "compact": InCompact}[form]()


@pytest.mark.parametrize("form", ["setup", "fields", "compact"])
def test_a_top_level_submodule_shared_by_two_parents_has_one_set_of_variables(form):
    same_as_linen(lambda nn: sharing(nn, form), lambda m, nn, v: m.apply(v, X))
    n_kernels = len([p for p in layout(sharing(vnn, form).init(KEY, X)) if "kernel" in p])
    assert n_kernels == 1


def methods(nn):
    class Sub(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

        def half(self, x):
            return self(x) / 2.0

    class Model(nn.Module):
        def setup(self):
            self.sub = Sub()

        def __call__(self, x):
            return self.sub(x)

        def encode(self, x):
            return self.sub(x) + 1.0
    return Model()


def test_apply_method_forms():
    def run(m, nn, v):
        return (m.apply(v, X, method="encode"), m.apply(v, X, method=type(m).encode),
                m.apply(v, X, method=m.encode),          # bound to the template: unbound first
                m.apply(v, X, method=lambda mdl, x: mdl.sub(x) * 3.0),
                m.apply(v, X, method=lambda mdl, x: mdl.sub.half(x)),
                nn.apply(lambda mdl, x: mdl.sub.half(x), m)(v, X))
    same_as_linen(methods, run)


def test_apply_method_that_cannot_take_the_module_raises():
    model = methods(vnn)
    variables = model.init(KEY, X)
    with pytest.raises(errors.ModuleError, match="taking the module first"):
        model.apply(variables, method=lambda: 0)
    with pytest.raises(errors.ModuleError, match="no method or submodule field 'decode'"):
        model.apply(variables, X, method="decode")


def test_getattr_runs_setup_under_the_functional_api():
    def run(m, nn, v):
        out = nn.apply(lambda mdl, x: mdl.sub(x), m)(v, X)
        init = nn.init(lambda mdl, x: mdl.sub.half(x), m)(KEY, X)
        return out, jax.tree.map(jnp.shape, init)
    same_as_linen(methods, run)


def test_getattr_reaches_setup_values_of_submodules_under_the_functional_api():
    def run(m, nn, v):
        return nn.apply(lambda mdl: mdl.leaf.w, m)(v), nn.apply(lambda mdl, x: mdl.other(x), m)(v, X)
    same_as_linen(lambda nn: counting(nn, []), run)


def test_a_transform_of_a_partial_module_constructor():
    def build(nn):
        class Model(nn.Module):
            @nn.compact
            def __call__(self, x):
                dense = functools.partial(nn.Dense, features=2)
                mapped = nn.vmap(dense, variable_axes={"params": 0}, split_rngs={"params": True})
                return mapped()(x)
        return Model()
    same_as_linen(build, lambda m, nn, v: m.apply(v, X))


def test_apply_returns_non_array_leaves_as_linen_does():
    def build(nn):
        class Described(nn.Module):
            @nn.compact
            def __call__(self, x):
                dense = nn.Dense(2)
                y = dense(x)
                return {"y": y, "name": "described", "path": dense.path, "me": self.path,
                        "n": x.shape[0], "none": None}
        return Described()
    for nn in (fnn, vnn):
        model = build(nn)
        variables = model.init(KEY, X)
        out = model.apply(variables, X)
        assert {k: v for k, v in out.items() if k != "y"} == {
            "name": "described", "path": ("Dense_0",), "me": (), "n": 2, "none": None}, nn
        assert type(out["n"]) is int
        assert model.init_with_output(KEY, X)[0]["path"] == ("Dense_0",)
    bound = build(vnn).bind(variables)
    assert bound(X)["path"] == ("Dense_0",) and bound(X)["name"] == "described"
    np.testing.assert_allclose(bound(X)["y"], model.apply(variables, X)["y"])


def test_variable_whose_init_args_only_work_when_creating_it_as_linen_allows():
    """Linen never calls ``init_fn`` for an existing variable, so ``make_rng(...) if not
    exists else None`` is a common idiom: varjax's shape check of a given variable skips an
    ``init_fn`` that cannot run on such arguments."""
    def make(lib):
        class Noise(lib.Module):
            @lib.compact
            def __call__(self, x):
                key = None if self.has_variable("stats", "u") else self.make_rng("params")
                return x * self.variable("stats", "u", jax.random.normal, key, (3,)).value
        return Noise()
    x = jnp.ones(3)
    variables = make(vnn).init(jax.random.key(0), x)
    np.testing.assert_array_equal(variables["stats"]["u"],
                                  make(fnn).init(jax.random.key(0), x)["stats"]["u"])
    np.testing.assert_array_equal(make(vnn).apply(variables, x), variables["stats"]["u"])
