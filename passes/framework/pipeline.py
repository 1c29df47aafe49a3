"""Pipelines: ordered passes, run with verification, dumps and timing.

A pipeline is text, ``"lower-rng,forward-stores,cast-params{dtype=bfloat16}"``,
and ``str(pipeline)`` gives that text back with every option spelled out, so
one log line reproduces a run.  Option values are parsed into the pass's
dataclass fields by their annotations.

Order comes from the passes' declarations, not from where the user happened
to write them: ``requires`` adds missing passes (with default options) and
runs them first, ``after``/``before`` order passes that are both present.
Among passes nothing constrains, the written order is kept, so the result is
deterministic and unsurprising.

Everything that watches a run (verification, IR dumps, timing, your own
counters) is an ``Instrumentation`` (``instrument.py``): one hook list, as in
MLIR's pass manager.  ``before_*`` hooks run in list order and
``after_*``/``pass_failed`` hooks in reverse, so instrumentations nest: timing,
listed last, measures only the pass; the dump, listed before the verifier, writes
a broken IR before the verifier rejects it.  The verifier is given the
collections the context knows (``PassContext.known_collections``), so a
misspelt collection fails at the pipeline input.

Sharp edges:
  * Option values cannot contain ``,``, ``{``, ``}`` or ``=``.
  * Constraints name passes, not instances: if a pass appears twice, every
    copy of it is ordered by the constraints, which may move one copy.
  * A pass that raises a ``VarjaxError`` is trusted to be reporting the user's
    mistake, so the error reaches the user unwrapped; any other exception is a
    pass bug and becomes a ``PassError``.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import types
import typing
from typing import Any, Iterable, Sequence, Union

import jax.numpy as jnp
import networkx as nx
import numpy as np
from typing_extensions import TypeAliasType

from varjax import _jax
from varjax.ir.errors import PassError, PipelineError, VarjaxError, source_text
from varjax.passes.framework.base import Pass, PassContext, get_pass
from varjax.passes.framework.dump import Dump
from varjax.passes.framework.instrument import (
    DUMP_AFTER_ENV,
    DUMP_CHANGED_ENV,
    DUMP_DIR_ENV,
    Instrumentation,
    Timing,
)
from varjax.passes.framework.verify import Verify
from varjax.trace.pass_scopes import CreateOutside


class Pipeline:
    """An ordered, verified sequence of passes; see the module docstring.

    ``passes`` entries are ``Pass`` instances or pipeline strings.  The
    resolved order is ``self.passes``.  Dumps go to ``dump_dir``, else to
    ``$VARJAX_DUMP_DIR`` read at each run, else nowhere.  ``dump_after`` (else
    ``$VARJAX_DUMP_AFTER``, comma-separated) names the passes whose output is
    dumped, every pass when None; ``dump_only_changed`` (else
    ``$VARJAX_DUMP_ONLY_CHANGED``) skips passes that changed nothing.  A large model's
    full dump is dozens of near-identical files; these pick the few worth reading.
    """

    def __init__(self, passes: Sequence[Pass | str], *, verify: bool = True,
                 dump_dir: str | os.PathLike | None = None,
                 dump_after: str | Sequence[str] | None = None, dump_only_changed: bool | None = None,
                 instrumentations: Sequence[Instrumentation] = ()):
        self.passes: tuple[Pass, ...] = _ordered(parse_entries(passes))
        self.verify = verify
        self.dump_dir = dump_dir
        self.dump_after = _known_passes(dump_after)
        self.dump_only_changed = dump_only_changed
        self.instrumentations = tuple(instrumentations)
        self.last_timings: dict[str, float] = {}

    @classmethod
    def parse(cls, text: str, **kwargs: Any) -> "Pipeline":
        """``Pipeline.parse("a,b{opt=1}", verify=False)``; keywords go to the constructor."""
        return cls([text], **kwargs)

    def __str__(self) -> str:
        return ",".join(p.spec() for p in self.passes)

    def __repr__(self) -> str:
        return f"Pipeline({str(self)!r})"

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext, *,
            label: str | None = None) -> _jax.ClosedJaxpr:
        """Run every pass in order and return the final jaxpr.

        Records ``ctx.results['pipeline']`` (this pipeline's text),
        ``ctx.results['input']`` (the jaxpr it was given, as traced: discharge reads
        custom rules' closures off it) and, if given, ``ctx.results['label']`` (names
        the dump directory), so that instrumentations and later readers of ``ctx``
        know what produced it.
        Seconds per pass land in ``self.last_timings``, also after a failure.
        """
        ctx.results["pipeline"] = str(self)
        ctx.results["input"] = jaxpr
        if label is not None:
            ctx.results["label"] = label
        timing = Timing()
        hooks = [*self._builtin_instrumentations(ctx), *self.instrumentations, timing]
        try:
            return self._run(jaxpr, ctx, hooks)
        finally:
            self.last_timings = timing.seconds

    def _builtin_instrumentations(self, ctx: PassContext) -> list[Instrumentation]:
        verify = [Verify(known_collections=ctx.known_collections())] if self.verify else []
        dump_dir = self.dump_dir or os.environ.get(DUMP_DIR_ENV) or None
        if dump_dir is None or any(isinstance(h, Dump) for h in self.instrumentations):
            return verify   # an explicit Dump (vj.dump(to=...)) replaces the default one
        after = self.dump_after
        if after is None and os.environ.get(DUMP_AFTER_ENV, "").strip():
            after = _known_passes(os.environ[DUMP_AFTER_ENV])
        changed = self.dump_only_changed
        if changed is None:
            changed = os.environ.get(DUMP_CHANGED_ENV, "0") not in ("", "0")
        return verify + [Dump(dump_dir, dump_after=after, only_changed=changed)]

    def _run(self, jaxpr, ctx, hooks: list[Instrumentation]) -> _jax.ClosedJaxpr:
        for h in hooks:
            h.before_pipeline(jaxpr, ctx)
        done: list[str] = []
        lowered: dict[type, Pass] = {}     # effect class -> the pass that lowered it
        for p in self.passes:
            for h in hooks:
                h.before_pass(p, jaxpr, ctx)
            try:
                out = p.run(jaxpr, ctx)
                if not isinstance(out, _jax.ClosedJaxpr):
                    raise TypeError(f"run() returned {type(out).__name__}, not a ClosedJaxpr")
                if out is not jaxpr:
                    _check_not_lowered(p, jaxpr, out, lowered)
            except Exception as exc:
                for h in reversed(hooks):
                    h.pass_failed(p, jaxpr, exc, ctx)
                if isinstance(exc, (VarjaxError, CreateOutside)):  # CreateOutside: for the lift
                    raise
                # Notes (the Rewriter's "while rewriting <equation>") name the culprit.
                notes = "".join(f"\n{n}" for n in getattr(exc, "__notes__", ()))
                raise PassError(
                    f"pass '{p.spec()}' failed after passes [{', '.join(done)}]: "
                    f"{type(exc).__name__}: {exc}{notes}", source=source_text(),
                    fix=f"this is a bug in the pass; set {DUMP_DIR_ENV}=<dir> to dump "
                        "the IR it was given") from exc
            for h in reversed(hooks):
                h.after_pass(p, jaxpr, out, ctx)
            done.append(p.spec())
            lowered.update((effect, p) for effect in p.lowers)
            jaxpr = out
        for h in reversed(hooks):
            h.after_pipeline(jaxpr, ctx)
        return jaxpr


def parse_entries(entries: str | Sequence[Pass | str] | None) -> tuple[Pass, ...]:
    """``Pass`` instances and pipeline strings as instances, in written order (not yet
    ordered: ``Pipeline`` does that); None is no pass."""
    given: list[Pass] = []
    for entry in [entries] if isinstance(entries, str) else entries or ():
        if isinstance(entry, str):
            given.extend(_parse(entry))
        elif isinstance(entry, Pass):
            given.append(entry)
        else:
            raise PipelineError(
                f"pipeline entries are Pass instances or pipeline strings, got {entry!r}",
                source=source_text(),
                fix="pass Pass instances (e.g. vj.passes.LowerRng()) or strings such as "
                    "'lower-rng,discharge'")
    return tuple(given)


def _check_not_lowered(p: Pass, before: _jax.ClosedJaxpr, out: _jax.ClosedJaxpr,
                       lowered: dict[type, Pass]) -> None:
    """A pass that emits an effect an earlier pass lowered (a draw after ``lower-rng``)
    leaves it to nothing; JAX would later refuse it naming no pass.  Say which pass must
    come first instead.  Only effects the pass added count: an untouched branch may keep
    the effect set its ``cond`` joined before the lowering."""
    for effect in out.effects - before.effects:
        earlier = lowered.get(type(effect))
        if earlier is not None:
            raise PipelineError(
                f"pass '{p.spec()}' emits {effect} after pass '{earlier.name}' lowered "
                f"those effects, so nothing would lower it.", source=source_text(),
                fix=f"declare before = ('{earlier.name}',) on {type(p).__name__} (a pass that "
                    f"creates variables or draws keys runs before '{earlier.name}')")


def _known_passes(names: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``names`` stripped, each checked against the registry: a misspelt name would
    otherwise dump nothing, silently."""
    if names is None:
        return None
    if isinstance(names, str):   # "discharge,lower-rng", as in the environment variable
        names = names.split(",")
    names = tuple(n.strip() for n in names if n.strip())
    for name in names:
        get_pass(name)
    return names


# --- ordering ----------------------------------------------------------------------

def _ordered(given: tuple[Pass, ...]) -> tuple[Pass, ...]:
    """``_order``, memoised: every functionalized function and every lifted region builds
    a pipeline from the same few pass lists, and ordering one costs a networkx sort."""
    try:
        found = _ORDERS.get(given)
    except TypeError:            # a pass with an unhashable option
        return _order(list(given))
    if found is None:
        found = _ORDERS[given] = _order(list(given))
    return found


_ORDERS: dict[tuple[Pass, ...], tuple[Pass, ...]] = {}


def _order(given: list[Pass]) -> tuple[Pass, ...]:
    passes = _with_requirements(given)
    _check_conflicts(passes)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(passes)))
    positions = collections.defaultdict(list)
    for i, p in enumerate(passes):
        positions[p.name].append(i)
    for i, p in enumerate(passes):
        for relation, names in (("requires", p.requires), ("after", p.after),
                                ("before", p.before)):
            for name in names:
                for j in positions.get(name, ()):
                    if j != i:
                        edge = (i, j) if relation == "before" else (j, i)
                        graph.add_edge(*edge, why=f"{p.name} {relation} {name}")
    try:
        # Ties broken by position: unconstrained passes keep the written order.
        order = nx.lexicographical_topological_sort(graph, key=lambda i: i)
        return tuple(passes[i] for i in order)
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(graph)
    names = " -> ".join([passes[u].name for u, _ in cycle] + [passes[cycle[0][0]].name])
    reasons = "; ".join(graph.edges[u, v]["why"] for u, v in cycle)
    raise PipelineError(f"pass ordering cycle: {names} ({reasons})", source=source_text(),
                        fix="drop one of these passes, or one of their ordering constraints")


