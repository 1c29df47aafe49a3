"""The verifier: JAX's checker, varjax's effect invariants, discharge, error layout."""
from __future__ import annotations

import dataclasses

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import pytest

from varjax.errors import VerificationError
from varjax.ir import primitives as prims
from varjax.ir.effects import VariableEffect
from varjax.ir.nested import subjaxprs, walk_eqns
from varjax.passes.framework.base import Pass, PassContext
from varjax.passes.framework.pipeline import Pipeline
from varjax.passes.framework.verify import verify

AVALS = (jax.core.ShapedArray((2,), jnp.float32),)
LEAF = jax.tree.structure(0)
X = jnp.ones(2, jnp.float32)


def read(collection, name):
    (value,) = prims.bind_get(collection, (name,), LEAF, AVALS)
    return value


def write(collection, name, value):
    prims.bind_set(collection, (name,), [value], LEAF)


def model(x):
    """A read at top level, a read+write inside scan, a read in cond's false branch
    (branch #0: cond lists branches by index), a draw."""
    w = read("params", "w")

    def body(c, _):
        write("stats", "m", read("stats", "m") + c)
        return c + 1.0, None

    c, _ = jax.lax.scan(body, x, None, length=2)
    y = jax.lax.cond(x[0] > 0, lambda: w, lambda: read("params", "b"))
    prims.bind_draw("dropout", jax.typeof(jax.random.key(0)))
    return c * y


def traced(fn=model):
    return jax.make_jaxpr(fn)(X)


def find(jaxpr, primitive_name):
    return next(i for i, e in enumerate(jaxpr.jaxpr.eqns) if e.primitive.name == primitive_name)


def with_eqn_effects(jaxpr, index, effects):
    eqns = list(jaxpr.jaxpr.eqns)
    eqns[index] = eqns[index].replace(effects=frozenset(effects))
    return jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(eqns=eqns))


def test_valid_effectful_jaxpr_passes():
    jaxpr = traced()
    verify(jaxpr)
    verify(jaxpr, known_collections={"params", "stats"})
    verify(jax.make_jaxpr(lambda x: x * 2)(X), discharged=True)


def test_effect_missing_from_enclosing_jaxpr():
    jaxpr = traced()
    broken = jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(effects=frozenset()))
    with pytest.raises(VerificationError) as excinfo:
        verify(broken)
    message = str(excinfo.value)
    assert "equation effects {Var[params]} are missing from the effects of the jaxpr" in message
    assert "--> " in message and "var_get[params:w]" in message.split("--> ")[1].splitlines()[0]
    assert "in equation:" in message and "at:" in message


def test_sub_jaxpr_effect_missing_from_its_equation():
    jaxpr = traced()
    broken = with_eqn_effects(jaxpr, find(jaxpr, "scan"), ())
    with pytest.raises(VerificationError, match=r"sub-jaxpr #0 of `scan` has effects "
                                                r"\{Var\[stats\]\} that the equation lacks"):
        verify(broken)


def test_cond_branch_effect_missing_from_its_equation():
    jaxpr = traced()
    broken = with_eqn_effects(jaxpr, find(jaxpr, "cond"), ())
    with pytest.raises(VerificationError, match=r"sub-jaxpr #0 of `cond` has effects "
                                                r"\{Var\[params\]\}"):
        verify(broken)


def test_unknown_collection_is_named():
    with pytest.raises(VerificationError, match=r"unknown collection 'stats' \(known: params\)"
                       ) as excinfo:
        verify(traced(), known_collections={"params"})
    assert excinfo.value.collection == "stats"


def test_unknown_collection_only_on_jaxpr_header():
    jaxpr = jax.make_jaxpr(lambda x: x * 2)(X)
    odd = jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(effects={VariableEffect("ghost")}))
    verify(odd)
    with pytest.raises(VerificationError, match="jaxpr effects name unknown collection 'ghost'"):
        verify(odd, known_collections={"params"})


def test_leftover_var_get_after_discharge():
    jaxpr = jax.make_jaxpr(lambda x: x * read("params", "w"))(X)
    verify(jaxpr)
    with pytest.raises(VerificationError, match="var_get remains after a discharging pass"
                       ) as excinfo:
        verify(jaxpr, discharged=True)
    assert excinfo.value.collection == "params"


def test_leftover_nested_effect_after_discharge():
    def fn(x):
        return jax.lax.scan(lambda c, _: (c + read("stats", "m"), None), x, None, length=2)[0]

    with pytest.raises(VerificationError, match=r"effects \{Var\[stats\]\} remain after a "
                                                r"discharging pass"):
        verify(traced(fn), discharged=True)


def test_leftover_effect_on_jaxpr_header_after_discharge():
    jaxpr = jax.make_jaxpr(lambda x: x * 2)(X)
    odd = jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(effects={VariableEffect("params")}))
    with pytest.raises(VerificationError, match=r"effects \{Var\[params\]\} remain on the jaxpr"):
        verify(odd, discharged=True)


def test_jax_type_errors_are_verification_errors():
    jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(X)
    broken = jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(eqns=jaxpr.jaxpr.eqns[1:]))
    with pytest.raises(VerificationError, match="JAX's type check failed") as excinfo:
        verify(broken)
    assert isinstance(excinfo.value.__cause__, jex.JaxprTypeError)


