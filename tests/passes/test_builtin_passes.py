"""Before/after goldens for every built-in pass (numerical equivalence: tests/test_fuzz.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from golden import assert_ir, context, run_pass
from varjax import errors
from varjax.ir import streams
from varjax.passes import get_pass

V = {"s": {"a": jnp.zeros((), jnp.float32)}}
ONE = jnp.float32(1)


def test_forward_stores_forwards_writes_and_repeated_reads():
    def f(x):
        a = vj.variable("s", "a")
        a.value = x
        return a.value + a.value

    _, after = run_pass("forward-stores", f, ONE, variables=V)
    assert_ir(after, "{ lambda ; a:f32[]. let var_set[s:a] a; b:f32[] = add a a in (b,) }")


def test_forward_stores_returns_the_same_object_when_nothing_forwards():
    def f(x):
        return x + vj.variable("s", "a").value

    before, after = run_pass("forward-stores", f, ONE, variables=V)
    assert after is before


def test_forward_stores_does_not_forward_across_a_loop_that_writes():
    def f(x):
        a = vj.variable("s", "a")
        first = a.value

        def body(i):
            a.value = a.value + 1.0
            return i + 1
        jax.lax.while_loop(lambda i: i < 2, body, 0)
        return first + a.value

    _, after = run_pass("forward-stores", f, ONE, variables=V)
    text = str(after)
    assert text.count("var_get[s:a]") == 3  # before the loop, in the body, after the loop


def test_dead_reads_drops_unused_reads():
    def f(x):
        _ = vj.variable("s", "a").value
        return x

    _, after = run_pass("dead-reads", f, ONE, variables=V)
    assert_ir(after, "{ lambda ; a:f32[]. let  in (a,) }")


def test_lower_rng_linen_constants_and_a_carried_counter_in_loops():
    """Explicit keys follow Linen's convention: a draw is ``fold_in(key, h)`` with ``h`` the
    constant of its module path and count; in a raw loop the loop's counter is folded in
    too, so iterations differ."""
    def f(x):
        k = vj.make_rng("dropout")
        ys = jax.lax.scan(lambda c, _: (c, jax.random.key_data(vj.make_rng("dropout"))),
                          0, None, length=2)[1]
        return k, ys

    _, after = run_pass("lower-rng", f, ONE, rngs={"dropout": jax.random.key(0)})
    assert_ir(after, """
        { lambda ; a:f32[]. let
            b:key<fry>[] = var_get[__rng__:dropout]
            c:key<fry>[] = random_fold_in b 3213575472:u32[]
            d:key<fry>[] = var_get[__rng__:dropout]
            var_set[__rng__:dropout/loop0/key] d
            var_set[__rng__:dropout/loop0/count] 0:u32[]
            e:u32[2,2] = scan[
              jaxpr={ lambda ; f:i32[]. let
                  g:key<fry>[] = var_get[__rng__:dropout/loop0/key]
                  h:key<fry>[] = random_fold_in g 3303678395:u32[]
                  i:u32[] = var_get[__rng__:dropout/loop0/count]
                  j:u32[] = add i 1:u32[]
                  var_set[__rng__:dropout/loop0/count] j
                  k:key<fry>[] = random_fold_in h i
                  l:u32[2] = random_unwrap k
                in (l,) }
              length=2
              num_carry=0
              num_consts=1
              reverse=False
              unroll=1
            ] 0:i32[]
          in (c, e) }""")
    assert [streams.linen_data((c,)) for c in (1, 2)] == [3213575472, 3303678395]


def test_lower_rng_lowers_a_key_nothing_uses_to_nothing():
    """Linen draws a key for every parameter, and a zeros initializer never uses its key:
    lower-rng leaves such a draw out rather than leaving dead-reads a DCE to run."""
    def f(x):
        vj.make_rng("dropout")
        return jax.random.key_data(vj.make_rng("dropout"))

    _, after = run_pass("lower-rng", f, ONE, rngs={"dropout": jax.random.key(0)})
    assert_ir(after, f"""
        {{ lambda ; a:f32[]. let
            b:key<fry>[] = var_get[__rng__:dropout]
            c:key<fry>[] = random_fold_in b {streams.linen_data((2,))}:u32[]
            d:u32[2] = random_unwrap c
          in (d,) }}""")


def test_lower_rng_lowers_a_stream_kept_as_state_implicitly_in_the_rngs_collection():
    def f(x):
        return vj.make_rng("dropout")

    state = {"rngs": {"dropout": {"key": jax.random.key(0), "count": jnp.uint32(0)}}}
    _, after = run_pass("lower-rng", f, ONE, variables=state, mutable=["rngs"])
    text = str(after)
    assert "var_get[rngs:dropout/key]" in text and "var_set[rngs:dropout/count]" in text


def test_lower_rng_rejects_a_linen_draw_of_a_stream_kept_as_state():
    """A draw traced under Linen's convention (the call gave a key) names its module path
    and count; lowered where the stream is state in ``rngs`` instead (NNX's convention),
    it has no key to fold them into, which is an error naming the stream and the line."""
    def f(x):
        return jax.lax.cond(x > 0, lambda: vj.make_rng("dropout"), lambda: vj.make_rng("dropout"))

    linen = vj.functionalize(f).jaxpr(ONE, variables={}, rngs={"dropout": jax.random.key(0)},
                                      mutable=True)
    state = {"rngs": {"dropout": {"key": jax.random.key(0), "count": jnp.uint32(0)}}}
    with pytest.raises(vj.errors.PassError, match="'dropout' follows Linen's convention") as e:
        get_pass("lower-rng")().run(linen, context(state, None, ["rngs"]))
    assert "test_builtin_passes.py" in str(e.value)


def test_lower_rng_linen_counts_run_on_across_branches():
    def f(p):
        def two():
            return jax.random.key_data(vj.make_rng("r")) + jax.random.key_data(vj.make_rng("r"))

        def one():
            return jax.random.key_data(vj.make_rng("r"))

        return jax.lax.cond(p, two, one), vj.make_rng("r")

    _, after = run_pass("lower-rng", f, jnp.bool_(True), rngs={"r": jax.random.key(0)})
    top = [e for e in after.jaxpr.eqns if e.primitive.name == "random_fold_in"]
    # Linen's convention: counts are assigned while tracing, and run on across the branches
    # (lax.cond traces `two` first: draws 1, 2; `one`: 3), so the draw after is the 4th
    assert [int(e.invars[1].val) for e in top] == [streams.linen_data((4,))]


def test_discharge_turns_reads_into_inputs_and_writes_into_outputs():
    def f(x):
        a = vj.variable("s", "a")
        a.value = a.value + x
        return a.value

    _, after = run_pass("discharge", f, ONE, variables=V)
    assert_ir(after, "{ lambda ; a:f32[] b:f32[]. let c:f32[] = add a b in (c, c) }")


def test_check_mutability_raises_and_otherwise_returns_its_input():
    def f(x):
        vj.variable("s", "a").value = x
        return x

    before, after = run_pass("check-mutability", f, ONE, variables=V, mutable=["s"])
    assert after is before
    with pytest.raises(errors.ImmutableCollectionError):
        run_pass("check-mutability", f, ONE, variables=V, mutable=["other"])


def test_cast_params_computes_in_the_requested_dtype():
    def f(x):
        w = vj.param("w", jax.nn.initializers.ones, (3,))
        ys = jax.lax.scan(lambda c, xi: (c + (xi * w).sum(), None), jnp.float32(0), x)[0]
        return x * w[None], ys

    x = jnp.full((2, 3), 1.1, jnp.float32)
    plain = vj.functionalize(f)
    v = plain.init(jax.random.key(0), x)
    cast = vj.functionalize(f, passes="cast-params{dtype=bfloat16}")
    text = str(cast.functional_jaxpr(x, variables=v))
    assert "bf16[2,3] = mul" in text
    (y, s) = cast.apply(v, x)
    assert y.dtype == jnp.float32 and s.dtype == jnp.float32   # declared output types kept
    np.testing.assert_allclose(y, np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float32))
    np.testing.assert_allclose(s, plain.apply(v, x)[1], rtol=1e-2)
