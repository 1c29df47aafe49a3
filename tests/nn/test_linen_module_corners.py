"""Module lifecycle corners of Linen (issue 37), each against flax.linen from one source:
``apply(method=...)`` in every form Linen takes, and the errors it raises."""
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax.nn as vnn
from varjax import errors

X = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32).reshape(1, 4)


def _autoencoder(nn):
    class AE(nn.Module):
        def setup(self):
            self.enc = nn.Dense(2)
            self.dec = nn.Dense(4)

        def encode(self, x):
            return self.enc(x)

        def decode(self, z):
            return self.dec(z)

        def __call__(self, x):
            return self.decode(self.encode(x))
    return AE


@pytest.fixture(scope="module")
def autoencoders():
    ref, ours = _autoencoder(fnn)(), _autoencoder(vnn)()
    return ref, ours, ref.init(jax.random.key(0), X)


@pytest.mark.parametrize("form", ["unbound", "bound", "name", "function"])
def test_apply_method_takes_an_unbound_method_a_bound_one_a_name_and_a_function(form,
                                                                                 autoencoders):
    ref, ours, variables = autoencoders

    def method(m):
        return {"unbound": type(m).encode, "bound": m.encode, "name": "encode",
                "function": lambda mdl, x: mdl.encode(x)}[form]
    np.testing.assert_allclose(ours.apply(variables, X, method=method(ours)),
                               ref.apply(variables, X, method=method(ref)), rtol=1e-6)


def test_apply_returns_the_module_a_method_returns_bound_to_its_ended_apply(autoencoders):
    ref, ours, variables = autoencoders
    returned = ours.apply(variables, method=lambda mdl: mdl)
    assert type(returned) is type(ours) and type(ref.apply(variables, method=lambda m: m)) \
        is type(ref)
    with pytest.raises(errors.InvalidScopeError, match="after the init/apply"):
        returned(X)


def test_apply_method_names_a_submodule_field():
    def make(nn):
        class Foo(nn.Module):
            bar: nn.Module

            @nn.compact
            def __call__(self, x):
                return self.bar(x) * 2
        return Foo(nn.Dense(3))
    ref, ours = make(fnn), make(vnn)
    variables = ref.init(jax.random.key(0), X)
    np.testing.assert_allclose(ours.apply(variables, X, method="bar"),
                               ref.apply(variables, X, method="bar"), rtol=1e-6)


def test_apply_method_naming_nothing_is_an_attribute_error_and_one_taking_no_module_raises():
    class Foo(vnn.Module):
        def __call__(self):
            return 1
    with pytest.raises(errors.UnknownMethodError, match="no method or submodule field "
                       "'does_not_exist'") as info:
        Foo().apply({}, method="does_not_exist")
    assert isinstance(info.value, AttributeError) and __file__ in info.value.source
    with pytest.raises(errors.ModuleError, match="callable taking the module first"):
        Foo().apply({}, method=lambda: True)


def _variables_alike(make, run):
    """``run(module, nn)`` under both libraries gives the same tree of values."""
    expected, got = run(make(fnn), fnn), run(make(vnn), vnn)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)


def test_a_field_module_of_a_setup_submodule_is_bound_before_its_parent_runs_setup():
    """``self.bar.baz(x)`` with ``bar = Bar(baz=Baz(a=1))`` made in setup: fields are bound
    as soon as their holder is, as in Linen."""
    def make(nn):
        class Baz(nn.Module):
            a: int

            def setup(self):
                self.b = self.param("b", lambda k: jnp.full((), 2.0))

            def __call__(self, x):
                return x + self.a * self.b

        class Bar(nn.Module):
            baz: Baz

        class Foo(nn.Module):
            def setup(self):
                self.bar = Bar(baz=Baz(a=1))

            def __call__(self, x):
                return self.bar.baz(x)
        return Foo()
    _variables_alike(make, lambda m, nn: m.init_with_output(jax.random.key(0), 1.0))