def test_window_shows_ten_equations_each_side_of_the_bad_one():
    def long(x):
        for i in range(15):
            x = x + float(i + 100)
        x = x * read("params", "w")
        for i in range(15):
            x = x + float(i + 200)
        return x

    jaxpr = traced(long)
    broken = jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(effects=frozenset()))
    message = str(pytest.raises(VerificationError, verify, broken).value)
    window = message.split("while checking jaxpr:\n")[1]
    assert "104.0" not in window and "105.0" in window   # 10 equations before var_get
    assert "208.0" in window and "209.0" not in window   # var_get, mul, then 9 more
    assert window.count("    ...") == 2
    assert window.count("--> ") == 1


# --- in a pipeline -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StripEffects(Pass):
    """A buggy pass: drops the jaxpr's effects."""
    name = "tv-strip-effects"

    def run(self, jaxpr, ctx):
        return jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(effects=frozenset()))


@dataclasses.dataclass(frozen=True)
class FakeDischarge(Pass):
    """Claims to discharge but changes nothing."""
    name = "tv-fake-discharge"
    discharges = True

    def run(self, jaxpr, ctx):
        return jaxpr


@dataclasses.dataclass(frozen=True)
class Noop(Pass):
    name = "tv-noop"

    def run(self, jaxpr, ctx):
        return jaxpr


def open_context():
    """A context in which any collection may exist: these tests are about other checks."""
    return PassContext(mutable=True)


def test_pipeline_blames_the_pass_that_broke_the_ir():
    with pytest.raises(VerificationError, match=r"invalid IR after pass 'tv-strip-effects'"
                       r"(.|\n)*fix: .*pass 'tv-strip-effects' produced this IR"):
        Pipeline.parse("tv-noop,tv-strip-effects,tv-noop").run(traced(), open_context())


def test_pipeline_catches_var_get_left_by_a_discharging_pass():
    with pytest.raises(VerificationError, match=r"after pass 'tv-fake-discharge': "
                                                r"var_get remains"):
        Pipeline.parse("tv-noop,tv-fake-discharge").run(traced(), open_context())


def test_pipeline_verifies_its_input():
    jaxpr = traced()
    broken = jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(effects=frozenset()))
    with pytest.raises(VerificationError, match="invalid IR in the pipeline input"):
        Pipeline.parse("tv-noop").run(broken, open_context())


def test_verify_false_skips_verification():
    out = Pipeline.parse("tv-strip-effects", verify=False).run(traced(), open_context())
    assert not out.effects


# --- walking -------------------------------------------------------------------------

def test_subjaxprs_finds_closed_open_and_tuple_params():
    jaxpr = traced()
    eqns = jaxpr.jaxpr.eqns
    assert len(subjaxprs(eqns[find(jaxpr, "cond")])) == 2
    assert [type(j) for j in subjaxprs(eqns[find(jaxpr, "scan")])] == [jex.ClosedJaxpr]
    remat = jax.make_jaxpr(jax.checkpoint(lambda x: x * read("params", "w")))(X)
    assert [type(j) for j in subjaxprs(remat.jaxpr.eqns[0])] == [jex.Jaxpr]
    assert subjaxprs(eqns[0]) == []


def test_walk_eqns_is_preorder_with_holders():
    jaxpr = traced()
    seen = [(e.primitive.name, holder) for e, holder in walk_eqns(jaxpr)]
    names = [n for n, _ in seen]
    scan_at, set_at = names.index("scan"), names.index("var_set")
    assert scan_at < set_at
    body = subjaxprs(jaxpr.jaxpr.eqns[find(jaxpr, "scan")])[0].jaxpr
    assert seen[set_at][1] is body
    assert seen[scan_at][1] is jaxpr.jaxpr
    assert names.count("var_get") == 3


def test_pipeline_verifies_collections_the_context_knows():
    """A misspelt collection fails at the pipeline input, from the known collections of
    the context (given variables and named mutable ones)."""
    def misspelt(x):
        write("stats", "m", read("parms", "w") + x)   # "parms": a typo of "params"
        return x

    types = {("params", ("w",)): prims.VarType(LEAF, AVALS)}
    ctx = PassContext.for_inputs(types, mutable=["stats"])
    assert ctx.known_collections() == {"params", "stats"}
    with pytest.raises(VerificationError, match=r"pipeline input: unknown collection 'parms' "
                                                r"\(known: params, stats\)") as info:
        Pipeline.parse("tv-noop").run(traced(misspelt), ctx)
    assert info.value.collection == "parms"


def test_known_collections_follow_the_mutable_filter():
    from varjax.ir.filters import DenyList
    types = {("params", ("w",)): prims.VarType(LEAF, AVALS)}
    assert PassContext.for_inputs(types).known_collections() == {"params"}
    assert PassContext.for_inputs(types, mutable="stats").known_collections() == {"params", "stats"}
    assert PassContext.for_inputs(types, mutable=True).known_collections() is None
    assert PassContext.for_inputs(types, mutable=DenyList("params")).known_collections() is None
    assert PassContext.for_inputs(types, mutable=("a", DenyList("b"))).known_collections() is None
    # An explicit RNG key is a variable of varjax's own collection: always allowed, not listed.
    key = jax.typeof(jax.random.key(0))
    ctx = PassContext.for_inputs(types, rng_streams={"dropout": key})
    assert ctx.known_collections() == {"params", "__rng__"} and ctx.rng_streams == {"dropout": key}
    assert ctx.variables[("__rng__", ("dropout",))] == prims.VarType(LEAF, (key,))
    Pipeline.parse("tv-noop").run(traced(lambda x: read("params", "w")), ctx)   # verifies