def _check_conflicts(passes: list[Pass]) -> None:
    """Passes that cannot share a pipeline: two that discharge (after the first, nothing is
    left for the second, which fails on the pure IR), and two that create variables in one
    collection (``lora{rank=4},lora{rank=2}``: the second would find the first's adapters
    and use them as its own, or make its own beside them, silently) -- unless both are
    rooted at different arguments of an object-mode call."""
    discharging = [p for p in passes if p.discharges]
    if len(discharging) > 1:
        raise PipelineError(
            f"the pipeline discharges twice ({', '.join(p.spec() for p in discharging)}); "
            "after the first nothing is left to discharge.", source=source_text(),
            fix=f"name '{discharging[0].name}' once: init, apply and vj.functionalize already "
                "end their pipelines with it, and passes= adds to those")
    creators: dict[str, list[Pass]] = collections.defaultdict(list)
    for p in passes:
        for collection in p.lifted_like():
            first = next((q for q in creators[collection] if _overlap(q, p)), None)
            creators[collection].append(p)
            if first is not None:
                raise PipelineError(
                    f"passes '{first.spec()}' and '{p.spec()}' both create the variables of "
                    f"collection '{collection}'; one of them would use the other's.",
                    source=source_text(),
                    fix=f"keep one of them, or give the other its own collection "
                        f"({p.name}{{collection=...}})")


