"""``setup`` runs inside every lifted transform, as in Linen, even when the body touches no
attribute: a variable ``setup`` creates exists after ``init`` (with the transform's shape,
e.g. the mapped axis of ``vmap``), and after the body the module's setup attributes are the
ones made outside it again (no value traced inside the body stays behind on the module).

Model source is written once in functions taking the ``nn`` namespace, so the same code runs
on flax.linen and varjax.nn; the variable layouts must agree, and varjax applied to Linen's
variables must give Linen's outputs.
"""
from __future__ import annotations

import functools

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import pytest
from transform_checks import close, data, layout, plain

import varjax.nn as vj_nn
from varjax import errors

KEY = jax.random.key(0)
X = data((2,))
XS = data((3, 2))


@functools.cache
def _program(nn):
    class S(nn.Module):
        """``unused`` is created in setup and never touched by a method."""

        def setup(self):
            self.w = self.param("w", nn.initializers.normal(1.0), (2,))
            self.unused = self.param("unused", nn.initializers.ones, (2,))

        def __call__(self, x):
            return x * self.w

        def plain(self, x):      # touches nothing
            return x * 2.0

        def step(self, c, x):
            return c + (x * self.w).sum(), x * 2.0

    def f(m, x):                 # a body that never touches the module
        return x * 2.0

    def uses_w(m, x):
        return x * m.w

    vmapped = dict(variable_axes={"params": 0}, split_rngs={"params": True})
    return {
        # Lifted module classes: the transform wraps the method call.
        "vmap": (lambda: nn.vmap(S, **vmapped)(), "call", XS),
        "jit, untouched": (lambda: nn.jit(S, methods=["plain"])(), "plain", X),
        "remat, untouched": (lambda: nn.remat(S, methods=["plain"])(), "plain", X),
        "vmap, untouched": (lambda: nn.vmap(S, **vmapped, methods=["plain"])(), "plain", XS),
        "fold_rngs": (lambda: nn.fold_rngs(S)(), "call", X),
        "map_variables": (lambda: nn.map_variables(S, "params", init=True)(), "call", X),
        "scan, broadcast": (lambda: nn.scan(S, variable_broadcast="params",
                                            split_rngs={"params": False}, methods=["step"])(),
                            "step", XS),
        "scan, stacked": (lambda: nn.scan(S, variable_axes={"params": 0},
                                          split_rngs={"params": True}, methods=["step"])(),
                          "step", XS),
        "remat_scan": (lambda: nn.remat_scan(S, lengths=(3,))(), "call", X),
        # The direct form: a function taking the module first.
        "jit(fn)": (S, lambda m, x: nn.jit(f)(m, x), X),
        "remat(fn)": (S, lambda m, x: nn.remat(f)(m, x), X),
        "vmap(fn)": (S, lambda m, x: nn.vmap(f, **vmapped)(m, x), XS),
        "vmap(fn) using w": (S, lambda m, x: nn.vmap(uses_w, **vmapped)(m, x), XS),
        "map_variables(fn)": (S, lambda m, x: nn.map_variables(f, "params", init=True)(m, x), X),
        "cond": (S, lambda m, x: nn.cond(True, f, uses_w, m, x), X),
        "switch": (S, lambda m, x: nn.switch(1, [uses_w, f], m, x), X),
        "grad": (S, lambda m, x: nn.grad(lambda m, x: f(m, x).sum(), m, x)[0], X),
        "value_and_grad": (S, lambda m, x: nn.value_and_grad(
            lambda m, x: f(m, x).sum(), m, x)[1][0], X),
        "vjp": (S, lambda m, x: nn.vjp(f, m, x)[0], X),
        "jvp": (S, lambda m, x: nn.jvp(f, m, (x,), (x,), {})[0], X),
        "custom_vjp": (S, lambda m, x: nn.custom_vjp(
            f, lambda m, x: (f(m, x), None), lambda res, g: ({}, g))(m, x), X),
    }


def _run(nn, name, variables=None):
    make, how, x = _program(nn)[name]
    if how == "call" or how == "plain":
        module = make()
        method = None if how == "call" else "plain"
        args = (x,)
    elif how == "step":
        module, method, args = make(), "step", (jnp.zeros(()), x)
    else:
        module, method, args = make(), how, (x,)
    if variables is None:
        return module.init(KEY, *args, method=method)
    return module.apply(variables, *args, method=method)


CASES = list(_program(vj_nn))


@pytest.mark.parametrize("name", CASES)
def test_a_variable_setup_creates_exists_after_init_as_in_linen(name):
    ours, theirs = _run(vj_nn, name), plain(_run(flax_nn, name))
    assert layout(ours) == layout(theirs)
    assert "unused" in ours["params"]
    # The same outputs as Linen's on Linen's variables.
    close(_run(vj_nn, name, theirs), _run(flax_nn, name, theirs))


