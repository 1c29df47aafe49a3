"""``python -m varjax``: a few real subprocesses (each imports JAX), the rest through ``main``."""
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from varjax.tools.cli import main, parse_shape

EXAMPLE = '''
import jax
import jax.numpy as jnp
import varjax as vj
import varjax.nn as nn


def loss(x):
    w = vj.param("w", jax.nn.initializers.ones, (x.shape[-1], 2))
    return jnp.sum(x @ w)


def count(x):
    n = vj.variable("stats", "n", jnp.zeros, (), jnp.int32)
    n.value += 1
    return x


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(4)(x)
        return nn.Dense(2)(nn.BatchNorm(use_running_average=True)(x))


fz = vj.functionalize(loss)
mlp = MLP()
'''


@pytest.fixture
def example(tmp_path):
    path = tmp_path / "example_model.py"
    path.write_text(textwrap.dedent(EXAMPLE))
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "varjax", *args], capture_output=True, text=True,
                          timeout=120)


def test_dump_after_discharge_writes_files_and_dot(example, tmp_path):
    out, dot = tmp_path / "dumps", tmp_path / "flow.dot"
    done = run("dump", f"{example}:loss", "--shape", "x=f32[8,3]", "--after", "discharge",
               "--out", str(out), "--dot", str(dot))
    assert done.returncode == 0, done.stderr
    assert "var_get" not in done.stdout and "f32[3,2]" in done.stdout   # pure: w is an input
    assert any(out.rglob("*")), "--out wrote nothing"
    assert dot.read_text().startswith("digraph")
    (run_dir,) = out.iterdir()
    wrote = [line for line in done.stdout.splitlines() if line.startswith("wrote ")]
    assert [Path(line[6:]).resolve() for line in wrote] == [run_dir, dot]


def test_summary_of_a_module_class(example):
    done = run("summary", f"{example}:MLP", "--shape", "x=f32[8,3]")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["module", "|", "params", "|", "batch_stats"]
    assert lines[4].split() == ["BatchNorm_0", "|", "2", "arrays,", "8", "(32", "B)", "|",
                                "2", "arrays,", "8", "(32", "B)"]


def test_bad_shape_is_a_usage_error(example):
    done = run("summary", f"{example}:MLP", "--shape", "x=f33[8,3]")
    assert done.returncode == 2
    assert "unknown dtype 'f33'" in done.stderr and "bf16" in done.stderr


def test_parse_shape():
    name, s = parse_shape("tokens=i32[8, 128]")
    assert (name, s.shape, str(s.dtype)) == ("tokens", (8, 128), "int32")
    assert parse_shape("flag=bool[]")[1].shape == ()
    for bad in ("x=f32", "f32[3]", "x=f32[3", "x=f32[a]"):
        with pytest.raises(Exception, match="expected NAME=DTYPE"):
            parse_shape(bad)


def test_dump_prints_every_stage_and_only_the_header_of_unchanged_ones(example, capsys):
    assert main(["dump", f"{example}:fz", "--shape", "x=f32[2,3]"]) == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines()
               if line.startswith("// ") and not line.startswith("// inputs: ")]
    assert headers[1] == "// effectful" and headers[-1] == "// after discharge (changed)"
    assert "// after discharge (changed)\n// inputs: a=params/w b=x\n{ lambda" in out
    assert "// after check-mutability (unchanged)\n// after lower-rng" in out
    assert out.count("{ lambda") == 1 + sum("(changed)" in h for h in headers)


def test_module_instance_summary_detail(example, capsys):
    assert main(["summary", f"{example}:mlp", "--shape", "x=f32[2,3]", "--detail"]) == 0
    assert "Dense_1     | params      | kernel | [4,2]" in capsys.readouterr().out


def test_unknown_pass_lists_the_passes(example, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["dump", f"{example}:loss", "--shape", "x=f32[2,3]", "--after", "discharged"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "unknown pass 'discharged'" in err and "lower-rng" in err and "discharge" in err


def test_varjax_error_is_exit_1_with_its_message(example, capsys):
    assert main(["dump", f"{example}:count", "--shape", "x=f32[2]"]) == 1
    err = capsys.readouterr().err
    assert "ImmutableCollectionError" in err and "mutable=['stats']" in err and "Traceback" not in err
    assert main(["dump", f"{example}:count", "--shape", "x=f32[2]", "--mutable", "stats",
                 "--after", "discharge"]) == 0


@pytest.mark.parametrize("ref, message", [
    ("nowhere.py:f", "no such file"), ("{example}:missing", "has no attribute 'missing'"),
    ("{example}", "expected FILE:NAME")])
def test_bad_target_is_a_usage_error(example, capsys, ref, message):
    with pytest.raises(SystemExit) as exit:
        main(["summary", ref.format(example=example)])
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_written_files_are_printed_relative_to_the_current_folder(example, tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "earlier-run").mkdir()     # not this run's: not printed
    assert main(["dump", f"{example}:loss", "--shape", "x=f32[2,3]", "--after", "discharge",
                 "--out", str(tmp_path / "dumps"), "--dot", "graphs/../flow.dot"]) == 0
    wrote = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    (run_dir,) = set((tmp_path / "dumps").iterdir()) - {tmp_path / "dumps" / "earlier-run"}
    assert wrote == [f"wrote dumps/{run_dir.name}", "wrote flow.dot"]
    assert "legend" in (tmp_path / "flow.dot").read_text()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot program is not installed")
def test_svg_and_png_draw_the_dataflow_graph(example, tmp_path, monkeypatch, capsys):
    pytest.importorskip("graphviz")
    monkeypatch.chdir(tmp_path)
    assert main(["dump", f"{example}:mlp", "--shape", "x=f32[2,3]", "--after", "discharge",
                 "--svg", "flow.svg", "--png", "pictures/../flow.png"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == ["wrote flow.svg", "wrote flow.png"]
    assert "params:Dense_0/kernel" in (tmp_path / "flow.svg").read_text()
    assert (tmp_path / "flow.png").read_bytes().startswith(b"\x89PNG")


def test_svg_without_graphviz_is_exit_1_saying_what_to_install(example, tmp_path, monkeypatch,
                                                                 capsys):
    monkeypatch.setitem(sys.modules, "graphviz", None)
    assert main(["dump", f"{example}:loss", "--shape", "x=f32[2,3]", "--after", "discharge",
                 "--svg", str(tmp_path / "flow.svg")]) == 1
    err = capsys.readouterr().err
    assert "MissingDependencyError" in err and "pip install graphviz" in err
    assert not (tmp_path / "flow.svg").exists()


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="64-bit dtypes are enabled")
def test_64_bit_shape_without_x64_is_a_usage_error(example, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["summary", f"{example}:MLP", "--shape", "x=f64[2,3]"])
    assert exit.value.code == 2 and "JAX_ENABLE_X64=1" in capsys.readouterr().err
