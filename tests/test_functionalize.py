"""vj.functionalize: init/apply semantics, static arguments, caching, raw JAX control flow."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from varjax.ir import streams
from varjax.ir.effects import is_varjax_effect
from varjax.ir.nested import walk_eqns
from varjax.ir.primitives import VARJAX_PRIMITIVES

X = jnp.ones((2, 3), jnp.float32)


@vj.functionalize
def spec_model(x):
    w = vj.param("w", jax.nn.initializers.lecun_normal(), (x.shape[-1], 4))
    n = vj.variable("counters", "n", lambda: jnp.zeros((), jnp.int32))
    n.value += 1
    vj.sow("intermediates", "h", x @ w)
    return x @ w


def test_init_returns_every_collection_with_shapes():
    v = spec_model.init(jax.random.key(0), X)
    assert jax.tree.map(jnp.shape, v) == {
        "params": {"w": (3, 4)}, "counters": {"n": ()}, "intermediates": {"h": ((2, 4),)}}
    assert int(v["counters"]["n"]) == 1


def test_init_is_bitwise_equal_to_apply_with_empty_variables():
    a = spec_model.init(jax.random.key(3), X)
    _, b = spec_model.apply({}, X, rngs=jax.random.key(3), mutable=True)
    jax.tree.map(lambda p, q: np.testing.assert_array_equal(np.asarray(p), np.asarray(q)), a, b)


def test_apply_immutable_returns_output_only_and_mutable_returns_full_collections():
    v = spec_model.init(jax.random.key(0), X)
    v = {"params": v["params"], "counters": v["counters"]}
    y = spec_model.apply(v, X, mutable=["counters", "intermediates"])[0]
    np.testing.assert_allclose(y, X @ v["params"]["w"], rtol=1e-6)
    _, upd = spec_model.apply(v, X, mutable="counters")
    assert set(upd) == {"counters"} and int(upd["counters"]["n"]) == 2
    _, upd = spec_model.apply(v, X, mutable=vj.DenyList("params"))
    assert set(upd) == {"counters", "intermediates"}
    _, upd = spec_model.apply(v, X, mutable=True)
    assert set(upd) == {"params", "counters", "intermediates"}
    assert upd["params"]["w"] is v["params"]["w"]  # untouched variables pass through untouched


def test_sow_into_immutable_collection_is_a_noop():
    @vj.functionalize
    def f(x):
        return vj.sow("intermediates", "h", x)

    assert not bool(f.apply({}, X))
    out, upd = f.apply({}, X, mutable=["intermediates"])
    assert bool(out) and upd["intermediates"]["h"][0].shape == X.shape


def test_unwritten_mutable_collection_is_returned_unchanged():
    @vj.functionalize
    def f(x):
        return x * vj.variable("stats", "m", jnp.zeros, (3,)).value[None]

    v = {"stats": {"m": jnp.ones(3)}, "other": {"z": jnp.zeros(2)}}
    _, upd = f.apply(v, X, mutable=True)
    assert upd["other"]["z"] is v["other"]["z"] and upd["stats"]["m"] is v["stats"]["m"]
    assert len(f.functional_jaxpr(X, variables=v, mutable=True).out_avals) == 1


def test_python_scalars_are_static_and_visible_to_control_flow():
    @vj.functionalize
    def f(x, scale, mode):
        return x * scale if mode == "mul" else x + scale

    np.testing.assert_allclose(f.apply({}, X, 2.0, "mul"), X * 2)
    np.testing.assert_allclose(f.apply({}, X, 2.0, "add"), X + 2)
    assert f.trace_count == 2


def test_control_flow_on_traced_value_raises_with_varjax_hint():
    @vj.functionalize
    def f(x):
        return x if x.sum() > 0 else -x

    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        f.apply({}, X)
    assert "varjax: the function is traced once" in "\n".join(info.value.__notes__)


def test_repeated_apply_does_not_retrace_or_rerun_passes():
    calls = []

    @vj.functionalize
    def f(x):
        calls.append(1)
        return x * vj.param("w", jax.nn.initializers.ones, (3,))[None]

    v = f.init(jax.random.key(0), X)
    for _ in range(3):
        f.apply(v, X)
    assert len(calls) == 2 and f.trace_count == 2  # one init trace, one apply trace
    f.apply(v, jnp.ones((5, 3)))
    assert f.trace_count == 3


def test_cached_apply_stages_as_one_call_under_an_enclosing_trace():
    f = vj.functionalize(lambda x: jnp.tanh(x @ vj.param("w", jax.nn.initializers.ones, (3, 4))))
    v = f.init(jax.random.key(0), X)
    f.apply(v, X)
    jaxpr = jax.make_jaxpr(lambda v, x: f.apply(v, x))(v, X)
    assert [e.primitive.name for e in jaxpr.jaxpr.eqns] == ["jit"]
    y = jax.jit(lambda v, x: f.apply(v, x))(v, X)
    np.testing.assert_allclose(y, f.apply(v, X), rtol=1e-6)
    assert f.trace_count == 2


def test_functional_jaxpr_has_no_varjax_primitive_or_effect():
    v = spec_model.init(jax.random.key(0), X)
    pure = spec_model.functional_jaxpr(X, variables=v, mutable=True)
    assert not any(is_varjax_effect(e) for e in pure.effects)
    for eqn, _ in walk_eqns(pure):
        assert eqn.primitive not in VARJAX_PRIMITIVES
        assert not any(is_varjax_effect(e) for e in eqn.effects)
    assert "var_get[params:w]" in str(spec_model.jaxpr(X, variables=v, mutable=True))


@vj.functionalize
def deep(x):
    c = vj.variable("state", "c", lambda: jnp.zeros((), jnp.float32))
    w = vj.param("w", jax.nn.initializers.ones, (3,))

    def inner(x):
        def body(carry, xi):
            def taken(v):
                c.value = c.value + v.sum()
                return v * 2.0
            y = jax.lax.cond(xi.sum() > 0, taken, lambda v: v, xi)
            return carry + (y * w).sum(), y
        return jax.lax.scan(body, jnp.zeros((), jnp.float32), x)

    return jax.checkpoint(jax.jit(inner))(x)


def test_write_in_cond_in_scan_in_jit_in_checkpoint():
    x = jnp.array([[1.0, 1, 1], [-1, -1, -1], [2, 2, 2]], jnp.float32)
    v = deep.init(jax.random.key(0), x)
    assert float(v["state"]["c"]) == 9.0
    (total, ys), upd = deep.apply(v, x, mutable=["state"])
    assert float(upd["state"]["c"]) == 18.0
    np.testing.assert_allclose(total, 6.0 - 3.0 + 12.0)
    np.testing.assert_allclose(ys, [[2, 2, 2], [-1, -1, -1], [4, 4, 4]])


def test_variables_only_read_in_a_loop_enter_as_loop_constants():
    @vj.functionalize
    def f(xs):
        w = vj.param("w", jax.nn.initializers.ones, (3,))
        return jax.lax.scan(lambda c, x: (c + (x * w).sum(), None), jnp.zeros(()), xs)[0]

    xs = jnp.ones((4, 3))
    v = f.init(jax.random.key(0), xs)
    scan = [e for e, _ in walk_eqns(f.functional_jaxpr(xs, variables=v)) if e.primitive.name == "scan"]
    assert len(scan) == 1 and scan[0].params["num_carry"] == 1
    assert float(f.apply(v, xs)) == 12.0


def test_while_loop_carries_written_variables():
    @vj.functionalize
    def f(x):
        n = vj.variable("state", "n", lambda: jnp.zeros((), jnp.int32))

        def body(i):
            n.value = n.value + i
            return i + 1
        return jax.lax.while_loop(lambda i: i < 4, body, 0) + x.sum().astype(jnp.int32) * 0

    v = f.init(jax.random.key(0), X)
    assert int(v["state"]["n"]) == 6
    _, upd = f.apply(v, X, mutable="state")
    assert int(upd["state"]["n"]) == 12


def test_switch_branches_may_write_different_variables():
    @vj.functionalize
    def f(i, x):
        a = vj.variable("s", "a", lambda: jnp.zeros(()))
        b = vj.variable("s", "b", lambda: jnp.zeros(()))

        def br0(x):
            a.value = a.value + x
            return x

        def br1(x):
            b.value = b.value + 2 * x
            return x

        return jax.lax.switch(i, [br0, br1, lambda x: x], x)

    x = jnp.float32(1.0)
    v = f.init(jax.random.key(0), jnp.int32(0), x)
    assert (float(v["s"]["a"]), float(v["s"]["b"])) == (1.0, 0.0)
    _, upd = f.apply(v, jnp.int32(1), x, mutable=True)
    assert (float(upd["s"]["a"]), float(upd["s"]["b"])) == (1.0, 2.0)


def test_inner_jax_jit_is_retraced_when_the_variable_context_changes():
    @jax.jit
    def block(x):
        return x * vj.param("w", jax.nn.initializers.ones, (3,))[None]

    f = vj.functionalize(lambda x: block(x))
    v = f.init(jax.random.key(0), X)  # block traced creating w
    v = {"params": {"w": jnp.full((3,), 2.0)}}
    np.testing.assert_allclose(f.apply(v, X), 2 * X)  # block re-traced reading w


def test_make_rng_keys_are_linen_fold_ins_of_the_stream_key():
    @vj.functionalize
    def f(x):
        return vj.make_rng("dropout"), vj.make_rng("dropout")

    key = jax.random.key(7)
    k0, k1 = f.apply({}, X, rngs={"dropout": key})
    first, second = (streams.derive_at(key, (), c) for c in (1, 2))
    assert np.array_equal(jax.random.key_data(k0), jax.random.key_data(first))
    assert np.array_equal(jax.random.key_data(k1), jax.random.key_data(second))
    k0b, _ = f.apply({}, X, rngs={"dropout": key})
    assert np.array_equal(jax.random.key_data(k0), jax.random.key_data(k0b))


def test_draws_inside_a_scan_differ_per_iteration():
    @vj.functionalize
    def f(x):
        return jax.lax.scan(lambda c, _: (c, jax.random.uniform(vj.make_rng("noise"))),
                            0.0, None, length=4)[1]

    u = np.asarray(f.apply({}, X, rngs={"noise": jax.random.key(0)}))
    assert len(set(u.tolist())) == 4


def test_raw_grad_over_stateful_code_differentiates_arguments_only():
    @vj.functionalize
    def f(x):
        w = vj.param("w", jax.nn.initializers.ones, (3,))
        s = vj.variable("stats", "s", lambda: jnp.zeros(3))

        def loss(x):
            s.value = x * 2.0          # stores the primal
            return (x * w * w).sum()
        return jax.grad(loss)(x)

    x = jnp.arange(3.0)
    v = f.init(jax.random.key(0), x)
    g, upd = f.apply(v, x, mutable=["stats"])
    np.testing.assert_allclose(g, jnp.ones(3))
    np.testing.assert_allclose(upd["stats"]["s"], x * 2)


def test_raw_vmap_reads_are_broadcast():
    @vj.functionalize
    def f(xs):
        w = vj.param("w", jax.nn.initializers.ones, (3,))
        return jax.vmap(lambda x: x * w)(xs)

    v = f.init(jax.random.key(0), X)
    np.testing.assert_allclose(f.apply(v, X), X)


def test_custom_jvp_and_custom_vjp_rules_are_kept_after_discharge():
    @vj.functionalize
    def f(x):
        c = vj.variable("state", "c", lambda: jnp.zeros(()))

        @jax.custom_jvp
        def g(x):
            c.value = c.value + 1.0
            return jnp.sin(x) * vj.param("w", jax.nn.initializers.ones, ())

        g.defjvp(lambda p, t: (g(p[0]), 10.0 * t[0]))

        @jax.custom_vjp
        def h(x):
            return x * vj.param("w", jax.nn.initializers.ones, ())

        h.defvjp(lambda x: (h(x), None), lambda r, ct: (3.0 * ct,))
        return g(x) + h(x)

    x = jnp.float32(0.5)
    v = f.init(jax.random.key(0), x)
    assert float(v["state"]["c"]) == 1.0
    out, upd = f.apply(v, x, mutable="state")
    np.testing.assert_allclose(out, np.sin(0.5) + 0.5, rtol=1e-6)
    assert float(upd["state"]["c"]) == 2.0
    g = jax.grad(lambda x: f.apply(v, x, mutable="state")[0])(x)
    np.testing.assert_allclose(g, 13.0)


def test_jaxpr_only_traces_so_it_works_when_a_pass_would_fail():
    @vj.functionalize
    def f(x):
        vj.variable("s", "a", jnp.zeros, (3,)).value = x
        return x

    v = {"s": {"a": jnp.zeros(3)}}
    assert "var_set[s:a]" in str(f.jaxpr(X[0], variables=v))   # immutable 's': apply would raise
    with pytest.raises(vj.errors.ImmutableCollectionError):
        f.apply(v, X[0])
    assert f.trace_count == 1   # apply reused the trace


def test_functionalized_functions_compose_inside_each_other():
    @vj.functionalize
    def layer(x):
        return x * vj.param("w", jax.nn.initializers.ones, (3,))[None]

    @vj.functionalize
    def model(x):
        return layer(layer(x))

    v = model.init(jax.random.key(0), X)
    assert list(v["params"]) == ["w"]       # same scope: one shared parameter
    with pytest.raises(vj.errors.ScopeError):
        layer(X)


def test_init_with_output_returns_output_and_variables():
    y, v = spec_model.init_with_output(jax.random.key(0), X)
    np.testing.assert_allclose(y, X @ v["params"]["w"], rtol=1e-6)


def test_a_cached_inner_jit_that_creates_a_variable_is_not_reused_by_a_later_trace():
    @jax.jit
    def helper(x):
        vj.variable("stats", "n", jnp.zeros, ()).value = x
        return x

    @vj.functionalize
    def f(x, flag):
        helper(x)
        return vj.variable("stats", "n").value

    x = jnp.float32(1)
    assert float(f.init(jax.random.key(0), x, True)["stats"]["n"]) == 1.0
    assert float(f.init(jax.random.key(0), x, False)["stats"]["n"]) == 1.0  # a second trace


def test_gradient_wrt_a_variable_read_inside_a_raw_custom_rule_raises():
    @vj.functionalize
    def f(x):
        @jax.custom_jvp
        def g(x):
            return x * vj.param("w", jax.nn.initializers.ones, ())

        g.defjvp(lambda p, t: (g(p[0]), t[0]))

        @jax.custom_vjp
        def h(x):
            return x * vj.param("w", jax.nn.initializers.ones, ())

        h.defvjp(lambda x: (h(x), None), lambda r, ct: (ct,))
        return g(x), h(x)

    x = jnp.float32(2.0)
    v = f.init(jax.random.key(0), x)
    for i in (0, 1):
        with pytest.raises(vj.errors.TransformError, match="read inside a raw jax.custom_"):
            jax.grad(lambda v: f.apply(v, x)[i])(v)
        np.testing.assert_allclose(jax.grad(lambda x: f.apply(v, x)[i])(x), 1.0)


def test_custom_rule_of_a_variable_free_call_can_use_the_variable_api():
    @vj.functionalize
    def f(x):
        @jax.custom_jvp
        def g(x):
            vj.variable("state", "v", jnp.ones, ())   # declares only: no read, no write
            return jnp.sin(x)

        g.defjvp(lambda p, t: (g(p[0]), 2.0 * t[0]))
        return g(x) + vj.variable("state", "v").value

    x = jnp.float32(0.3)
    v = f.init(jax.random.key(0), x)
    np.testing.assert_allclose(jax.grad(lambda x: f.apply(v, x))(x), 2.0)


def test_custom_rule_reading_a_variable_its_function_does_not_raises():
    @vj.functionalize
    def f(x):
        @jax.custom_jvp
        def g(x):
            return jnp.sin(x)

        g.defjvp(lambda p, t: (g(p[0]), vj.variable("state", "v").value * t[0]))
        vj.variable("state", "v", jnp.ones, ())
        return g(x)

    x = jnp.float32(0.3)
    v = f.init(jax.random.key(0), x)
    with pytest.raises(vj.errors.TransformError, match="touches variables that its function"):
        jax.grad(lambda x: f.apply(v, x))(x)


def test_non_array_outputs_come_back_from_init_and_apply_as_in_linen():
    @vj.functionalize
    def described(x):
        w = vj.param("w", lambda key: jnp.ones(2))
        return {"y": x * w, "name": "described", "n": 3, "none": None}
    x = jnp.ones(2)
    out, variables = described.init_with_output(jax.random.key(0), x)
    for result in (out, described.apply(variables, x), described.apply(variables, x)):
        assert {k: v for k, v in result.items() if k != "y"} == {"name": "described", "n": 3,
                                                                 "none": None}
        assert type(result["n"]) is int
        np.testing.assert_array_equal(result["y"], [1.0, 1.0])
