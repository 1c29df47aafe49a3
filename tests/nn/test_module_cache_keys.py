"""Equal modules share their trace only when their fields are equal by type *and* value.

``Fill(1) == Fill(1.0) == Fill(True)`` as dataclasses, but ``jnp.full((2,), v)`` traces to
int32, float32 and bool.  The shared-trace key (``statics.typed``) tells them apart through
submodule fields, tuples and dicts too, while modules that are equal in type and value still
share one trace.
"""
from typing import Any

import jax.numpy as jnp
import pytest

import varjax.nn as nn

X = jnp.ones((2,), jnp.float32)
VALUES = [1, 1.0, True]   # equal and of equal hash in Python: one trace would serve them all
DTYPES = [jnp.int32, jnp.float32, jnp.bool_]


class Fill(nn.Module):
    v: Any

    @nn.compact
    def __call__(self, x):
        return jnp.full((2,), self.v)


class FillFirst(nn.Module):
    """The value sits inside a tuple field."""

    v: tuple

    @nn.compact
    def __call__(self, x):
        return jnp.full((2,), self.v[0])


class FillKey(nn.Module):
    """The value sits inside a dict field."""

    v: Any

    @nn.compact
    def __call__(self, x):
        return jnp.full((2,), self.v["fill"])


class Holder(nn.Module):
    """The value sits in a submodule field (possibly inside a tuple of submodules)."""

    inner: Any

    @nn.compact
    def __call__(self, x):
        inner = self.inner[0] if isinstance(self.inner, tuple) else self.inner
        return inner(x)


def _dtypes(make):
    return [make(v).apply({}, X).dtype for v in VALUES]


@pytest.mark.parametrize("make", [
    Fill,
    lambda v: FillFirst((v, 2)),
    lambda v: FillKey({"fill": v}),
    lambda v: Holder(Fill(v)),
    lambda v: Holder((Fill(v), Fill(0))),
    lambda v: Holder(FillKey({"fill": v})),
], ids=["field", "tuple field", "dict field", "submodule field", "tuple of submodules",
        "dict in a submodule"])
def test_fields_equal_in_value_but_not_in_type_get_their_own_trace(make):
    assert _dtypes(make) == DTYPES


def test_modules_equal_in_type_and_value_still_share_one_functionalized():
    assert Holder(Fill(1.0)).functionalize() is Holder(Fill(1.0)).functionalize()
    assert Holder(Fill(1.0)).functionalize() is not Holder(Fill(1)).functionalize()


@pytest.mark.parametrize("make", [lambda: FillFirst([1.0]), lambda: Fill(jnp.float32(1))],
                         ids=["list", "array"])
def test_a_module_with_an_unhashable_field_keeps_its_trace_to_itself(make):
    a, b = make(), make()
    assert a.functionalize() is not b.functionalize()
    assert a.functionalize() is a.functionalize()
    assert a.apply({}, X).dtype == jnp.float32


def test_a_models_traces_go_with_the_last_equal_model():
    # The shared table holds traces weakly: the model object holds them, as jax.jit holds
    # its traces by the function, so a deep model's jaxprs do not outlive it.
    import gc
    import weakref

    model = Fill(2.0)
    model.apply({}, X)
    traces = weakref.ref(model.functionalize())
    twin = Fill(2.0)
    assert twin.functionalize() is traces()       # equal and alive: one trace
    del model
    gc.collect()
    assert traces() is not None                   # the twin still holds it
    del twin
    gc.collect()
    assert traces() is None
