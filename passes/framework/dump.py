"""IR after every pass, on disk like XLA's ``--xla_dump_to`` or in memory.

``Dump(dir)`` gives each pipeline run its own directory,
``<dir>/<NNNN>-<label>/``, and writes ``00-effectful.txt`` (the traced IR,
headed by the pipeline string, so the run can be repeated), then
``01-<pass>.txt``, ... each headed ``// after <pass> (changed)`` or
``(unchanged)``, and for each pass that changed the IR ``01-<pass>.diff``, a
unified diff against the IR before it.  JAX renames every variable after an
inserted equation; the diff is taken after matching the variables of the two
texts (``rename_like``), so it shows only the equations the pass changed.
"Changed" is the identity check of the pass contract: a pass that changed
nothing returned its input.
A pass that raises gets a file holding the IR it was given, so the crash can
be reproduced from the dump alone.

``Recorder`` keeps the same entries as ``(pass_name, text)`` pairs in
memory (the first named ``effectful``), for tools that show the IR instead of
writing it.

Both can be selective, as MLIR's ``--mlir-print-ir-after=`` and
``--mlir-print-ir-after-change``: ``dump_after=("discharge",)`` keeps only the IR
after the named passes, and ``only_changed=True`` only the IR after passes that
changed it (the input and a failing pass's input are always kept).  Files keep the
number of their pass's position, so ``05-discharge.txt`` is the same file in a full
and in a selective dump, and a ``.diff`` is always against the IR the pass was given.

Sharp edges:
  * File numbers have two digits; past 99 passes, plain name order breaks.
  * Run directories are numbered per process and skip numbers already on
    disk, so runs never overwrite each other, but numbers are not contiguous
    when several processes share a dump directory.
  * Printing is ``varjax.ir.printing.pretty``: JAX's printer plus one comment per
    equation (module name stack and source line).
"""
from __future__ import annotations

import difflib
import itertools
import os
import re
from pathlib import Path
from typing import Sequence

from varjax import _jax
from varjax.ir.printing import pretty
from varjax.passes.framework.base import Pass, PassContext
from varjax.passes.framework.instrument import Instrumentation

_RUN_NUMBERS = itertools.count()


