"""Option and usage errors of the built-in lifted transforms that the per-transform test
files do not trigger: each raises ``TransformError`` (or ``VariableCreationError``) whose
message names the transform, whose ``at:`` line is the user's line in this file, and which
says how to fix it.  Errors about a variable also name its collection and path."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import varjax as vj
import varjax.nn as nn
from varjax import errors

X = jnp.ones((3, 2))
INIT = jax.nn.initializers.normal(1.0)


def _raises(fn, transform, *, cls=errors.TransformError, collection=None, path=None):
    with pytest.raises(cls) as info:
        fn()
    err = info.value
    assert f"vj.{transform}" in str(err)
    assert err.fix
    assert err.source is not None and "test_transform_option_errors.py" in err.source
    assert (err.collection, err.path) == (collection, path)
    return err


def test_scan_rejects_data_transform():
    _raises(lambda: vj.scan(lambda c, x: (c, x), data_transform=lambda *a: a), "scan")


def test_scan_without_xs_or_length_cannot_know_its_number_of_steps():
    @vj.functionalize
    def f(c):
        return vj.scan(lambda c, _: (c, None))(c, None)
    _raises(lambda: f.init(jax.random.key(0), X), "scan")


def test_scan_body_must_return_carry_and_ys():
    @vj.functionalize
    def f(xs):
        return vj.scan(lambda c, x: c + x)(jnp.zeros(2), xs)
    _raises(lambda: f.init(jax.random.key(0), X), "scan")


def test_remat_scan_needs_lengths():
    _raises(lambda: vj.remat_scan(lambda c: c, lengths=()), "remat_scan")


def test_jit_rejects_device_and_backend():
    _raises(lambda: vj.jit(lambda x: x, backend="cpu"), "jit")


def test_remat_rejects_concrete():
    _raises(lambda: vj.remat(lambda x: x, concrete=True), "remat")


def test_vjp_rejects_reduce_axes():
    @vj.functionalize
    def f(x):
        return vj.vjp(lambda x: x * vj.param("w", INIT, (3, 2)), None, x, reduce_axes=("batch",))
    _raises(lambda: f.init(jax.random.key(0), X), "vjp")


def test_value_and_grad_needs_a_scalar_output():
    @vj.functionalize
    def f(x):
        return vj.value_and_grad(lambda x: x * vj.param("w", INIT, (3, 2)), None, x)
    _raises(lambda: f.init(jax.random.key(0), X), "value_and_grad")


def test_custom_vjp_nondiff_argnums_cannot_name_the_module():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            f = nn.custom_vjp(lambda m, x: x, lambda m, x: (x, None), lambda res, g: ({}, g),
                              nondiff_argnums=(0,))
            return f(self, x)
    _raises(lambda: M().init(jax.random.key(0), X), "custom_vjp")


def test_cond_creating_a_variable_in_one_branch_names_the_branch():
    @vj.functionalize
    def f(x):
        def makes(x):
            return x * vj.param("w", INIT, (3, 2))
        return vj.cond(True, makes, lambda x: x, None, x)
    err = _raises(lambda: f.init(jax.random.key(0), X), "cond", cls=errors.VariableCreationError,
                  collection="params", path=("w",))
    assert "true_fun" in str(err) and "false_fun" in str(err)
