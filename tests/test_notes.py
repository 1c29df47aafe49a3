"""The design notes run: their code blocks are executed, so the notes cannot rot.

Conventions for the notes files listed in ``NOTES`` (the README's examples run too):

* Every fenced ```` ```python```` block runs (indented ones inside list items too), in order,
  in one namespace per notes file, like a doctest session: later blocks may use names defined
  by earlier ones.  Code is compiled with the notes file as its file name and its real line
  numbers, so a failure -- and any varjax error message's ``at:`` line -- points into the notes.
* A ```` ```text```` block right after a python block (blank lines between allowed) is that
  block's printed output and must match it.  Lines are compared with trailing blanks
  stripped, and ``notes/<file>.md:<line>`` locations compare equal whatever the line number,
  so editing text above an example does not break it.  On a mismatch the failure prints
  ``Found:`` with the actual output, ready to paste.
* A python block whose first line is ``# excerpt: <path>`` is quoted from ``<path>`` (relative
  to the repository root) and must appear there verbatim; it is not executed.
* A python block whose first line starts with ``# not run`` is skipped; say why after it.

Global state a block may change (pass registry, environment, dump directory variable) is
restored after each file.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTES = ("architecture.md", "nnx.md", "ir.md", "writing-passes.md", "modules.md", "inspecting.md",
         "lifting.md", "transforms.md", "randomness.md", "object-mode.md", "linen-parity.md", "scale-out.md",
         "pass-library.md",
         "../README.md")
_FENCE = re.compile(r"^( *)```(\w*)\s*$")
_LOCATION = re.compile(r"(notes/[\w.-]+\.md):\d+(?::\d+)?")


@dataclasses.dataclass
class Block:
    lang: str
    line: int          # 1-based line of the first code line
    text: str          # dedented by the fence's indentation
    indent: int = 0
    output: "Block | None" = None


def blocks(path: Path) -> list[Block]:
    """Fenced blocks in ``path``; each python block gets the ``text`` block that follows it."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i, last_end = 0, -1
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = len(m.group(1)), m.group(2), i + 1
        j = start
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.name}:{i + 1}: unclosed code fence")
        body = [line[indent:] if not line[:indent].strip() else line for line in lines[start:j]]
        block = Block(lang, start + 1, "\n".join(body) + "\n", indent)
        prev = found[-1] if found else None
        between = lines[last_end + 1:i]
        if (lang == "text" and prev is not None and prev.lang == "python"
                and prev.output is None and not any(s.strip() for s in between)):
            prev.output = block
        else:
            found.append(block)
        last_end = i = j
        i += 1
    return found


def _normalize(text: str) -> str:
    text = _LOCATION.sub(r"\1:N", text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def run_notes(name: str) -> None:
    path = ROOT / "notes" / name
    # A real module, so that dataclasses and typing.get_type_hints can look the code up.
    module = types.ModuleType("notes_" + re.sub(r"\W", "_", path.stem))
    sys.modules[module.__name__] = module
    try:
        _run_blocks(name, path, module.__dict__)
    finally:
        del sys.modules[module.__name__]


def _run_blocks(name: str, path: Path, namespace: dict) -> None:
    for block in blocks(path):
        if block.lang != "python":
            continue
        first = block.text.splitlines()[0] if block.text.strip() else ""
        where = f"notes/{name}:{block.line}"
        if first.startswith("# excerpt:"):
            source = (ROOT / first.split(":", 1)[1].strip()).read_text()
            body = block.text.split("\n", 1)[1]
            assert body.strip() and body in source, \
                f"{where}: the excerpt no longer matches {first.split(':', 1)[1].strip()}"
            continue
        if first.startswith("# not run"):
            assert first[len("# not run"):].strip(" :"), f"{where}: say why the block does not run"
            continue
        code = compile("\n" * (block.line - 1) + block.text, f"notes/{name}", "exec",
                       dont_inherit=True)  # not this file's `from __future__ import annotations`
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code, namespace)
        if block.output is not None:
            want, got = _normalize(block.output.text), _normalize(out.getvalue())
            assert got == want, (f"{where}: printed output differs from the text block at line "
                                 f"{block.output.line}.\nFound:\n{out.getvalue()}")


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """Restore what a notes example may change: env vars and the cwd (the pass registry
    is restored after every test, by conftest.py)."""
    env = dict(os.environ)
    monkeypatch.delenv("VARJAX_DUMP_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    yield
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)


@pytest.mark.parametrize("name", NOTES)
def test_notes_run(name, isolated):
    run_notes(name)


def test_every_notes_file_has_runnable_code():
    for name in NOTES:
        runnable = [b for b in blocks(ROOT / "notes" / name) if b.lang == "python"
                    and not b.text.startswith(("# excerpt:", "# not run"))]
        assert runnable, f"notes/{name} has no runnable python block"


def test_blocks_pair_code_with_output_and_dedent(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("text\n```python\nprint(1)\n```\n\n```text\n1\n```\n\n"
                  "- item\n\n  ```python\n  if True:\n      print(2)\n  ```\n"
                  "prose\n```text\nnot output\n```\n")
    code1, code2, stray = blocks(md)
    assert (code1.line, code1.text, code1.output.text) == (3, "print(1)\n", "1\n")
    assert code2.text == "if True:\n    print(2)\n" and code2.indent == 2
    assert code2.output is stray.output is None and stray.lang == "text"