def test_functional_apply_reaches_a_field_modules_setup_attribute():
    def make(nn):
        class B(nn.Module):
            def setup(self):
                self.p1 = self.param("p1", lambda k: jnp.ones((2,)))

            def fn1(self, x):
                return self.p1 + x

        class A(nn.Module):
            b: nn.Module

            def __call__(self, x):
                return self.b.fn1(x)
        return A(b=B())

    def run(a, nn):
        x = jnp.zeros((2,))
        variables = nn.init(lambda a, x: a(x), a)(jax.random.key(0), x)
        return variables, nn.apply(lambda a, x: a.b.fn1(x), a)(variables, x)
    _variables_alike(make, run)


def test_one_module_under_three_keys_of_a_dict_field_is_one_submodule_named_by_the_first_key():
    def make(nn):
        class Count(nn.Module):
            @nn.compact
            def __call__(self, x):
                counter = self.variable("counter", "i", jnp.zeros, ())
                counter.value += 1
                return nn.Dense(1)(x)

        class Holder(nn.Module):
            mods: Any

            @nn.compact
            def __call__(self, x):
                return self.mods["foo"](x) + self.mods["bar"](x) + self.mods["baz"](x)
        shared = Count()
        return Holder({"foo": shared, "bar": shared, "baz": shared})

    def run(m, nn):
        x = jnp.ones((2, 2))
        variables = m.init(jax.random.key(0), x)
        return variables, m.apply(variables, x, mutable="counter")[1]
    _variables_alike(make, run)


@pytest.mark.parametrize("method", ["__call__", "run_a", "run_b"])
def test_a_module_shared_by_two_siblings_fields_is_reached_through_either(method):
    def make(nn):
        class Shared(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(1)(x)

        class Unshared(nn.Module):
            shared: nn.Module

            def __call__(self, x):
                return self.shared(x)

        class Super(nn.Module):
            a: nn.Module
            b: nn.Module

            def run_a(self, x):
                return self.a(x)

            def run_b(self, x):
                return self.b(x)

            def __call__(self, x):
                return self.a(x) + self.b(x)
        sh = Shared()
        return Super(a=Unshared(shared=sh), b=Unshared(shared=sh))

    def run(m, nn):
        variables = m.init(jax.random.key(0), jnp.ones(1))
        return variables, m.apply(variables, jnp.ones(1), method=method)
    _variables_alike(make, run)


def test_submodules_of_a_bound_nested_sequential_are_bound_with_their_variables():
    def make(nn):
        return nn.Sequential([nn.Sequential([nn.Dense(2), nn.relu, nn.Dense(2)]), nn.relu,
                              nn.Dense(2)])

    def run(m, nn):
        variables = m.init(jax.random.key(0), jnp.ones((1, 3)))
        bound = m.bind(variables)
        return bound.layers[0].layers[0].variables, bound.layers[2].variables
    _variables_alike(make, run)


def test_bind_leaves_setup_lazy_and_each_trace_runs_it_once():
    """``bind`` does not run setup; the first attribute access does, once.  A bound call
    traces the method, and setup runs once more under that trace (a deliberate difference
    from Linen, which runs the call in Python on the set-up module: notes/linen-parity.md);
    later calls reuse the trace.  Outputs are Linen's."""
    def counts(nn):
        count = []

        class Foo(nn.Module):
            def setup(self):
                count.append(1)
                self.dense = nn.Dense(2)

            def __call__(self, x):
                return self.dense(x)
        variables = Foo().init(jax.random.key(0), X)
        seen = [len(count)]
        bound = Foo().bind(variables)
        seen.append(len(count))
        for _ in range(2):
            bound.dense
            seen.append(len(count))
        outs = []
        for _ in range(2):
            outs.append(bound(X))
            seen.append(len(count))
        return seen, outs
    (linen, ref), (ours, got) = counts(fnn), counts(vnn)
    assert linen == [1, 1, 2, 2, 2, 2] and ours == [1, 1, 2, 2, 3, 3]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, ref)