def _overlap(a: Pass, b: Pass) -> bool:
    """Whether two passes may touch one variable: unless both are rooted (``Pass.rooted``)
    at disjoint parts of the program (two modules of one object-mode call, each bound with
    its own ``lora``, create adapters each in its own module)."""
    if not a.roots or not b.roots:
        return True
    return any(x[:len(y)] == y or y[:len(x)] == x for x, _ in a.roots for y, _ in b.roots)


def _with_requirements(given: list[Pass]) -> list[Pass]:
    """``given`` plus missing required passes, each placed before its first requirer."""
    present = {p.name for p in given}
    out: list[Pass] = []

    def add_requirements(p: Pass) -> None:
        for name in p.requires:
            if name not in present:
                present.add(name)
                req = _instantiate(get_pass(name), {}, why=f"required by '{p.name}'")
                add_requirements(req)
                out.append(req)

    for p in given:
        add_requirements(p)
        out.append(p)
    return out


# --- pipeline strings ----------------------------------------------------------------

_SPEC = re.compile(r"\s*([\w.-]+)\s*(?:\{(.*)\})?\s*", re.DOTALL)


def _parse(text: str) -> list[Pass]:
    """Passes of a pipeline string, in written order (not yet ordered)."""
    if not text.strip():
        return []
    passes = []
    for item in _split_top_level(text):
        match = _SPEC.fullmatch(item)
        if match is None:
            raise PipelineError(f"cannot parse pass spec {item.strip()!r} in pipeline {text!r}",
                                source=source_text(), fix="write name or name{option=value,...}")
        name, body = match.groups()
        passes.append(_instantiate(get_pass(name), _parse_options(name, body or ""),
                                   why=f"in pipeline {text!r}"))
    return passes


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "{}":
            depth += 1 if ch == "{" else -1
            if depth not in (0, 1):
                raise PipelineError(f"unbalanced or nested braces at column {i} of {text!r}",
                                    source=source_text(),
                                    fix="give each pass's options in one pair of braces: name{a=1,b=2}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise PipelineError(f"unclosed '{{' in pipeline {text!r}", source=source_text(),
                            fix="close the options with '}': name{a=1,b=2}")
    return items + [text[start:]]


