"""Pipeline strings, ordering, hooks and error wrapping."""
from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

from varjax.errors import ImmutableCollectionError, PassError, PipelineError
from varjax.passes.framework.base import Pass, PassContext
from varjax.passes.framework.instrument import Instrumentation, Timing
from varjax.passes.framework.pipeline import Pipeline


def _pure_jaxpr():
    return jax.make_jaxpr(lambda x: x + 1.0)(jnp.ones(2, jnp.float32))


def _doubled(jaxpr):
    """A new jaxpr computing twice ``jaxpr``'s outputs."""
    fun = jex.jaxpr_as_fun(jaxpr)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.jaxpr.invars]
    return jax.make_jaxpr(lambda *xs: [2 * o for o in fun(*xs)])(*avals)


@dataclasses.dataclass(frozen=True)
class Opts(Pass):
    name = "tp-opts"
    n: int = 1
    scale: float = 1.0
    flag: bool = False
    dtype: jnp.dtype = jnp.dtype("float32")
    mode: Literal["fast", "slow"] = "fast"
    limit: Optional[int] = None
    tag: str = "x"
    accum: jax.typing.DTypeLike | None = None

    def run(self, jaxpr, ctx):
        return jaxpr


@dataclasses.dataclass(frozen=True)
class Needs(Pass):
    name = "tp-needs"
    level: int = 0

    def run(self, jaxpr, ctx):
        return jaxpr


@dataclasses.dataclass(frozen=True)
class WantsNeeds(Pass):
    name = "tp-wants-needs"
    requires = ("tp-needs",)

    def run(self, jaxpr, ctx):
        return jaxpr


@dataclasses.dataclass(frozen=True)
class Base(Pass):
    name = "tp-base"

    def run(self, jaxpr, ctx):
        return jaxpr


@dataclasses.dataclass(frozen=True)
class Mid(Pass):
    name = "tp-mid"
    requires = ("tp-base",)

    def run(self, jaxpr, ctx):
        return jaxpr


@dataclasses.dataclass(frozen=True)
class Top(Pass):
    name = "tp-top"
    requires = ("tp-mid",)

    def run(self, jaxpr, ctx):
        return jaxpr


@dataclasses.dataclass(frozen=True)
class RequiresConfigured(Pass):
    name = "tp-requires-configured"
    requires = ("tp-must-configure",)


@dataclasses.dataclass(frozen=True)
class MustConfigure(Pass):
    name = "tp-must-configure"
    size: int


@dataclasses.dataclass(frozen=True)
class Late(Pass):
    name = "tp-late"
    after = ("tp-early",)

    def run(self, jaxpr, ctx):
        return jaxpr


@dataclasses.dataclass(frozen=True)
class Early(Pass):
    name = "tp-early"

    def run(self, jaxpr, ctx):
        return jaxpr


@dataclasses.dataclass(frozen=True)
class First(Pass):
    name = "tp-first"
    before = ("tp-early",)

    def run(self, jaxpr, ctx):
        return jaxpr


@dataclasses.dataclass(frozen=True)
class CycleA(Pass):
    name = "tp-cycle-a"
    before = ("tp-cycle-b",)


@dataclasses.dataclass(frozen=True)
class CycleB(Pass):
    name = "tp-cycle-b"
    before = ("tp-cycle-a",)


@dataclasses.dataclass(frozen=True)
class Double(Pass):
    name = "tp-double"

    def run(self, jaxpr, ctx):
        ctx.count(self.name, "rewrites")
        return _doubled(jaxpr)


@dataclasses.dataclass(frozen=True)
class Boom(Pass):
    name = "tp-boom"

    def run(self, jaxpr, ctx):
        raise RuntimeError("kaboom")


USER_ERROR = ImmutableCollectionError("write to immutable collection", collection="params")


@dataclasses.dataclass(frozen=True)
class UserError(Pass):
    name = "tp-user-error"

    def run(self, jaxpr, ctx):
        raise USER_ERROR


@dataclasses.dataclass(frozen=True)
class ReturnsNone(Pass):
    name = "tp-returns-none"

    def run(self, jaxpr, ctx):
        return None


def names(pipeline):
    return [p.name for p in pipeline.passes]


class Log(Instrumentation):
    def __init__(self):
        self.events = []

    def before_pipeline(self, jaxpr, ctx):
        self.events.append("start")

    def before_pass(self, p, jaxpr, ctx):
        self.events.append(f"before {p.name}")

    def after_pass(self, p, before, after, ctx):
        self.events.append(f"after {p.name} {'same' if after is before else 'new'}")

    def pass_failed(self, p, jaxpr, exc, ctx):
        self.events.append(f"failed {p.name} {type(exc).__name__}")

    def after_pipeline(self, jaxpr, ctx):
        self.events.append("end")


