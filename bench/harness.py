"""The shared benchmark harness: timing, ratio tables, and ``bench/RESULTS.md``.

Every comparison in this suite is a *ratio against a baseline measured in the
same run*, because absolute trace times swing by 2x between machines (and
between runs on a loaded one) while the ratio of two things measured side by
side does not.  Absolute numbers are printed for context only.

Timing follows ``timeit``'s conventions: untimed warm-up calls first (they fill
JAX's own caches, e.g. the jit caches behind ``jnp`` functions, for the baseline
and varjax alike), then ``reps`` timed calls with ``time.perf_counter``, garbage
collection run before and disabled during each call so a collection triggered
by an earlier call does not land in a later one, and the **median** reported.
``compare`` interleaves the repetitions of the cases it compares, because a
shared machine's load drifts over a run of seconds.

Sharp edges:
  * All compared values are "lower is better" (seconds, seconds per equation);
    a throughput is shown as an extra cell, never as the compared value.
  * A ``setup`` callable runs before each timed call and is not timed; use it
    for anything that must be fresh per repetition (a new, empty-cache model).
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.extend.core

RESULTS = Path(__file__).with_name("RESULTS.md")


@dataclasses.dataclass(frozen=True)
class Timing:
    """The samples (seconds) of one measurement."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def reps(self) -> int:
        return len(self.samples)


@dataclasses.dataclass(frozen=True)
class Case:
    """One thing to time: ``fn(*setup())``, with ``setup`` untimed."""

    fn: Callable[..., Any]
    setup: Callable[[], tuple] = tuple


def compare(cases: dict[str, Case], *, reps: int = 5, warmup: int = 1) -> dict[str, Timing]:
    """Time several cases with their repetitions interleaved (A B C A B C ...), so a
    change in machine load mid-run hits the baseline and the candidates alike."""
    for _ in range(warmup):
        for case in cases.values():
            case.fn(*case.setup())
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, case in cases.items():
            samples[name].append(_time_once(case))
    return {name: Timing(tuple(s)) for name, s in samples.items()}


def measure(fn: Callable[..., Any], *, setup: Callable[[], tuple] = tuple,
            reps: int = 5, warmup: int = 1) -> Timing:
    """Time ``fn(*setup())``: ``warmup`` untimed calls, then ``reps`` timed ones."""
    return compare({"": Case(fn, setup)}, reps=reps, warmup=warmup)[""]


def _time_once(case: Case) -> float:
    args = case.setup()
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        case.fn(*args)
        return time.perf_counter() - start
    finally:
        gc.enable()


@dataclasses.dataclass
class Row:
    name: str
    value: float
    cells: dict[str, Any]
    target: float | None


class Table:
    """A markdown table whose rows are compared with one baseline row.

    Each row has a compared ``value`` (lower is better) in the unit named by
    ``value_label``; the ratio column is ``value / baseline value``.  A row with
    a ``target`` gets PASS when its ratio is at most the target, else MISS.
    Extra ``cells`` (min, reps, throughput...) are shown before the value.
    """

    def __init__(self, title: str, *, baseline: str, value_label: str, note: str = ""):
        self.title = title
        self.baseline = baseline
        self.value_label = value_label
        self.note = note
        self.rows: list[Row] = []

    def add(self, name: str, value: float, cells: dict[str, Any] | None = None,
            *, target: float | None = None) -> None:
        self.rows.append(Row(name, value, dict(cells or {}), target))

    def add_timing(self, name: str, timing: Timing, cells: dict[str, Any] | None = None,
                   *, target: float | None = None) -> None:
        """A timed row: the median in milliseconds, plus the min and the repetitions."""
        cells = {**(cells or {}), "min (ms)": timing.min * 1e3, "reps": timing.reps}
        self.add(name, timing.median * 1e3, cells, target=target)

    def ratio(self, name: str) -> float:
        return self._row(name).value / self._row(self.baseline).value

    def verdicts(self) -> list[tuple[str, bool]]:
        """``(row name, passed)`` for every row that has a target."""
        return [(r.name, self.ratio(r.name) <= r.target) for r in self.rows if r.target is not None]

    def markdown(self) -> str:
        columns = list(dict.fromkeys(k for r in self.rows for k in r.cells))
        head = ["case", *columns, self.value_label, f"ratio vs {self.baseline}", "target", ""]
        lines = [f"### {self.title}", ""]
        if self.note:
            lines += [self.note, ""]
        lines += [_md_row(head), _md_row(["---"] + ["---:"] * (len(head) - 2) + ["---"])]
        for r in self.rows:
            ratio = self.ratio(r.name)
            verdict = "" if r.target is None else ("PASS" if ratio <= r.target else "MISS")
            lines.append(_md_row([
                r.name, *(_fmt(r.cells.get(c, "")) for c in columns), _fmt(r.value),
                f"{ratio:.2f}x", "" if r.target is None else f"<= {r.target:g}x", verdict]))
        return "\n".join(lines) + "\n"

    def _row(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"table {self.title!r} has no row {name!r}")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _md_row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def count_eqns(jaxpr: Any) -> int:
    """Equations of a (Closed)Jaxpr, counting those of sub-jaxprs (scan bodies,
    cond branches, jit calls...) recursively."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return len(jaxpr.eqns) + sum(count_eqns(sub) for sub in jax.extend.core.subjaxprs(jaxpr))


def run_suite(module: str) -> list[Table]:
    """Import suite ``module`` and run it (``python -m bench`` calls this in a new process)."""
    return importlib.import_module(module).run()


def environment() -> str:
    """One line naming what the numbers were measured on."""
    return (f"jax {jax.__version__}, Python {platform.python_version()}, "
            f"{platform.machine()} with {os.cpu_count()} CPUs, backend {jax.default_backend()}")


def append_results(tables: list[Table], command: str, path: Path = RESULTS) -> None:
    """Append ``tables`` to ``path`` under a heading naming the command and the machine."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    text = [f"## {stamp}: `{command}`", "", environment(), ""]
    text += [t.markdown() for t in tables]
    if not path.exists():
        text = ["# varjax benchmark results", "",
                "Appended by `python -m bench --results`; newest last.", "", *text]
    with path.open("a") as f:
        f.write("\n".join(text) + "\n")
