"""Rows only varjax has that once worked and broke (issue 33): a Python number carried by a
lifted scan, custom derivative rules that declare the caller's parameters, and ``None`` in
a custom_vjp backward rule.  Each is checked against Flax Linen or pure JAX where one has
the behaviour."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp

import varjax.nn as nn

XS = jnp.arange(5.0)[:, None]


# -- scan: a Python number in the carry --------------------------------------------------

def _acc_model(lib, ys, seen):
    """``Acc`` adds each step's x to its ``state`` variable ``acc``, created in the body
    (a varjax extension of variable_carry), and counts the steps in a Python-int carry."""
    class Acc(lib.Module):
        @lib.compact
        def __call__(self, c, x):
            seen.append(isinstance(c, jax.Array))
            acc = self.variable("state", "acc", lambda: jnp.zeros(()))
            acc.value = acc.value + x.sum()
            return c + 1, (x if ys is None else ys)

    class Model(lib.Module):
        @lib.compact
        def __call__(self, xs):
            scan = lib.scan(Acc, variable_carry="state", split_rngs={"params": False},
                            in_axes=0, out_axes=0)
            return scan(name="acc")(0, xs)
    return Model()


def test_scan_python_int_carry_reaches_every_step_as_a_jax_value():
    seen = []
    model = _acc_model(nn, None, seen)
    variables = model.init(jax.random.key(0), XS)
    assert float(variables["state"]["acc"]["acc"]) == 10.0
    assert seen and all(seen)       # the peeled first step too, as in jax.lax.scan
    fresh = {"state": {"acc": {"acc": jnp.zeros(())}}}
    (c, ys), state = model.apply(fresh, XS, mutable=["state"])
    (c_linen, ys_linen), state_linen = _acc_model(flax_nn, None, []).apply(
        fresh, XS, mutable=["state"])
    assert int(c) == int(c_linen) == 5
    assert jnp.array_equal(ys, ys_linen)
    assert float(state["state"]["acc"]["acc"]) == float(state_linen["state"]["acc"]["acc"])


def test_scan_peeled_step_stacks_a_python_number_output_like_every_other_step():
    (c, ys), _ = _acc_model(nn, 2, []).init_with_output(jax.random.key(0), XS)
    fresh = {"state": {"acc": {"acc": jnp.zeros(())}}}
    (_, ys_linen), _ = _acc_model(flax_nn, 2, []).apply(fresh, XS, mutable=["state"])
    assert int(c) == 5
    assert jnp.array_equal(ys, ys_linen)