# --- strings and options -------------------------------------------------------------

def test_parse_converts_each_option_by_its_annotation():
    (p,) = Pipeline.parse(
        "tp-opts{n=3, scale=0.5, flag=true, dtype=bfloat16, mode=slow, limit=7, tag=y}").passes
    assert p == Opts(n=3, scale=0.5, flag=True, dtype=jnp.dtype("bfloat16"), mode="slow",
                     limit=7, tag="y")
    assert isinstance(p.n, int) and isinstance(p.scale, float) and p.flag is True
    assert isinstance(p.dtype, np.dtype)  # a str would compare equal to the dtype
    assert Pipeline.parse("tp-opts{limit=None}").passes[0].limit is None
    # DTypeLike is a union listing str first; the text still becomes a dtype.
    accum = Pipeline.parse("tp-opts{accum=bfloat16}").passes[0].accum
    assert isinstance(accum, np.dtype) and accum == jnp.dtype("bfloat16")


def test_str_round_trips():
    pipeline = Pipeline.parse("tp-opts{dtype=bfloat16,flag=true,limit=4},tp-early")
    text = str(pipeline)
    assert text == ("tp-opts{n=1,scale=1.0,flag=True,dtype=bfloat16,mode=fast,limit=4,tag=x,"
                    "accum=None},tp-early")
    assert Pipeline.parse(text).passes == pipeline.passes
    assert str(Pipeline.parse(text)) == text


def test_entries_mix_instances_and_strings():
    pipeline = Pipeline([Opts(n=2), "tp-early, tp-base"])
    assert pipeline.passes == (Opts(n=2), Early(), Base())
    assert Pipeline.parse("").passes == ()


def test_unknown_option_names_pass_and_valid_options():
    with pytest.raises(PipelineError, match=r"'tp-opts' has no option 'bogus'(.|\n)*"
                                            r"valid options: n, scale, flag, dtype, mode"):
        Pipeline.parse("tp-opts{bogus=1}")


@pytest.mark.parametrize("spec, option", [
    ("tp-opts{n=1.5}", "n"), ("tp-opts{flag=maybe}", "flag"),
    ("tp-opts{dtype=notadtype}", "dtype"), ("tp-opts{mode=medium}", "mode"),
    ("tp-opts{limit=lots}", "limit"),
])
def test_bad_option_value_names_pass_and_option(spec, option):
    with pytest.raises(PipelineError, match=rf"'tp-opts': bad value .* option '{option}'"):
        Pipeline.parse(spec)


@pytest.mark.parametrize("text, message", [
    ("tp-opts{n=1", "unclosed"), ("tp-opts{n=1}}", "unbalanced"),
    ("tp-opts{n}", "not key=value"), ("tp-opts{n=1,n=2}", "given twice"),
    ("tp-early,,tp-base", "cannot parse"), ("tp-early tp-base", "cannot parse"),
])
def test_malformed_pipeline_strings(text, message):
    with pytest.raises(PipelineError, match=message):
        Pipeline.parse(text)


def test_missing_required_option():
    with pytest.raises(PipelineError, match=r"'tp-must-configure' needs option\(s\) size"):
        Pipeline.parse("tp-must-configure")
    assert Pipeline.parse("tp-must-configure{size=3}").passes == (MustConfigure(3),)


def test_non_pass_entry_rejected():
    with pytest.raises(PipelineError, match="Pass instances or pipeline strings"):
        Pipeline([Early])


def test_unknown_pass_lists_registered_ones():
    with pytest.raises(PipelineError, match=r"unknown pass 'tp-nope'.*tp-early.*tp-opts"):
        Pipeline.parse("tp-early,tp-nope")


# --- ordering ------------------------------------------------------------------------

def test_requires_are_inserted_transitively_before_their_requirer():
    assert names(Pipeline.parse("tp-early,tp-top")) == ["tp-early", "tp-base", "tp-mid", "tp-top"]


def test_requires_move_a_present_pass_earlier_and_keep_its_options():
    assert Pipeline([WantsNeeds(), Needs(level=3)]).passes == (Needs(level=3), WantsNeeds())


def test_inserted_requirement_needing_options_says_why():
    with pytest.raises(PipelineError, match="needs option.*required by 'tp-requires-configured'"):
        Pipeline.parse("tp-requires-configured")