class Untouched(vj_nn.Module):
    def setup(self):
        self.w = self.param("w", vj_nn.initializers.ones, (2,))

    def __call__(self, x):
        return x * 2.0


def _double(m, x):
    return x * 2.0


MESH = jax.sharding.Mesh(jax.devices()[:2], ("d",))
P = jax.sharding.PartitionSpec
TWO = XS[:2]
BEYOND_LINEN = {   # transforms Linen does not have (or cannot apply to a class)
    "named_call": (lambda: vj_nn.named_call(Untouched)().init(KEY, X), (2,)),
    "shard_map": (lambda: vj_nn.shard_map(Untouched, MESH, in_specs=P("d"), out_specs=P("d"),
                                          variable_specs={"params": P()})().init(KEY, TWO), (2,)),
    "pmap": (lambda: vj_nn.pmap(Untouched, variable_axes={"params": 0}, split_rngs={"params": True},
                                devices=jax.devices()[:2])().init(KEY, TWO), (2, 2)),
    "custom_jvp": (lambda: vj_nn.init(vj_nn.custom_jvp(_double, lambda m, xs, ts: (
        _double(m, *xs), _double(m, *ts))), Untouched())(KEY, X), (2,)),
}


@pytest.mark.parametrize("name", list(BEYOND_LINEN))
def test_transforms_beyond_linen_run_setup_too(name):
    init, shape = BEYOND_LINEN[name]
    assert jax.tree.map(jnp.shape, init()) == {"params": {"w": shape}}


def _setup_submodule_program(nn):
    class Inner(nn.Module):
        """Setup makes a parameter and a submodule; the call uses the submodule in both
        branches of a cond, and the parameter not at all."""

        def setup(self):
            self.b = self.param("b", nn.initializers.ones, (2,))
            self.dense = nn.Dense(2)

        def __call__(self, x):
            return nn.cond(x.sum() > 0, lambda m, x: m.dense(x), lambda m, x: -m.dense(x), self, x)

    return nn.vmap(Inner, variable_axes={"params": 0}, split_rngs={"params": True})()


def test_vmap_of_a_module_whose_call_conds_over_a_setup_submodule():
    ours = _setup_submodule_program(vj_nn).init(KEY, XS)
    theirs = plain(_setup_submodule_program(flax_nn).init(KEY, XS))
    assert layout(ours) == layout(theirs)
    assert ours["params"]["b"].shape == (3, 2)     # setup ran under vmap
    close(_setup_submodule_program(vj_nn).apply(theirs, XS),
          _setup_submodule_program(flax_nn).apply(theirs, XS))


def _reads_setup_after(nn, transform):
    class M(nn.Module):
        def setup(self):
            self.b = self.param("b", nn.initializers.ones, (2,))

        def __call__(self, x):
            if transform == "jit":
                y = nn.jit(lambda m, x: x * jnp.broadcast_to(m.b, x.shape))(self, x)
            else:
                y = nn.vmap(lambda m, x: x * m.b, variable_axes={"params": None},
                            split_rngs={"params": False})(self, x)
            # The attribute setup made outside, not the tracer the body's setup made.
            return y + jnp.broadcast_to(self.b, y.shape)

    return M()


@pytest.mark.parametrize("transform", ["jit", "vmap"])
def test_setup_attributes_read_after_a_lifted_body_are_the_outside_ones(transform):
    theirs = plain(_reads_setup_after(flax_nn, transform).init(KEY, XS))
    ours = _reads_setup_after(vj_nn, transform).init(KEY, XS)
    assert layout(ours) == layout(theirs)
    close(_reads_setup_after(vj_nn, transform).apply(theirs, XS),
          _reads_setup_after(flax_nn, transform).apply(theirs, XS))


def test_setup_creating_a_variable_inside_a_while_loop_is_a_clear_error():
    class S(vj_nn.Module):
        def setup(self):
            self.w = self.param("w", vj_nn.initializers.ones, (2,))

    def loop(m, x):   # the loop body is the first place the module is used
        return vj_nn.while_loop(lambda m, c: c[0] < 2, lambda m, c: (c[0] + 1, c[1] * 2.0),
                                m, (0, x))[1]

    with pytest.raises(errors.VariableCreationError) as info:
        vj_nn.init(loop, S())(KEY, X)
    assert (info.value.collection, info.value.path) == ("params", ("w",))


def test_a_while_loop_after_setup_reads_setups_variables():
    class S(vj_nn.Module):
        def setup(self):
            self.w = self.param("w", vj_nn.initializers.ones, (2,))

        def __call__(self, x):
            return vj_nn.while_loop(lambda m, c: c[0] < 2,
                                    lambda m, c: (c[0] + 1, c[1] * m.w * 2.0), self, (0, x))[1]

    variables = S().init(KEY, X)
    assert jax.tree.map(jnp.shape, variables) == {"params": {"w": (2,)}}
    close(S().apply(variables, X), X * 4.0)
