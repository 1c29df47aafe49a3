"""What the two differential fuzzers (``test_linen_diff.py``, ``test_nnx_diff.py``) share: one
campaign of random examples checked against an oracle library.

``VARJAX_<NAME>_EXAMPLES`` sets the number of examples (default 20, derandomized: CI sees a
fixed sequence; an explicit count gets fresh randomness unless ``VARJAX_<NAME>_DERANDOMIZE=1``).
``VARJAX_<NAME>_KEEP_GOING=1`` (``make fuzz-linen``/``fuzz-nnx``) records a failing example
and goes on, so one run lists every kind of failure, each with its smallest examples; the
test then fails at the end.  Otherwise the first failure fails and hypothesis shrinks it.
"""
from __future__ import annotations

import collections
import os
import re
import time
import traceback
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import HypothesisException


def failure_kind(e: AssertionError) -> str:
    """A failure's kind: its first two lines with numbers and names taken out (for a layout
    difference, the last names of the paths that differ), so that one bug in different
    models is one kind."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    if lines and "layout differs" in lines[0]:
        names = sorted(set(re.findall(r"\['(\w+)'\]\"", " ".join(lines[1:3]))))
        lines = [lines[0], "paths ending " + "/".join(names)]
    head = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", " | ".join(lines[:2]))
    return re.sub(r"'[^']*'|\([^)]*\)|\[[^\]]*\]", "*", head)[:200]


class Campaign:
    """Examples of ``strategy`` checked by ``check``; ``size`` orders failing examples
    (smallest first) and ``describe`` prints one.  ``stats`` counts what the checks report
    (``stats['checked']``, categories the harness names)."""

    def __init__(self, name: str, strategy: Any, check: Callable[[Any], None],
                 size: Callable[[Any], int], describe: Callable[[Any], str],
                 stats: collections.Counter):
        env = f"VARJAX_{name.upper()}_EXAMPLES"
        self.name, self.check, self.size, self.describe = name, check, size, describe
        self.examples = int(os.environ.get(env, "20"))
        derandomize = os.environ.get(f"VARJAX_{name.upper()}_DERANDOMIZE",
                                     "1" if env not in os.environ else "0") == "1"
        self.keep_going = os.environ.get(f"VARJAX_{name.upper()}_KEEP_GOING", "0") == "1"
        self.stats = stats
        self._failures: dict[str, list] = {}      # kind -> [(size, example, message)]
        self._counts: collections.Counter = collections.Counter()
        self._fuzz = settings(max_examples=self.examples, deadline=None, derandomize=derandomize,
                              print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.filter_too_much])(
            given(strategy)(self._one))

    def _one(self, example: Any) -> None:
        if not self.keep_going:
            self.check(example)
            return
        try:
            self.check(example)
        except AssertionError as e:
            self._record(example, e)
        except HypothesisException:
            raise                   # reject(): an example the oracle rejects
        except Exception as e:  # noqa: BLE001 - an error of the harness: recorded, the run goes on
            self._record(example, AssertionError(
                f"harness error: {type(e).__name__}: {e}\n{self.describe(example)}\n"
                + "".join(traceback.format_exception(e)[-6:])))
        done = self.stats["checked"] + self.stats["FAILED"]
        if done % 100 == 0:         # progress of a long run
            print(f"fuzz-{self.name}: {done} done at {time.strftime('%H:%M:%S')}: "
                  f"{dict(sorted(self.stats.items()))}", flush=True)

    def _record(self, example: Any, e: AssertionError) -> None:
        kind = failure_kind(e)
        self.stats["FAILED"] += 1
        self._counts[kind] += 1
        found = self._failures.setdefault(kind, [])
        found.append((self.size(example), example, str(e)))
        found.sort(key=lambda f: f[0])
        del found[3:]

    def run(self, report: Callable[[str], None]) -> None:
        """The campaign as one test: a summary line for the session, and a failure listing
        the smallest example of each kind."""
        before = collections.Counter(self.stats)
        self._failures.clear()
        self._counts.clear()
        start = time.perf_counter()
        try:
            self._fuzz()
        finally:
            counts = collections.Counter(self.stats)
            counts.subtract(before)
            extra = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "checked" and v)
            report(f"fuzz-{self.name}: {counts['checked']} examples checked in "
                   f"{time.perf_counter() - start:.0f} s ({extra})")
        if self._failures:
            kinds = [f"{self._counts[kind]} example(s) of: {kind}\n\n{found[0][2]}"
                     + "".join(f"\n\nanother example:\n{self.describe(ex)}" for _, ex, _ in found[1:])
                     for kind, found in sorted(self._failures.items())]
            pytest.fail(f"{counts['FAILED']} failing examples, {len(self._failures)} kinds; the "
                        "smallest of each:\n\n" + ("\n\n" + "=" * 100 + "\n\n").join(kinds),
                        pytrace=False)
