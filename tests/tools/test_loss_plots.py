"""The examples' loss curves (``examples/common.py``'s ``plot_losses``): a PNG with matplotlib,
a printed line and no file without it."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import common  # noqa: E402


def test_plot_losses_writes_a_png_and_prints_its_relative_path(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    path = common.plot_losses("toy", {"a": [3.0, 2.0, 1.5], "b": [3.0, 2.5, 1.0]},
                              tmp_path / "curves" / "toy.png", log_y=True)
    assert path.read_bytes().startswith(b"\x89PNG")
    assert capsys.readouterr().out == "[toy] loss curve: curves/toy.png\n"


def test_plot_losses_without_matplotlib_prints_a_line_and_writes_nothing(tmp_path, monkeypatch,
                                                                         capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert common.plot_losses("toy", {"a": [1.0]}, tmp_path / "toy.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "toy.png").exists()
