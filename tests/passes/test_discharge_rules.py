"""The discharge rule registry: a new higher-order primitive gets a rule by registering
one, a primitive without a rule whose body touches variables is rejected, and user code
in custom-derivative rules re-enters the user's trace through ``PassContext.reenter``."""
import contextlib

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from golden import context
from varjax import errors
from varjax.ir import nested
from varjax.ir.primitives import VarType, bind_get, bind_set
from varjax.passes import Discharge, PassContext, verify
from varjax.passes.default.discharge import RULES, register_discharge_rule
from varjax.passes.default.discharge.discharger import leaves_of, store, var_type
from varjax.passes.framework.analysis import traffic

KEY = ("s", ("a",))
F32 = jax.core.ShapedArray((), jnp.float32)
SCALAR = jax.tree.structure(0)


def _toy_call_primitive(name: str) -> jex.Primitive:
    """A call-like primitive holding one body (``body``): it has no rule anywhere."""
    p = jex.Primitive(name)
    p.multiple_results = True
    p.def_effectful_abstract_eval(lambda *args, body: (body.out_avals, body.effects))
    p.def_impl(lambda *args, body: jex.jaxpr_as_fun(body)(*args))
    return p


def _body(x):
    (a,) = bind_get(*KEY, SCALAR, (F32,))
    bind_set(*KEY, [a + x], SCALAR)
    return [a * x]


def _program(prim: jex.Primitive) -> jex.ClosedJaxpr:
    """``x -> prim[body](x)`` where the body reads and increments ``s:a``."""
    body = jax.make_jaxpr(_body)(F32)
    return jax.make_jaxpr(lambda x: prim.bind(x, body=body))(F32)


def _ctx() -> PassContext:
    return PassContext(variables={KEY: VarType(SCALAR, (F32,))}, mutable=True)


@pytest.fixture
def toy_p(monkeypatch):
    """A new call-like primitive, known to the traffic analysis; its rule is dropped after."""
    p = _toy_call_primitive("toy_call")
    monkeypatch.setitem(nested.TABLE, p, nested.Hop(("body",), "call"))
    yield p
    RULES.pop(p, None)


def test_a_registered_rule_discharges_its_primitive(toy_p):
    calls = []

    @register_discharge_rule(toy_p)
    def toy_rule(d, eqn, invals, env, region):
        calls.append(eqn.primitive)
        t = traffic(eqn.params["body"])
        in_keys, out_keys = sorted(t.needs), sorted(t.may_write)
        in_types = [(k, var_type(env[k])) for k in in_keys]
        new, out_types = d.body(eqn.params["body"], in_types, out_keys)
        outs = region.bind(eqn, [*leaves_of(env, in_keys), *invals], dict(eqn.params, body=new))
        return store(env, out_keys, out_types, outs)

    assert RULES[toy_p] is toy_rule
    ctx = _ctx()
    pure = Discharge().run(_program(toy_p), ctx)
    assert calls == [toy_p]
    verify(pure, discharged=True)
    assert ctx.results["signature"].inputs == ((KEY, VarType(SCALAR, (F32,))),)
    assert [k for k, _ in ctx.results["signature"].outputs] == [KEY]
    y, a = jex.jaxpr_as_fun(pure)(jnp.float32(2.0), jnp.float32(3.0))
    np.testing.assert_allclose([y, a], [6.0, 5.0])


@pytest.mark.parametrize("in_table", [False, True], ids=["unknown", "known-without-rule"])
def test_a_higher_order_primitive_without_a_rule_raises(monkeypatch, in_table):
    toy_p = _toy_call_primitive("toy_unruled_call")
    if in_table:
        monkeypatch.setitem(nested.TABLE, toy_p, nested.Hop(("body",), "call"))
    with pytest.raises(errors.UnsupportedPrimitiveError, match="toy_unruled_call") as info:
        Discharge().run(_program(toy_p), _ctx())
    assert info.value.collection == "s"


def test_every_built_in_higher_order_primitive_has_a_rule():
    assert set(nested.TABLE) <= set(RULES)


def _rule_reading_program():
    """A raw custom_jvp reading ``params:w``, then ``stats:n`` created after the call."""
    def f(x):
        @jax.custom_jvp
        def g(x):
            return vj.param("w", jax.nn.initializers.ones, ()) * jnp.sin(x)
        g.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
        y = g(x)
        vj.variable("stats", "n", jnp.zeros, ()).value = y
        return y

    variables = {"params": {"w": jnp.float32(2.0)}}
    jaxpr = vj.functionalize(f).jaxpr(jnp.float32(0.5), variables=variables, mutable=["stats"])
    return jaxpr, context(variables, mutable=("stats",))


def test_custom_rules_reenter_through_the_pass_context_with_types_at_the_call():
    jaxpr, ctx = _rule_reading_program()
    seen = []

    @contextlib.contextmanager
    def reenter(types):
        seen.append(dict(types))
        yield

    ctx.reenter = reenter
    pure = Discharge().run(jaxpr, ctx)
    assert seen == [{("params", ("w",)): VarType(SCALAR, (F32,))}]   # traced once, eagerly
    grad = jax.grad(lambda x: jex.jaxpr_as_fun(pure)(jnp.float32(2.0), x)[0])(jnp.float32(0.5))
    np.testing.assert_allclose(grad, np.cos(0.5), rtol=1e-6)
    assert len(seen) > 1 and all(s == seen[0] for s in seen)   # again when JAX differentiates


def test_custom_calls_see_each_write_before_them_and_share_an_unwritten_environment():
    # The environment is copied for a custom call only when a variable was written since
    # the last copy (one copy per layer made a deep model's discharge quadratic).
    def f(x):
        @jax.custom_jvp
        def g(x):
            return jnp.sin(x)
        g.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
        y = g(g(x))                                            # two calls, no write between
        vj.variable("stats", "n", jnp.zeros, ()).value = jnp.zeros((3,))   # a new type
        return g(y)

    jaxpr = vj.functionalize(f).jaxpr(jnp.float32(0.5), mutable=["stats"])
    seen = []

    @contextlib.contextmanager
    def reenter(types):
        seen.append(types)
        yield

    ctx = context({}, mutable=("stats",))
    ctx.reenter = reenter
    pure = Discharge().run(jaxpr, ctx)
    jax.grad(lambda x: jex.jaxpr_as_fun(pure)(x)[0])(jnp.float32(0.5))
    first, second, third = seen[:3]
    assert first is second                                    # one snapshot, shared
    assert ("stats", ("n",)) not in first
    assert third[("stats", ("n",))] == VarType(SCALAR, (jax.core.ShapedArray((3,), jnp.float32),))


def test_without_a_user_trace_custom_rules_run_as_they_are():
    jaxpr, ctx = _rule_reading_program()
    assert ctx.reenter is None
    pure = Discharge().run(jaxpr, ctx)
    grad = jax.grad(lambda x: jex.jaxpr_as_fun(pure)(jnp.float32(2.0), x)[0])(jnp.float32(0.5))
    np.testing.assert_allclose(grad, np.cos(0.5), rtol=1e-6)