def test_after_and_before_order_only_present_passes():
    assert names(Pipeline.parse("tp-late")) == ["tp-late"]
    assert names(Pipeline.parse("tp-late,tp-early")) == ["tp-early", "tp-late"]
    assert names(Pipeline.parse("tp-early,tp-first")) == ["tp-first", "tp-early"]


def test_unconstrained_passes_keep_the_written_order():
    order = ["tp-double", "tp-opts", "tp-base", "tp-early", "tp-boom"]
    assert names(Pipeline.parse(",".join(order))) == order
    assert names(Pipeline.parse(",".join(reversed(order)))) == order[::-1]
    # A constraint moves only what it must: tp-late jumps behind tp-early, the rest stay put.
    assert names(Pipeline.parse("tp-base,tp-late,tp-opts,tp-early,tp-double")) == [
        "tp-base", "tp-opts", "tp-early", "tp-late", "tp-double"]


def test_cycle_error_names_the_passes_in_it():
    with pytest.raises(PipelineError, match=r"cycle: tp-cycle-(a|b) -> tp-cycle-(a|b) -> "
                                            r"tp-cycle-(a|b) \(tp-cycle-. before tp-cycle-."):
        Pipeline.parse("tp-early,tp-cycle-a,tp-cycle-b")


# --- running -------------------------------------------------------------------------

def test_run_applies_passes_in_order_and_calls_hooks():
    log = Log()
    pipeline = Pipeline.parse("tp-double,tp-early,tp-double", instrumentations=[log])
    ctx = PassContext()
    out = pipeline.run(_pure_jaxpr(), ctx)
    np.testing.assert_allclose(jex.jaxpr_as_fun(out)(jnp.ones(2, jnp.float32))[0], [8.0, 8.0])
    assert log.events == [
        "start",
        "before tp-double", "after tp-double new",
        "before tp-early", "after tp-early same",
        "before tp-double", "after tp-double new",
        "end"]
    assert ctx.stats["tp-double.rewrites"] == 2
    assert ctx.results["pipeline"] == "tp-double,tp-early,tp-double"


def test_after_hooks_run_in_reverse_order():
    events = []

    class Named(Instrumentation):
        def __init__(self, tag):
            self.tag = tag

        def before_pass(self, p, jaxpr, ctx):
            events.append(f"before {self.tag}")

        def after_pass(self, p, before, after, ctx):
            events.append(f"after {self.tag}")

    Pipeline.parse("tp-early", instrumentations=[Named(1), Named(2)]).run(
        _pure_jaxpr(), PassContext())
    assert events == ["before 1", "before 2", "after 2", "after 1"]


def test_timing_records_every_pass():
    pipeline = Pipeline.parse("tp-double,tp-early")
    pipeline.run(_pure_jaxpr(), PassContext())
    assert list(pipeline.last_timings) == ["tp-double", "tp-early"]
    assert all(isinstance(s, float) and s >= 0 for s in pipeline.last_timings.values())
    timing = Timing()
    Pipeline.parse("tp-double,tp-double", instrumentations=[timing]).run(
        _pure_jaxpr(), PassContext())
    assert list(timing.seconds) == ["tp-double"]


def test_crashing_pass_becomes_pass_error_naming_it_and_earlier_passes():
    log = Log()
    pipeline = Pipeline.parse("tp-double,tp-opts{n=2},tp-boom,tp-early", instrumentations=[log])
    with pytest.raises(PassError, match=r"pass 'tp-boom' failed after passes "
                                        r"\[tp-double, tp-opts\{n=2,.*\}\]: RuntimeError: kaboom"
                       ) as excinfo:
        pipeline.run(_pure_jaxpr(), PassContext())
    assert isinstance(excinfo.value.__cause__, RuntimeError)
    assert log.events[-2:] == ["before tp-boom", "failed tp-boom RuntimeError"]
    assert "tp-boom" in pipeline.last_timings


def test_pass_returning_a_non_jaxpr_is_a_pass_error():
    with pytest.raises(PassError, match="'tp-returns-none' failed.*returned NoneType"):
        Pipeline.parse("tp-returns-none").run(_pure_jaxpr(), PassContext())


def test_varjax_errors_pass_through_unchanged_after_failure_hooks():
    log = Log()
    pipeline = Pipeline.parse("tp-early,tp-user-error", instrumentations=[log])
    with pytest.raises(ImmutableCollectionError) as excinfo:
        pipeline.run(_pure_jaxpr(), PassContext())
    assert excinfo.value is USER_ERROR
    assert log.events[-1] == "failed tp-user-error ImmutableCollectionError"
