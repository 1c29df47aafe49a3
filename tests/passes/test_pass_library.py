"""The pass library (fake-quant, stop-gradient, tie) against hand-written models.

Each pass is compared with a model that does by hand what the pass does to the IR: same
outputs in init and apply, same gradients; every error path is triggered.  Shapes are tiny
so each call compiles little.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from golden import assert_ir, run_pass
from varjax import errors, nn
from varjax.passes import FakeQuant, Pass, Pipeline, StopGradient, Tie
from varjax.passes.library.fake_quant import fake_quantize

KEY = jax.random.key(0)
normal = jax.nn.initializers.normal(1.0)


def run(fn, variables, *args):
    """``(output, gradient of its sum with respect to every variable)``: one compiled call."""
    def loss(v):
        y = fn(v, *args)
        return jnp.sum(y), y
    (_, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(variables)
    return y, g


def assert_trees_close(a, b, **kw):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **kw), a, b)


# --- fake-quant -------------------------------------------------------------------------

def layer(x):
    w = vj.param("w", normal, (3, 4))
    b = vj.param("b", normal, (4,))
    return jnp.tanh(x @ w + b[None])


def quantized(w, bits=8, axis=None):
    """The reference: symmetric round-to-nearest onto ``2**(bits-1) - 1`` levels a side."""
    w = np.asarray(w, np.float64)
    qmax = 2 ** (bits - 1) - 1
    scale = np.max(np.abs(w), axis=axis, keepdims=True) / qmax
    return (np.clip(np.round(w / scale), -qmax, qmax) * scale).astype(np.float32)


X = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)


@pytest.mark.parametrize("spec, per_channel, min_rank", [
    ("fake-quant{bits=8}", False, 2),
    ("fake-quant{bits=4,per_channel=true,min_rank=0}", True, 0),
])
def test_fake_quant_equals_the_model_on_quantized_params_with_identity_gradients(
        spec, per_channel, min_rank):
    plain, fq = vj.functionalize(layer), vj.functionalize(layer, passes=spec)
    bits = FakeQuant(**{"bits": 8} if "bits=8" in spec else {"bits": 4}).bits
    v = plain.init(KEY, X)
    y0, v0 = fq.init_with_output(KEY, X)
    assert_trees_close(v0, v)                      # stored params stay float, unquantized
    p = v["params"]
    axis = 0 if per_channel else None
    q = {"w": quantized(p["w"], bits, axis),
         "b": quantized(p["b"], bits) if min_rank == 0 else p["b"]}   # vectors: per tensor
    assert np.array_equal(q["b"], p["b"]) == (min_rank == 2)
    assert not np.allclose(q["w"], p["w"], atol=1e-4)
    want, want_grads = run(plain.apply, {"params": q}, X)
    got, got_grads = run(fq.apply, v, X)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(y0, want, rtol=1e-6, atol=1e-6)     # init computes as apply
    # Straight-through: d/dw f(q(w)) is f'(q(w)), the rounding's derivative taken as 1.
    assert_trees_close(got_grads, want_grads, rtol=1e-5, atol=1e-6)


def test_fake_quant_grid_has_2_to_the_bits_minus_1_levels_and_keeps_zero_and_ints():
    w = jnp.linspace(-3.0, 5.0, 101, dtype=jnp.float32)
    q, zeros, g = jax.jit(lambda w: (fake_quantize(w, 3), fake_quantize(0 * w, 8),
                                     jax.grad(lambda w: fake_quantize(w, 8).sum())(w)))(w)
    assert len(np.unique(q)) <= 7 and q.max() == 5.0 and np.isin(0.0, q)
    np.testing.assert_array_equal(zeros, 0.0)      # an all-zero tensor: scale 1, not 0/0
    assert g.tolist() == [1.0] * 101               # straight through
    ints = jnp.arange(-2, 3, dtype=jnp.int32)
    f = vj.functionalize(lambda: vj.param("i", lambda k: ints) * 1,
                         passes="fake-quant{min_rank=0}")
    np.testing.assert_array_equal(f.init_with_output(KEY)[0], ints)      # integers untouched


def test_fake_quant_rewrites_reads_inside_loop_bodies():
    def looped(x):
        def step(h, _):
            return jnp.tanh(h @ vj.param("w", normal, (3, 3))), None
        vj.param("w", normal, (3, 3))       # created before the loop, read inside it
        return jax.lax.scan(step, x, None, length=2)[0]

    plain, fq = vj.functionalize(looped), vj.functionalize(looped, passes="fake-quant")
    v = plain.init(KEY, X)
    (scan,) = fq.functional_jaxpr(X, variables=v).jaxpr.eqns   # the read outside is dead
    assert "round[rounding_method=1]" in str(scan.params["jaxpr"])
    q = {"params": {"w": quantized(v["params"]["w"])}}
    np.testing.assert_allclose(fq.apply(v, X), plain.apply(q, X), rtol=1e-6)


@pytest.mark.parametrize("spec, message", [
    ("fake-quant{bits=1}", "bits must be between 2 and 16, got 1"),
    ("fake-quant{bits=eight}", "bad value 'eight' for option 'bits'"),
    ("fake-quant{min_rank=-1}", "min_rank must be 0 or more"),
])
def test_fake_quant_rejects_bad_options(spec, message):
    with pytest.raises(errors.PipelineError, match=message):
        vj.functionalize(layer, passes=spec)


# --- stop-gradient ----------------------------------------------------------------------

class Scaled(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(3)(x)
        scale = self.variable("consts", "scale", lambda: jnp.full((3,), 2.0))
        return nn.Dense(2)(jnp.tanh(h * scale.value[None]))


def test_stop_gradient_zeroes_exactly_the_frozen_variables_gradients():
    model = Scaled()
    fn = model.functionalize().fn
    v = model.init(KEY, X)
    y, plain = run(model.apply, v, X)
    assert all(np.any(g != 0) for g in jax.tree.leaves(plain))
    y0, _ = vj.functionalize(fn, passes="stop-gradient{collection=params}").init_with_output(KEY, X)
    np.testing.assert_array_equal(y0, y)
    for spec, frozen in [("stop-gradient{collection=consts}", lambda c, path: c == "consts"),
                         ("stop-gradient{collection=params,under=Dense_0}",
                          lambda c, path: c == "params" and path[0] == "Dense_0"),
                         ("stop-gradient{collection=params}", lambda c, path: c == "params")]:
        got_y, got = run(vj.functionalize(fn, passes=spec).apply, v, X)
        np.testing.assert_array_equal(got_y, y)
        for c in v:
            for path, g in _flat(got[c]):
                want = 0 * g if frozen(c, path) else _at(plain[c], path)
                np.testing.assert_array_equal(g, want, err_msg=f"{spec}: {c}/{path}")


def _flat(tree, prefix=()):
    for k, sub in tree.items():
        yield from _flat(sub, prefix + (k,)) if isinstance(sub, dict) else [(prefix + (k,), sub)]


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def test_stop_gradient_ir_and_writes_left_alone():
    def f(x):
        count = vj.variable("stats", "n", jnp.zeros, ())
        count.value = count.value + 1
        return x * vj.param("w", jax.nn.initializers.ones, (2,)) * count.value

    v = vj.functionalize(f).init(KEY, X[0, :2])
    _, after = run_pass("stop-gradient", f, X[0, :2], variables=v, collection="stats")
    assert_ir(after, """
        { lambda ; a:f32[2]. let
            b:f32[] = var_get[stats:n]
            c:f32[] = stop_gradient b
            d:f32[] = add c 1.0:f32[]
            var_set[stats:n] d
            e:f32[2] = var_get[params:w]
            f:f32[2] = mul a e
            g:f32[] = var_get[stats:n]
            h:f32[] = stop_gradient g
            i:f32[2] = mul f h
          in (i,) }""")
    with pytest.raises(errors.PipelineError, match="collection=batch_stats matches no collection"):
        run_pass("stop-gradient", f, X[0, :2], variables=v, collection="batch_stats")
    assert StopGradient(collection="params", under="a/b/").spec() == \
        "stop-gradient{collection=params,under=a/b/}"
    with pytest.raises(errors.PipelineError, match="needs option"):
        Pipeline.parse("stop-gradient")


# --- tie --------------------------------------------------------------------------------

V_, D_ = 5, 3
IDS = jnp.array([0, 3, 4, 3])


class Untied(nn.Module):
    """An LM whose output projection is a Dense of its own: tie it with the pass."""
    out: int = V_

    @nn.compact
    def __call__(self, ids):
        h = jnp.tanh(nn.Dense(D_)(nn.Embed(V_, D_)(ids)))
        return nn.Dense(self.out, use_bias=False)(h)


class Attend(nn.Module):
    """The same LM tied by hand: the embedding table is the output projection."""

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(V_, D_)
        return embed.attend(jnp.tanh(nn.Dense(D_)(embed(ids))))


TIE = "tie{src=Embed_0/embedding,dst=Dense_1/kernel}"


def test_tie_equals_the_hand_tied_model_in_init_and_apply_with_equal_gradients():
    tied = vj.functionalize(Untied().functionalize().fn, passes=TIE)
    y, v = tied.init_with_output(KEY, IDS)
    y_ref, v_ref = Attend().init_with_output(KEY, IDS)
    assert jax.tree.map(jnp.shape, v) == jax.tree.map(jnp.shape, v_ref)   # no Dense_1 at all
    assert_trees_close(v, v_ref, rtol=0, atol=0)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6)
    got, g = run(tied.apply, v, IDS)           # init's variables: no dst
    want, g_ref = run(Attend().apply, v_ref, IDS)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert_trees_close(g, g_ref, rtol=1e-5, atol=1e-7)
    signature = tied.traced(IDS, variables=v).signature
    assert ("params", ("Dense_1", "kernel")) not in [k for k, _ in signature.inputs]


def test_tie_apply_needs_no_dst():
    """Module.init then Module.apply, both with the pass: apply gets init's variables,
    which have no dst (the pass supplies it); a dst given anyway is no input."""
    v = Untied().init(KEY, IDS, passes=TIE)
    assert "Dense_1" not in v["params"]
    want = Attend().apply(v, IDS)
    np.testing.assert_allclose(Untied().apply(v, IDS, passes=TIE), want, rtol=1e-6)
    given = {"params": {**v["params"], "Dense_1": {"kernel": jnp.full((D_, V_), jnp.nan)}}}
    np.testing.assert_allclose(Untied().apply(given, IDS, passes=TIE), want, rtol=1e-6)
    with pytest.raises(errors.MissingVariableError, match="Dense_1/kernel"):   # untied: needed
        Untied().apply(v, IDS)


def test_tie_of_variables_made_by_vj_variable():
    def tables(x):
        a = vj.variable("consts", "a", jnp.full, (2,), 2.0)
        b = vj.variable("consts", "b", jnp.zeros, (2,))
        return x * a.value + b.value

    tied = vj.functionalize(tables, passes="tie{src=a,dst=b,collection=consts}")
    v = tied.init(KEY, X[0, :2])
    assert v == {"consts": {"a": v["consts"]["a"]}}
    np.testing.assert_allclose(tied.apply(v, X[0, :2]), X[0, :2] * 2 + 2)


@dataclasses.dataclass(frozen=True)
class SuppliesOnly(Pass):
    """Claims a variable and leaves its reads: the call must say the variable is missing."""
    name = "test-supplies-only"

    def supplies(self):
        return frozenset({("params", ("b",))})

    def run(self, jaxpr, ctx):
        return jaxpr


def test_a_supplied_variable_no_pass_replaced_is_missing():
    def f(x):
        return x @ vj.param("b", normal, (3, 4))

    g = vj.functionalize(f, passes=[SuppliesOnly()])
    v = g.init(KEY, X[:1, :3])                 # created in init as usual
    assert jax.tree.map(jnp.shape, v) == {"params": {"b": (3, 4)}}
    np.testing.assert_allclose(g.apply(v, X[:1, :3]), X[:1, :3] @ v["params"]["b"])
    with pytest.raises(errors.MissingVariableError, match="none replaced them") as e:
        g.apply({}, X[:1, :3])
    assert e.value.path == ("b",) and e.value.collection == "params"
    assert "test_pass_library.py" in e.value.source


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(D_)(h)), None


class ScanLM(nn.Module):
    """The untied LM with an nn.scan of blocks that do not touch the tied variables."""
    cls: type = Block

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(V_, D_)(ids)
        h, _ = nn.scan(self.cls, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=2)()(h, None)
        return nn.Dense(V_, use_bias=False)(h)


def test_tie_outside_a_scanned_body_leaves_the_body_alone():
    tie = "tie{src=Embed_0/embedding,dst=Dense_0/kernel}"
    v = ScanLM().init(KEY, IDS, passes=tie)
    assert sorted(v["params"]) == ["Embed_0", "ScanBlock_0"]
    untied = ScanLM().init(KEY, IDS)
    assert_trees_close(v["params"]["ScanBlock_0"], untied["params"]["ScanBlock_0"], rtol=0, atol=0)
    tied_by_hand = {"params": {**v["params"], "Dense_0": {"kernel": v["params"]["Embed_0"]["embedding"].T}}}
    np.testing.assert_allclose(ScanLM().apply(v, IDS, passes=tie),
                               ScanLM().apply(tied_by_hand, IDS), rtol=1e-6)


class TiedBlock(nn.Module):
    """Two square Dense layers per block: the second's kernel is tied to the first's."""
    @nn.compact
    def __call__(self, h, _):
        first = nn.Dense(D_, name="first")
        return jnp.tanh(nn.Dense(D_, use_bias=False, name="second")(first(h))), None


def test_tie_inside_a_scanned_body_ties_each_layer():
    tie = "tie{src=ScanTiedBlock_0/first/kernel,dst=ScanTiedBlock_0/second/kernel,transpose=true}"
    v = ScanLM(TiedBlock).init(KEY, IDS, passes=tie)   # dst is used in the body alone
    block = v["params"]["ScanTiedBlock_0"]
    assert list(block) == ["first"]
    second = {"kernel": jnp.swapaxes(block["first"]["kernel"], 1, 2)}
    by_hand = {"params": {**v["params"], "ScanTiedBlock_0": {**block, "second": second}}}
    np.testing.assert_allclose(ScanLM(TiedBlock).apply(v, IDS, passes=tie),
                               ScanLM(TiedBlock).apply(by_hand, IDS), rtol=1e-6)
    with pytest.raises(errors.MissingVariableError, match="lifted transform that its source"):
        ScanLM(TiedBlock).init(KEY, IDS, passes="tie{src=Embed_0/embedding,"
                                                "dst=ScanTiedBlock_0/second/kernel}")


def test_tie_same_shape_and_forced_transpose():
    def two_tables(x):
        a = vj.param("a", normal, (3, 3))
        b = vj.param("b", normal, (3, 3))
        return x @ a @ b

    x = X[:1]
    plain = vj.functionalize(two_tables)
    for transpose, ref in [("None", lambda a: x @ a @ a), ("false", lambda a: x @ a @ a),
                           ("true", lambda a: x @ a @ a.T)]:
        tied = vj.functionalize(two_tables, passes=f"tie{{src=a,dst=b,transpose={transpose}}}")
        y, v = tied.init_with_output(KEY, x)
        assert list(v["params"]) == ["a"]
        a = plain.init(KEY, x)["params"]["a"]
        np.testing.assert_allclose(y, ref(a), rtol=1e-6)


def test_tie_ir_reads_src_transposed_and_drops_dsts_creation():
    def f(x):
        e = vj.param("e", jax.nn.initializers.ones, (2, 3))
        return x @ e @ vj.param("k", jax.nn.initializers.zeros, (3, 2))

    before, after = run_pass("tie", f, X[:1, :2], rngs={"params": KEY}, src="e", dst="k")
    assert "var_set[params:k]" in str(before)
    assert_ir(after, """
        { lambda ; a:f32[1,2]. let
            _:key<fry>[] = rng_draw[params:#1]
            b:f32[2,3] = broadcast_in_dim 1.0:f32[]
            var_set[params:e] b
            c:f32[2,3] = var_get[params:e]
            d:f32[1,3] = dot_general[
              dimension_numbers=(([1], [0]), ([], []))
              preferred_element_type=float32
            ] a c
            _:key<fry>[] = rng_draw[params:#2]
            _:f32[3,2] = broadcast_in_dim 0.0:f32[]
            e:f32[2,3] = var_get[params:e]
            f:f32[3,2] = transpose[permutation=(1, 0)] e
            g:f32[1,2] = dot_general[
              dimension_numbers=(([1], [0]), ([], []))
              preferred_element_type=float32
            ] d f
          in (g,) }""")


def test_tie_errors_name_the_variable_and_the_users_line():
    def run(spec, fn=Untied().functionalize().fn):
        return vj.functionalize(fn, passes=spec).init(KEY, IDS)

    with pytest.raises(errors.VariableShapeError) as e:   # a [3,4] kernel for a [5,3] table
        run(TIE, Untied(out=4).functionalize().fn)
    assert "Dense_1/kernel (float32[3,4]) cannot be read as Embed_0/embedding (float32[5,3])" \
        in str(e.value)
    assert e.value.path == ("Dense_1", "kernel") and e.value.collection == "params"
    assert "test_pass_library.py" in e.value.source and "Untied.__call__" in e.value.source
    with pytest.raises(errors.VariableShapeError, match="transpose=false needs equal types"):
        run(TIE[:-1] + ",transpose=false}")
    with pytest.raises(errors.MissingVariableError, match="source variable Embed_1/embedding"):
        run("tie{src=Embed_1/embedding,dst=Dense_1/kernel}")
    with pytest.raises(errors.MissingVariableError, match="Dense_2/kernel .* is never read"):
        run("tie{src=Embed_0/embedding,dst=Dense_2/kernel}")
    with pytest.raises(errors.MissingVariableError, match="read before its source") as e:
        run("tie{src=Dense_1/kernel,dst=Embed_0/embedding}")
    assert "test_pass_library.py" in e.value.source
    for spec in ["tie{src=a,dst=a/}", "tie{src=,dst=a}", "tie{dst=a}"]:
        with pytest.raises(errors.PipelineError):
            Pipeline.parse(spec)
    order = Pipeline.parse("fake-quant,stop-gradient{collection=params},cast-params,tie{src=a,dst=b}")
    assert [p.name for p in order.passes][:2] == ["tie", "fake-quant"]
    assert Tie(src="a", dst="b", transpose=True).spec() == \
        "tie{src=a,dst=b,collection=params,transpose=True}"
