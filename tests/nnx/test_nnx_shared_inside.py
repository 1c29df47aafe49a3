"""A submodule a model holds at two attributes is one object inside every transform, as in
flax.nnx's graph mode (``varjax/objects/aliasing.py``): ``m.a is m.b`` holds there, an
attribute set through one alias is seen through the other and reaches the caller, and a
gradient taken inside another transform lists it once."""
import jax.numpy as jnp
import pytest
from flax import nnx as flax_nnx

from varjax import nnx as vnnx

LIBS = {"varjax": vnnx, "flax": flax_nnx}


def _model(nnx):
    class Sub(nnx.Module):
        def __init__(self, v):
            self.w = nnx.Param(jnp.array(v))

    class Model(nnx.Module):
        def __init__(self):
            shared = Sub(1.0)
            self.a, self.b, self.c = shared, shared, Sub(3.0)

        def __call__(self, x):
            return x * self.a.w[...] + self.c.w[...]
    return Model()


def _is(m):
    return jnp.asarray(m.a is m.b and m.a is not m.c, jnp.float32)


# Each transform applied to a body taking the model (and x), returning a float array.
TRANSFORMS = {
    "jit": lambda nnx, body: nnx.jit(body),
    "vmap": lambda nnx, body: lambda m, x: nnx.vmap(body, in_axes=(None, 0))(m, jnp.stack([x, x]))[0],
    "grad_aux": lambda nnx, body: lambda m, x: nnx.grad(
        lambda m, x: (m(x), body(m, x)), has_aux=True)(m, x)[1],
    "remat": lambda nnx, body: nnx.remat(body),
    "cond": lambda nnx, body: lambda m, x: nnx.cond(True, body, lambda m, x: x * 0, m, x),
    "switch": lambda nnx, body: lambda m, x: nnx.switch(0, [body, lambda m, x: x * 0], m, x),
    "fori_loop": lambda nnx, body: lambda m, x: nnx.fori_loop(
        0, 1, lambda i, c: (c[0], body(*c)), (m, x))[1],
    "scan": lambda nnx, body: lambda m, x: nnx.scan(
        lambda m, x: (m, body(m, x)), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
            m, jnp.stack([x]))[1][0],
}


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_module_held_at_two_attributes_is_one_object_inside_as_flax_nnx(transform):
    seen = {}
    for lib, nnx in LIBS.items():
        m = _model(nnx)
        seen[lib] = float(TRANSFORMS[transform](nnx, lambda m, x: _is(m) * x)(m, jnp.array(2.0)))
    assert seen["varjax"] == seen["flax"] == 2.0


@pytest.mark.parametrize("transform", ["jit", "grad_aux"])
def test_an_attribute_set_through_one_alias_is_seen_through_the_other_and_comes_back(transform):
    seen = {}
    for lib, nnx in LIBS.items():
        def body(m, x):
            m.a.extra = nnx.BatchStat(m.a.w[...] * 0 + 5.0)
            return m.b.extra[...] * x
        m = _model(nnx)
        y = TRANSFORMS[transform](nnx, body)(m, jnp.array(2.0))
        seen[lib] = (float(y), float(m.b.extra[...]), m.a is m.b)
    assert seen["varjax"] == seen["flax"] == (10.0, 5.0, True)


def test_a_gradient_inside_jit_lists_the_shared_submodule_once_as_flax_nnx():
    seen = {}
    for lib, nnx in LIBS.items():
        paths = []

        @nnx.jit
        def step(m, x):
            grads = nnx.grad(lambda m: m(x))(m)
            paths.append(sorted(tuple(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(grads))))
            return grads

        grads = step(_model(nnx), jnp.array(2.0))
        seen[lib] = (paths[0], float(grads.a.w[...]), type(grads).__name__)
    assert seen["varjax"] == seen["flax"]
    assert seen["varjax"][0] == [("a", "w"), ("c", "w")]


def test_an_object_given_at_two_arguments_is_one_object_inside_as_flax_nnx():
    seen = {}
    for lib, nnx in LIBS.items():
        m = _model(nnx)
        seen[lib] = float(nnx.jit(lambda s, m: jnp.asarray(s is m.a and s is m.b, jnp.float32))(m.a, m))
    assert seen["varjax"] == seen["flax"] == 1.0
