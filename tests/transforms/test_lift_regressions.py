"""Rows only varjax has that once worked and broke (issue 33): a Python number carried by a
lifted scan, custom derivative rules that declare the caller's parameters, and ``None`` in
a custom_vjp backward rule.  Each is checked against Flax Linen or pure JAX where one has
the behaviour."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import pytest

import varjax as vj
import varjax.nn as nn
from varjax.errors import ModuleError, TransformError

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


# -- custom derivative rules declaring the caller's parameters ---------------------------

def _sin_scaled(mdl, x):
    return jnp.sin(x) * mdl.param("s", nn.initializers.ones_init(), ())


def _seven_jvp(mdl, primals, tangents):
    (x,), (tx,) = primals, tangents
    return _sin_scaled(mdl, x), 7.0 * tx


def _seven_fwd(mdl, x):
    return _sin_scaled(mdl, x), ()


def _seven_bwd(res, ct):
    return {"params": {"s": jnp.zeros(())}}, 7.0 * ct


class _JvpScaled(nn.Module):
    @nn.compact
    def __call__(self, x):
        return vj.custom_jvp(_sin_scaled, _seven_jvp)(self, x)


class _VjpScaled(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.custom_vjp(_sin_scaled, _seven_fwd, _seven_bwd)(self, x)


def _pure_seven(x):
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)
    f.defjvp(lambda p, t: (f(*p), 7.0 * t[0]))
    return jax.grad(f)(x)


@pytest.mark.parametrize("module", [_JvpScaled, _VjpScaled], ids=["custom_jvp", "custom_vjp"])
def test_custom_rule_declaring_a_param_of_its_compact_caller_gives_the_rule(module):
    """JAX traces the rule only when something differentiates it, after ``__call__`` has
    returned: the rule still declares ``s`` as the compact method could."""
    variables = module().init(jax.random.key(0), 0.3)
    assert float(jax.grad(lambda x: module().apply(variables, x))(0.3)) == _pure_seven(0.3)
    init_grad = jax.grad(lambda x: module().init_with_output(jax.random.key(0), x)[0])(0.3)
    assert float(init_grad) == 7.0


def test_custom_vjp_rule_declaring_a_caller_param_matches_linen():
    class Linen(flax_nn.Module):
        @flax_nn.compact
        def __call__(self, x):
            return flax_nn.custom_vjp(_sin_scaled, _seven_fwd, _seven_bwd)(self, x)
    variables = Linen().init(jax.random.key(0), 0.3)
    want = jax.grad(lambda x: Linen().apply(variables, x))(0.3)
    assert float(jax.grad(lambda x: _VjpScaled().apply(variables, x))(0.3)) == float(want)


def test_param_in_lifted_body_of_a_plain_method_is_still_rejected():
    class Plain(nn.Module):
        def __call__(self, x):       # neither setup nor @compact
            return vj.custom_jvp(_sin_scaled, _seven_jvp)(self, x)
    with pytest.raises(ModuleError, match="parameter 's' of Plain is declared outside setup"):
        Plain().init(jax.random.key(0), 0.3)


# -- None in a custom_vjp backward rule: a zero cotangent, as in jax.custom_vjp -----------

def _prod(mdl, t):
    return t[0] * t[1] * mdl.s


def _prod_fwd(mdl, t):
    return _prod(mdl, t), t


def _none_bwd(t, ct):
    return {"params": None}, (ct * t[1], None)


def _pure_prod_grad(t):
    @jax.custom_vjp
    def f(t):
        return t[0] * t[1]
    f.defvjp(lambda t: (f(t), t), lambda t, ct: ((ct * t[1], None),))
    return jax.grad(f)(t)


def _prod_module(lib, bwd):
    class Prod(lib.Module):
        def setup(self):
            self.s = self.param("s", nn.initializers.ones_init(), ())

        def __call__(self, t):
            return lib.custom_vjp(_prod, _prod_fwd, bwd)(self, t)
    return Prod()


def test_lifted_custom_vjp_bwd_none_is_a_zero_cotangent():
    t = (2.0, 3.0)
    model = _prod_module(nn, _none_bwd)
    variables = model.init(jax.random.key(0), t)
    got = jax.grad(lambda t: model.apply(variables, t))(t)
    want = _pure_prod_grad(t)
    linen = jax.grad(lambda t: _prod_module(flax_nn, _none_bwd).apply(variables, t))(t)
    assert [float(g) for g in got] == [float(g) for g in want] == [float(g) for g in linen]
    var_grad = jax.grad(lambda v: model.apply(v, t))(variables)
    assert float(var_grad["params"]["s"]) == 0.0


def test_lifted_custom_vjp_bwd_gradient_of_another_structure_names_it():
    model = _prod_module(nn, lambda t, ct: (None, (ct, ct, ct)))
    variables = model.init(jax.random.key(0), (2.0, 3.0))
    with pytest.raises(TransformError, match=r"argument gradient 0 of backward_fn has "
                       r"structure PyTreeDef\(\(\*, \*, \*\)\)(.|\n)*test_lift_regressions"):
        jax.grad(lambda t: model.apply(variables, t))((2.0, 3.0))


def test_object_mode_custom_vjp_bwd_none_is_a_zero_cotangent():
    q = vj.custom_vjp(lambda t: t[0] * t[1])
    q.defvjp(lambda t: (t[0] * t[1], t), lambda t, ct: ((ct * t[1], None),))
    t = (2.0, 3.0)
    assert [float(g) for g in jax.grad(q)(t)] == [float(g) for g in _pure_prod_grad(t)]

    class Lin(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x * self.param("w", nn.initializers.ones_init(), ())
    bound = Lin().bind(Lin().init(jax.random.key(0), 1.0))
    h = vj.custom_vjp(lambda m, x: m(x))
    h.defvjp(lambda m, x: (m(x), x), lambda x, ct: (None, 2.0 * ct))
    g_module, g_x = vj.grad(h, argnums=(0, 1))(bound, 1.0)
    assert float(vj.state(g_module)["params"]["w"]) == 0.0
    assert float(g_x) == 2.0
