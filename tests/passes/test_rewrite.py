"""The rewriter: rules that decline, the note naming the equation an error came from."""
from __future__ import annotations

import dataclasses

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import pytest

from varjax import errors
from varjax.ir import primitives as prims
from varjax.passes import Pass, PassContext, Pipeline, Recorder, Region, Rewriter, Rule
from varjax.passes.framework.rewrite import NOTE_PREFIX
from varjax.passes.library.cast_params import CastRead

X = jnp.ones(2, jnp.float32)
SIN = jax.lax.sin_p


def f(x):
    y = jnp.sin(x)

    def body(c, _):
        return jnp.sin(c), None

    c, _ = jax.lax.scan(body, y, None, length=2)
    return c


class ToCos(Rule):
    """``sin`` becomes ``cos``, except where ``declines`` says no."""

    primitive = SIN

    def __init__(self, declines=lambda eqn: False):
        self.declines = declines
        self.seen = 0

    def rewrite(self, eqn, invals, region: Region):
        self.seen += 1
        return None if self.declines(eqn) else [jnp.cos(*invals)]


def names(jaxpr):
    from varjax.ir.nested import walk_eqns
    return [e.primitive.name for e, _ in walk_eqns(jaxpr)]


def test_a_rule_that_declines_every_match_changes_nothing():
    jaxpr = jax.make_jaxpr(f)(X)
    rule = ToCos(declines=lambda eqn: True)
    assert Rewriter([rule]).run(jaxpr) is jaxpr
    assert rule.seen == 2          # both matches were offered, the nested one too


def test_a_declined_equation_is_kept_and_the_others_rewritten():
    jaxpr = jax.make_jaxpr(f)(X)
    top = jaxpr.jaxpr.eqns[0]
    out = Rewriter([ToCos(declines=lambda eqn: eqn is top)]).run(jaxpr)
    assert out is not jaxpr
    assert names(out) == ["sin", "scan", "cos"]
    assert jnp.allclose(jex.jaxpr_as_fun(out)(X)[0], jnp.cos(jnp.cos(jnp.sin(X))))


class LocalRewriter(Rewriter):
    local = True


def test_a_splicing_rewriter_keeps_declined_equations():
    jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * jnp.sin(x + 1.0))(X)
    first = jaxpr.jaxpr.eqns[0]
    assert LocalRewriter([ToCos(declines=lambda eqn: True)]).run(jaxpr) is jaxpr
    out = LocalRewriter([ToCos(declines=lambda eqn: eqn is first)]).run(jaxpr)
    assert names(out) == ["sin", "add", "cos", "mul"]
    assert out.jaxpr.eqns[0] is first


def test_a_splicing_rewriter_leaves_out_a_pure_replacement_nothing_reads():
    def g(x):
        jnp.sin(x)                       # result unused
        return jnp.sin(x + 1.0)
    jaxpr = jax.make_jaxpr(g)(X)
    out = LocalRewriter([ToCos()]).run(jaxpr)
    assert names(out) == ["add", "cos"]
    assert jnp.allclose(jex.jaxpr_as_fun(out)(X)[0], jnp.cos(X + 1.0))


def test_a_splicing_rewriter_keeps_an_effectful_replacement_nothing_reads():
    class ToWrite(Rule):
        primitive = SIN

        def rewrite(self, eqn, invals, region):
            prims.bind_set("params", ("w",), invals, jax.tree.structure(0))
            return [jnp.cos(*invals)]
    jaxpr = jax.make_jaxpr(lambda x: [jnp.sin(x), x][1])(X)
    assert names(LocalRewriter([ToWrite()]).run(jaxpr)) == ["var_set", "cos"]


@dataclasses.dataclass(frozen=True)
class DecliningPass(Pass):
    name = "trw-declining"

    def run(self, jaxpr, ctx):
        return Rewriter([ToCos(declines=lambda eqn: True)]).run(jaxpr)


def test_a_declining_pass_is_reported_unchanged():
    recorder = Recorder()
    Pipeline.parse("trw-declining", instrumentations=[recorder]).run(
        jax.make_jaxpr(f)(X), PassContext())
    assert recorder.entries[1][1].startswith("// after trw-declining (unchanged)")


class Crash(Rule):
    primitive = SIN

    def rewrite(self, eqn, invals, region):
        raise ValueError("rule bug")


def _notes(exc):
    return [n for n in getattr(exc, "__notes__", ()) if n.startswith(NOTE_PREFIX)]


def test_an_error_in_a_rule_names_the_innermost_equation_and_its_line():
    def g(x):
        return jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]

    with pytest.raises(ValueError, match="rule bug") as info:
        Rewriter([Crash()]).run(jax.make_jaxpr(g)(X))
    (note,) = _notes(info.value)       # once, for the sin inside the scan body
    assert note.startswith(f"{NOTE_PREFIX}`sin(f32[2]) -> (f32[2])` at ")
    assert "test_rewrite.py:" in note and note.endswith("g.<locals>.<lambda>)")


def test_an_error_rebinding_an_equation_names_it():
    """The notes/writing-passes.md example: casting a read makes ``mul`` mix dtypes."""
    def scale(x):
        (w,) = prims.bind_get("params", ("w",), jax.tree.structure(0), (jax.typeof(X),))
        return x * w

    with pytest.raises(TypeError, match="lax.mul requires") as info:
        Rewriter([CastRead(jnp.dtype("bfloat16"))]).run(jax.make_jaxpr(scale)(X))
    (note,) = _notes(info.value)
    assert note.startswith(f"{NOTE_PREFIX}`mul(f32[2], f32[2]) -> (f32[2])` at ")
    assert "test_rewrite.py:" in note and note.endswith(".scale)")


@dataclasses.dataclass(frozen=True)
class Crashing(Pass):
    name = "trw-crashing"

    def run(self, jaxpr, ctx):
        return Rewriter([Crash()]).run(jaxpr)


def test_a_pass_error_carries_the_note():
    with pytest.raises(errors.PassError, match=r"ValueError: rule bug\n"
                                               + NOTE_PREFIX + r"`sin\(f32\[2\]\) -> \(f32\[2\]\)`"):
        Pipeline.parse("trw-crashing").run(jax.make_jaxpr(f)(X), PassContext())


class UserMistake(Rule):
    primitive = SIN

    def rewrite(self, eqn, invals, region):
        raise errors.TransformError("the user's mistake", source="model.py:1")


def test_varjax_errors_get_no_note():
    with pytest.raises(errors.TransformError) as info:
        Rewriter([UserMistake()]).run(jax.make_jaxpr(f)(X))
    assert not _notes(info.value)
