"""Module lifecycle corners of Linen (issue 37), each against flax.linen from one source:
``apply(method=...)`` in every form Linen takes, and the errors it raises."""
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
