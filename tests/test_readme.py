"""The README's code runs as a newcomer runs it: each ```` ```python```` block pasted alone
into a fresh interpreter (no names from the blocks above it), printing what the reader
checks, and printing exactly the ```` ```text```` block that follows it, when there is one.

``tests/test_notes.py`` parses the blocks (its conventions hold here too); a failing block's
traceback points at its line in README.md."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_notes import Block, _normalize, blocks  # noqa: E402

README = Path(__file__).resolve().parent.parent / "README.md"
PYTHON = [b for b in blocks(README) if b.lang == "python"]
# Compiled with README.md as the file name at the block's real lines, so errors point there.
_RUN = "import sys; exec(compile(sys.argv.pop(), 'README.md', 'exec'), {'__name__': '__main__'})"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, subprocess.Popen]:
    """Every block started at once, each alone in its interpreter: their imports and compiles
    overlap, so the file's wall time is near the slowest block's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VARJAX_DUMP")}
    started: dict[int, subprocess.Popen] = {}
    for block in PYTHON:
        cwd = tmp_path_factory.mktemp(f"readme_line{block.line}")
        started[block.line] = subprocess.Popen(
            [sys.executable, "-c", _RUN, "\n" * (block.line - 1) + block.text],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    yield started
    for process in started.values():
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("block", PYTHON, ids=[f"line{b.line}" for b in PYTHON])
def test_readme_block_runs_alone_and_shows_its_effect(block: Block, runs) -> None:
    process = runs[block.line]
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, f"README.md:{block.line} fails alone:\n{stderr[-3000:]}"
    assert stdout.strip(), f"README.md:{block.line} prints nothing a reader can check"
    if block.output is not None:
        assert _normalize(stdout) == _normalize(block.output.text), \
            f"README.md:{block.line} prints other than its text block:\n{stdout}"


def test_readme_has_the_blocks_a_newcomer_runs() -> None:
    """The Linen port, Orbax, functionalize, the object-mode training step, a pass."""
    text = "\n".join(b.text for b in PYTHON)
    for needed in ("import varjax.nn as nn", "ocp.StandardCheckpointer", "@vj.functionalize",
                   "rngs=vj.Rngs(dropout=1), mutable=True", "vj.value_and_grad", "optax",
                   "class Freeze(Pass)"):
        assert needed in text, f"README.md has no python block with {needed!r}"


def test_readme_starts_with_make_demo_and_make_test() -> None:
    first = next(b for b in blocks(README))
    assert [line.split()[:2] for line in first.text.splitlines()] == [["make", "demo"], ["make", "test"]]


def test_readme_says_how_to_install_into_an_existing_environment() -> None:
    """The pip line, the JAX series as pyproject.toml pins it, Graphviz's system package."""
    text = README.read_text()
    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    jax_pin = next(d for d in project["dependencies"] if d.startswith("jax>=")).removeprefix("jax")
    assert f"`{jax_pin}`" in text
    assert "pip install -e 'path/to/varjax[examples]'" in text
    for extra in project["optional-dependencies"]:
        assert f"`{extra}`" in text, f"README.md does not name the extra {extra!r}"
    assert "apt install graphviz" in text