def _parse_options(name: str, body: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for item in filter(str.strip, body.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise PipelineError(f"pass '{name}': option {item.strip()!r} is not key=value",
                                source=source_text(),
                                fix=f"write each option as key=value: {name}{{option=value,...}}")
        if key in options:
            raise PipelineError(f"pass '{name}': option '{key}' given twice", source=source_text(),
                                fix=f"give option '{key}' once")
        options[key] = value.strip()
    return options


def _instantiate(cls: type[Pass], options: dict[str, str], *, why: str) -> Pass:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    valid = ", ".join(fields) or "none"
    for key in options:
        if key not in fields:
            raise PipelineError(f"pass '{cls.name}' has no option '{key}' ({why})",
                                source=source_text(),
                                fix=f"spell the option as the pass defines it; valid options: {valid}")
    kwargs = {key: _convert(cls, fields[key], text, valid) for key, text in options.items()}
    missing = [n for n, f in fields.items() if n not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise PipelineError(f"pass '{cls.name}' needs option(s) {', '.join(missing)} ({why})",
                            source=source_text(),
                            fix=f"write {cls.name}{{{missing[0]}=...}}; valid options: {valid}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PipelineError(f"pass '{cls.name}' rejected options {options} ({why}): {exc}",
                            source=source_text(),
                            fix=f"give values the pass accepts; valid options: {valid}") from exc


def _convert(cls: type[Pass], field: dataclasses.Field, text: str, valid: str) -> Any:
    kind = _annotation(cls, field)
    try:
        return _from_text(kind, text)
    except (TypeError, ValueError) as exc:
        raise PipelineError(
            f"pass '{cls.name}': bad value {text!r} for option '{field.name}' "
            f"(expects {_describe(kind)}): {exc}", source=source_text(),
            fix=f"give option '{field.name}' a value of type {_describe(kind)}; "
                f"valid options: {valid}") from None


def _annotation(cls: type[Pass], field: dataclasses.Field) -> Any:
    """The field's resolved annotation; the default's type if it cannot be resolved."""
    try:
        kind = typing.get_type_hints(cls).get(field.name, field.type)
    except (NameError, TypeError):  # annotation names something not importable here
        kind = field.type
    if isinstance(kind, str):
        return str if field.default is dataclasses.MISSING else type(field.default)
    return kind


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _from_text(kind: Any, text: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    # A ``vj.typing`` alias (``Dtype``) names what Python may pass, text among it: the pass
    # reads the name itself (``jnp.dtype("bfloat16")``), and its constraints check it.
    if kind is Any or kind is str or isinstance(kind, TypeAliasType):
        return text
    if kind is bool:
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError("not a boolean (true/false)")
    if origin is typing.Literal:
        for choice in args:
            if str(choice) == text:
                return choice
        raise ValueError(f"not one of {', '.join(map(str, args))}")
    if origin in (Union, types.UnionType):
        if text == "None" and type(None) in args:
            return None
        # str accepts anything, so it is tried last (``DTypeLike`` lists it first).
        members = sorted((a for a in args if a is not type(None)), key=lambda a: a is str)
        return _first_conversion(members, text)
    if isinstance(kind, type) and issubclass(kind, np.dtype):
        return jnp.dtype(text)
    if origin is None and callable(kind):
        return kind(text)
    raise TypeError(f"options of type {kind!r} cannot be given as text")


def _first_conversion(kinds: Iterable[Any], text: str) -> Any:
    problems = []
    for kind in kinds:
        try:
            return _from_text(kind, text)
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    raise ValueError("; ".join(problems))


def _describe(kind: Any) -> str:
    return getattr(kind, "__name__", None) or str(kind)
