"""notes/linen-parity.md runs, with the conventions of tests/test_notes.py (whose NOTES list
does not name it yet; once it does, this file can go)."""
import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("notes_runner", Path(__file__).parent.parent / "test_notes.py")
_runner = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _runner      # dataclasses look the module up while it executes
_spec.loader.exec_module(_runner)
isolated = _runner.isolated


def test_linen_parity_note_runs(isolated):
    _runner.run_notes("linen-parity.md")