class _Printer(Instrumentation):
    """Renders the input and the IR after each selected pass; subclasses say where it goes.
    ``source`` adds each equation's ``file:line`` to the text; ``dump_after`` (pass
    names) and ``only_changed`` select passes (see the module docstring)."""

    def __init__(self, source: bool = True, dump_after: str | Sequence[str] | None = None,
                 only_changed: bool = False) -> None:
        self.source = source
        if isinstance(dump_after, str):    # "discharge,lower-rng"
            dump_after = dump_after.split(",")
        self.dump_after = None if dump_after is None else frozenset(n.strip() for n in dump_after)
        self.only_changed = only_changed

    def wants(self, p: Pass, changed: bool) -> bool:
        """Is the IR after ``p`` dumped?"""
        return ((self.dump_after is None or p.name in self.dump_after)
                and (changed or not self.only_changed))

    def before_pipeline(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> None:
        self._start(ctx)
        pipeline = ctx.results.get("pipeline", "<unknown>")
        self._emit("effectful", _render(f"// pipeline: {pipeline}\n// effectful", jaxpr, self.source))

    def after_pass(self, p: Pass, before: _jax.ClosedJaxpr, after: _jax.ClosedJaxpr,
                   ctx: PassContext) -> None:
        changed = after is not before
        if not self.wants(p, changed):
            self._skip()
            return
        change = "changed" if changed else "unchanged"
        self._emit(p.name, _render(f"// after {p.spec()} ({change})", after, self.source),
                   diff_from=before if changed else None)

    def pass_failed(self, p: Pass, jaxpr: _jax.ClosedJaxpr, exc: Exception,
                    ctx: PassContext) -> None:
        header = f"// {p.spec()} failed ({type(exc).__name__}); the IR it was given:"
        self._emit(p.name, _render(header, jaxpr, self.source))

    def _skip(self) -> None:
        """A pass's IR was not selected."""

    def _start(self, ctx: PassContext) -> None:
        raise NotImplementedError

    def _emit(self, name: str, text: str, diff_from: _jax.ClosedJaxpr | None = None) -> None:
        raise NotImplementedError


class Recorder(_Printer):
    """In-memory dump: ``entries`` is ``[('effectful', text), (pass_name, text), ...]``
    for the latest run."""

    def __init__(self, source: bool = True, dump_after: str | Sequence[str] | None = None,
                 only_changed: bool = False) -> None:
        super().__init__(source, dump_after, only_changed)
        self.entries: list[tuple[str, str]] = []

    def _start(self, ctx: PassContext) -> None:
        self.entries = []

    def _emit(self, name: str, text: str, diff_from: _jax.ClosedJaxpr | None = None) -> None:
        self.entries.append((name, text))


class Dump(_Printer):
    """Numbered text files under ``dump_dir``; ``run_dir`` is the latest run's directory.

    The run is labelled by ``ctx.results['label']`` (``Pipeline.run(label=...)``).
    """

    def __init__(self, dump_dir: str | os.PathLike, source: bool = True,
                 dump_after: str | Sequence[str] | None = None, only_changed: bool = False):
        super().__init__(source, dump_after, only_changed)
        self.dump_dir = Path(dump_dir)
        self.run_dir: Path | None = None
        self._files = 0
        # The last file written and its text, while it is the IR the next pass is given.
        self._previous: tuple[str, str] | None = None

    def _start(self, ctx: PassContext) -> None:
        label = re.sub(r"[^\w.-]+", "_", str(ctx.results.get("label") or "run"))
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        while True:
            run_dir = self.dump_dir / f"{next(_RUN_NUMBERS):04d}-{label}"
            try:
                run_dir.mkdir()
                break
            except FileExistsError:  # left by an earlier process: take the next number
                continue
        self.run_dir = run_dir
        self._files = 0
        self._previous = None

    def _skip(self) -> None:
        self._files += 1         # file numbers stay pass positions
        self._previous = None    # a later diff renders the IR its pass was given

    def _emit(self, name: str, text: str, diff_from: _jax.ClosedJaxpr | None = None) -> None:
        stem = f"{self._files:02d}-{name}"
        (self.run_dir / f"{stem}.txt").write_text(text)
        if diff_from is not None:
            before_name, before = self._previous or (
                f"before {stem}", _render("// before", diff_from, self.source))
            (self.run_dir / f"{stem}.diff").write_text(unified_diff(before_name, before, stem, text))
        self._previous = (stem, text)
        self._files += 1


def unified_diff(before_name: str, before: str, after_name: str, after: str) -> str:
    """What a pass changed, as a unified diff of the IR texts (headers left out).

    JAX names variables in order of appearance, so one inserted equation renames every
    variable after it.  The diff is taken after renaming ``before``'s variables to
    ``after``'s names (see ``rename_like``): a line shows as changed only if it changed
    other than by that renaming, and both sides of the diff read in ``after``'s names."""
    a, b = ([line for line in text.splitlines() if not line.startswith("//")] for text in (before, after))
    a = rename_like(a, b)
    return "\n".join(difflib.unified_diff(a, b, before_name, after_name, lineterm="")) + "\n"


# A variable as JAX prints it: a lowercase name, as a binder (``c:f32[3]``) or a use
# (``mul c d``, ``in (c,)``); not a primitive (right after ``= ``), a param name or value
# (``axes=(0,)``, ``name=c``), nor inside brackets (``var_get[params:w]``).
_NAME = re.compile(r"(?<![\w.'\"\[=/])(?<!= )(?!(?:lambda|let) |in \()([a-z]+)(?=[\s:,)]|$)")


def _code(line: str) -> tuple[str, str]:
    """A printed line as code and trailing comment (never renamed)."""
    at = line.find("  # ")
    return (line, "") if at < 0 else (line[:at], line[at:])


def _binders(lines: Sequence[str]) -> list[list[str]]:
    """The names each line binds (``name:type``), in order."""
    return [[m.group(1) for m in _NAME.finditer(_code(line)[0])
             if m.end() < len(_code(line)[0]) and _code(line)[0][m.end()] == ":"] for line in lines]


def _substitute(line: str, names: dict[str, str] | set[str], to: str | None = None) -> str:
    code, comment = _code(line)
    code = _NAME.sub(lambda m: (to if to is not None else names[m.group(1)])
                     if m.group(1) in names else m.group(1), code)
    return code + comment


def rename_like(before: list[str], after: list[str]) -> list[str]:
    """``before`` with its variables renamed to the names the same variables have in
    ``after``.

    Lines are matched on their form with every variable name blanked out (difflib's
    longest matching blocks); the binders of each matched pair are the same variables.  A
    variable of ``before`` with no match (its equation was removed or rewritten) keeps its
    name, primed (``c'``) where ``after`` uses that name for another variable.  Operands
    are renamed through the binders only, so a pass that changes which variable an
    equation reads shows that line as changed."""
    binders_a, binders_b = _binders(before), _binders(after)
    names_a = {n for line in binders_a for n in line}
    names_b = {n for line in binders_b for n in line}
    forms_a = [_substitute(line, names_a, "%") for line in before]
    forms_b = [_substitute(line, names_b, "%") for line in after]
    rename: dict[str, str] = {}
    matcher = difflib.SequenceMatcher(None, forms_a, forms_b, autojunk=False)
    for i, j, size in matcher.get_matching_blocks():
        for k in range(size):
            for x, y in zip(binders_a[i + k], binders_b[j + k]):
                rename.setdefault(x, y)
    taken = set(rename.values())
    for name in names_a - rename.keys():
        rename[name] = f"{name}'" if name in names_b or name in taken else name
    return [_substitute(line, rename) for line in before]


def _render(header: str, jaxpr: _jax.ClosedJaxpr, source: bool) -> str:
    return f"{header}\n{pretty(jaxpr, source=source, color=False)}\n"
