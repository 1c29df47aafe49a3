"""Readable IR: JAX's jaxpr printer plus one varjax annotation per equation.

``pretty(jaxpr)`` prints like ``print(jaxpr)`` with these changes:

* every effectful jaxpr, nested bodies included, states its effect set on its
  first line (``{ lambda ; a:f32[3]. let  # effects { Var[params] }``; JAX puts
  it after the closing ``in (...)``), so each sub-jaxpr says up front which
  collections and streams it touches;
* variable equations read ``var_get[params:Dense_0/kernel]``: the collection,
  then the path, whose leading names are the module path;
* each equation may carry one trailing comment: its name stack (the module
  whose method traced it, ``MLP/hidden``) and, with ``source=True``, the
  user's ``file:line`` (the first frame outside JAX and varjax);
* with ``color=True`` (default: only when ``sys.stdout`` is a terminal and
  ``NO_COLOR`` is unset) variable reads, writes, RNG draws, effect sets and
  comments are coloured with ANSI escapes.

Source lines in nested bodies are the ones JAX recorded.  JAX traces a nested body
(``jit``, ``cond``, ``scan``...) under a fresh source context whose tracebacks stop at
the body's boundary, and caches library bodies across traces: so a cached library body
(``jax.nn.relu``'s ``jit``, ``jnp.linalg.norm``) holds no user line and shows none, even
when it was first traced while a pass re-bound another program's equation under that
equation's source info; a user's own jitted function shows its own lines, which are
right for every caller.  The enclosing equation shows where this program calls it
(``tests/passes/test_dump.py`` checks that no body claims another trace's line).

JAX's own printer shows either annotation only for some equations (none for a
``var_set``, which has no outputs), on two lines.  So the printer gives each
equation a unique token as its name stack, lets JAX print, and swaps every
token for the annotation varjax computes, realigning the comments.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any

from varjax import _jax
from varjax.ir import nested

_TOKEN = re.compile(r"[ \t]*# \[vj(\d+)\]")
_COLORS = {
    "read": "\x1b[36m", "write": "\x1b[35m", "rng": "\x1b[33m", "effects": "\x1b[32m",
    "comment": "\x1b[2m", "reset": "\x1b[0m",
}
_COMMENT_COLUMN_MAX = 72


def pretty(jaxpr: _jax.ClosedJaxpr, *, source: bool = False, name_stack: bool = True,
           color: bool | None = None) -> str:
    """The jaxpr as text, annotated per equation (see the module docstring)."""
    notes: list[str] = []
    marked = nested.map_eqns(jaxpr, lambda eqn: _mark(eqn, notes, source, name_stack))
    text = _jax.pretty_print(marked, name_stack=True).replace(" : {  }", "")
    lines = []
    for line in text.splitlines():
        match = _TOKEN.search(line)
        if match is None:
            lines.append((line, ""))
            continue
        code = line[:match.start()] + line[match.end():]
        if code.strip():
            lines.append((code.rstrip(), notes[int(match.group(1))]))
    lines = _effects_to_headers(lines)
    width = min(max((len(c) for c, n in lines if n), default=0), _COMMENT_COLUMN_MAX)
    out = "\n".join(f"{c.ljust(width)}  # {n}" if n else c for c, n in lines)
    if color is None:
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
    return _colorize(out) if color else out


_EFFECTS = re.compile(r" : (\{ (?:(?:Var|Rng)\[[^\]]*\](?:, )?)+ \}) \}$")


def _effects_to_headers(lines: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Moves each multi-line jaxpr's effect set from its closing ``in (...) : {...} }`` line
    to a comment on its opening ``{ lambda`` line, where a reader starts."""
    out = list(lines)
    opened: list[int] = []
    for i, (code, note) in enumerate(lines):
        closes = code.lstrip().startswith("in (") and code.endswith("}")
        if "{ lambda" in code and not closes:
            opened.append(i)
        elif closes and opened:
            header = opened.pop()
            match = _EFFECTS.search(code)
            if match is not None:
                out[i] = (code[:match.start()] + " }", note)
                out[header] = (out[header][0], f"effects {match.group(1)}")
    return out


def _mark(eqn: Any, notes: list[str], source: bool, name_stack: bool) -> Any:
    parts = []
    if name_stack and str(eqn.source_info.name_stack):
        parts.append(str(eqn.source_info.name_stack))
    where = _jax.user_frame_text(eqn.source_info) if source else None
    if where:
        parts.append(where)
    notes.append(" ".join(parts))
    return _jax.with_name_stack(eqn, f"vj{len(notes) - 1}")


def _colorize(text: str) -> str:
    c = _COLORS

    def paint(kind: str, s: str) -> str:
        return f"{c[kind]}{s}{c['reset']}"
    text = re.sub(r"var_get\[[^\]]*\]", lambda m: paint("read", m.group(0)), text)
    text = re.sub(r"var_set\[[^\]]*\]", lambda m: paint("write", m.group(0)), text)
    text = re.sub(r"rng_draw\[[^\]]*\]", lambda m: paint("rng", m.group(0)), text)
    text = re.sub(r"  # effects .*$", lambda m: paint("effects", m.group(0)), text, flags=re.M)
    return re.sub(r"  # (?!effects ).*$", lambda m: paint("comment", m.group(0)), text, flags=re.M)
