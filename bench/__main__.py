"""``python -m bench [SUITE ...] [--results]``: run benchmark suites, print markdown tables.

Each suite is a module with ``run() -> list[Table]``.  Every suite runs in a fresh
process, so one suite's caches (JAX's jit caches, varjax's shared module traces, Flax's
and XLA's) never make another look faster; its tables print as soon as it finishes,
because the whole run takes minutes.  ``--results`` also appends them to
``bench/RESULTS.md`` under the command line and machine that produced them, so a
number there can always be reproduced.  A MISS against a target is reported, not
raised: these are benchmarks, not tests.
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from bench import harness

SUITES = {
    "trace": "bench.bench_trace",
    "frameworks": "bench.bench_frameworks",
    "dispatch": "bench.bench_dispatch",
    "nnx_dispatch": "bench.bench_nnx_dispatch",
    "nnx_eager": "bench.bench_nnx_eager",
    "transforms": "bench.bench_transforms",
    "pipeline": "bench.bench_pipeline",
    "init": "bench.bench_init",
    "depth": "bench.bench_depth",
}


def run_isolated(module: str) -> list[harness.Table]:
    """``module.run()`` in a new process (spawned, not forked: a fork would inherit this
    process's JAX state)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(harness.run_suite, module).result()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    parser.add_argument("suites", nargs="*", metavar="SUITE",
                        help=f"suites to run (default: all): {', '.join(SUITES)}")
    parser.add_argument("--results", action="store_true",
                        help=f"append the tables to {harness.RESULTS.name}")
    args = parser.parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(SUITES)}")

    print(f"# varjax benchmarks\n\n{harness.environment()}\n", flush=True)
    start = time.perf_counter()
    tables = []
    for name in args.suites or SUITES:
        for table in run_isolated(SUITES[name]):
            print(table.markdown(), flush=True)
            tables.append(table)
    verdicts = [(t.title, row, ok) for t in tables for row, ok in t.verdicts()]
    misses = [f"{row} ({title})" for title, row, ok in verdicts if not ok]
    print(f"{len(verdicts) - len(misses)} PASS, {len(misses)} MISS"
          + (f": {'; '.join(misses)}" if misses else "")
          + f" -- {time.perf_counter() - start:.0f} s in all")
    if args.results:
        harness.append_results(tables, " ".join(["python -m bench", *argv]))
        print(f"appended to {harness.RESULTS}")


if __name__ == "__main__":
    main()
