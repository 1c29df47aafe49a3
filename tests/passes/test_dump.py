"""IR dumps: numbered files, changed/unchanged headers, the env var, in-memory recording."""
from __future__ import annotations

import dataclasses

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import pytest

from varjax.errors import PassError, PipelineError, VerificationError
from varjax.passes.framework.base import Pass, PassContext
from varjax.passes.framework.dump import Dump, Recorder
from varjax.passes.framework.instrument import DUMP_AFTER_ENV, DUMP_CHANGED_ENV, DUMP_DIR_ENV
from varjax.passes.framework.pipeline import Pipeline


def _jaxpr():
    return jax.make_jaxpr(lambda x: jnp.sin(x) + 1.0)(jnp.ones(2, jnp.float32))


@dataclasses.dataclass(frozen=True)
class Negate(Pass):
    name = "td-negate"

    def run(self, jaxpr, ctx):
        return jax.make_jaxpr(lambda x: [-y for y in jex.jaxpr_as_fun(jaxpr)(x)])(
            jnp.ones(2, jnp.float32))


@dataclasses.dataclass(frozen=True)
class Noop(Pass):
    name = "td-noop"

    def run(self, jaxpr, ctx):
        return jaxpr


@dataclasses.dataclass(frozen=True)
class Crash(Pass):
    name = "td-crash"

    def run(self, jaxpr, ctx):
        raise ValueError("bad")


@dataclasses.dataclass(frozen=True)
class Corrupt(Pass):
    name = "td-corrupt"

    def run(self, jaxpr, ctx):
        eqns = jaxpr.jaxpr.eqns
        return jaxpr.replace(jaxpr=jaxpr.jaxpr.replace(eqns=eqns[1:]))


@pytest.fixture(autouse=True)
def no_env_dump_dir(monkeypatch):
    for name in (DUMP_DIR_ENV, DUMP_AFTER_ENV, DUMP_CHANGED_ENV):
        monkeypatch.delenv(name, raising=False)


def run_dirs(root):
    return sorted(p for p in root.iterdir() if p.is_dir())


def test_files_are_numbered_and_headed_changed_or_unchanged(tmp_path):
    pipeline = Pipeline.parse("td-negate,td-noop", dump_dir=tmp_path)
    pipeline.run(_jaxpr(), PassContext())
    (run_dir,) = run_dirs(tmp_path)
    files = sorted(p.name for p in run_dir.iterdir())
    assert files == ["00-effectful.txt", "01-td-negate.diff", "01-td-negate.txt", "02-td-noop.txt"]
    first = (run_dir / "00-effectful.txt").read_text()
    assert first.startswith("// pipeline: td-negate,td-noop\n// effectful\n{ lambda")
    assert "sin" in first and "test_dump.py" in first  # the user's source line is printed
    assert (run_dir / "01-td-negate.txt").read_text().startswith("// after td-negate (changed)\n")
    assert "neg" in (run_dir / "01-td-negate.txt").read_text()
    assert (run_dir / "02-td-noop.txt").read_text().startswith("// after td-noop (unchanged)\n")
    diff = (run_dir / "01-td-negate.diff").read_text()
    assert diff.startswith("--- 00-effectful\n+++ 01-td-negate\n") and "+" in diff and "neg" in diff


def test_env_var_is_read_at_each_run(tmp_path, monkeypatch):
    pipeline = Pipeline.parse("td-noop")
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path / "dumps"))
    pipeline.run(_jaxpr(), PassContext())
    (run_dir,) = run_dirs(tmp_path / "dumps")
    assert (run_dir / "01-td-noop.txt").exists()
    monkeypatch.delenv(DUMP_DIR_ENV)
    pipeline.run(_jaxpr(), PassContext())
    assert run_dirs(tmp_path / "dumps") == [run_dir]


def test_argument_overrides_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path / "from-env"))
    Pipeline.parse("td-noop", dump_dir=tmp_path / "from-arg").run(_jaxpr(), PassContext())
    assert len(run_dirs(tmp_path / "from-arg")) == 1
    assert not (tmp_path / "from-env").exists()


def test_repeated_runs_get_distinct_labelled_directories(tmp_path):
    pipeline = Pipeline.parse("td-noop", dump_dir=tmp_path)
    pipeline.run(_jaxpr(), PassContext(), label="encoder/step 1")
    pipeline.run(_jaxpr(), PassContext(), label="encoder/step 1")
    pipeline.run(_jaxpr(), PassContext(results={"label": "decoder"}))
    pipeline.run(_jaxpr(), PassContext())
    dirs = [p.name for p in run_dirs(tmp_path)]
    assert len(set(dirs)) == 4
    assert sum(d.endswith("-encoder_step_1") for d in dirs) == 2
    assert sum(d.endswith("-decoder") for d in dirs) == 1
    assert sum(d.endswith("-run") for d in dirs) == 1


def test_existing_directory_is_never_reused(tmp_path):
    dump = Dump(tmp_path)
    Pipeline.parse("td-noop", instrumentations=[dump]).run(_jaxpr(), PassContext())
    taken = dump.run_dir
    number = int(taken.name.split("-")[0])
    (tmp_path / f"{number + 1:04d}-run").mkdir()  # as another process would leave it
    Pipeline.parse("td-noop", instrumentations=[dump]).run(_jaxpr(), PassContext())
    assert dump.run_dir not in (taken, tmp_path / f"{number + 1:04d}-run")
    assert (dump.run_dir / "01-td-noop.txt").exists()


def test_failing_pass_dumps_the_ir_it_was_given(tmp_path):
    with pytest.raises(PassError):
        Pipeline.parse("td-negate,td-crash", dump_dir=tmp_path).run(_jaxpr(), PassContext())
    (run_dir,) = run_dirs(tmp_path)
    text = (run_dir / "02-td-crash.txt").read_text()
    assert text.startswith("// td-crash failed (ValueError); the IR it was given:\n")
    assert "neg" in text


def test_broken_ir_is_dumped_before_verification_fails(tmp_path):
    with pytest.raises(VerificationError):
        Pipeline.parse("td-corrupt", dump_dir=tmp_path).run(_jaxpr(), PassContext())
    (run_dir,) = run_dirs(tmp_path)
    text = (run_dir / "01-td-corrupt.txt").read_text()
    assert text.startswith("// after td-corrupt (changed)") and "sin" not in text


def test_recorder_keeps_entries_in_memory(tmp_path):
    recorder = Recorder()
    pipeline = Pipeline.parse("td-negate,td-noop", instrumentations=[recorder])
    pipeline.run(_jaxpr(), PassContext())
    assert [name for name, _ in recorder.entries] == ["effectful", "td-negate", "td-noop"]
    assert recorder.entries[1][1].startswith("// after td-negate (changed)\n{ lambda")
    pipeline.run(_jaxpr(), PassContext())
    assert len(recorder.entries) == 3  # the latest run only


def _files(root):
    (run_dir,) = run_dirs(root)
    return run_dir, sorted(p.name for p in run_dir.iterdir())


def test_dump_after_named_passes_only(tmp_path):
    """Files keep their pass's position; a diff is against the IR the pass was given, even
    when the pass before it was not dumped."""
    Pipeline.parse("td-negate,td-noop,td-negate", dump_dir=tmp_path,
                   dump_after=("td-noop",)).run(_jaxpr(), PassContext())
    run_dir, files = _files(tmp_path)
    assert files == ["00-effectful.txt", "02-td-noop.txt"]
    Pipeline.parse("td-noop,td-negate", dump_dir=tmp_path / "b",
                   dump_after="td-negate").run(_jaxpr(), PassContext())
    run_dir, files = _files(tmp_path / "b")
    assert files == ["00-effectful.txt", "02-td-negate.diff", "02-td-negate.txt"]
    diff = (run_dir / "02-td-negate.diff").read_text()
    assert diff.startswith("--- before 02-td-negate\n+++ 02-td-negate\n")
    assert any(line.startswith("+") and "neg" in line for line in diff.splitlines())


def test_dump_only_changed(tmp_path):
    Pipeline.parse("td-negate,td-noop", dump_dir=tmp_path,
                   dump_only_changed=True).run(_jaxpr(), PassContext())
    assert _files(tmp_path)[1] == ["00-effectful.txt", "01-td-negate.diff", "01-td-negate.txt"]
    recorder = Recorder(dump_after=["td-noop", "td-negate"], only_changed=True)
    Pipeline.parse("td-noop,td-negate", instrumentations=[recorder]).run(_jaxpr(), PassContext())
    assert [name for name, _ in recorder.entries] == ["effectful", "td-negate"]


def test_selective_dump_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(DUMP_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(DUMP_AFTER_ENV, "td-noop, td-negate")
    monkeypatch.setenv(DUMP_CHANGED_ENV, "1")
    Pipeline.parse("td-negate,td-noop").run(_jaxpr(), PassContext())
    assert _files(tmp_path)[1] == ["00-effectful.txt", "01-td-negate.diff", "01-td-negate.txt"]
    # The argument wins over the environment.
    Pipeline.parse("td-negate,td-noop", dump_dir=tmp_path / "arg", dump_after=["td-noop"],
                   dump_only_changed=False).run(_jaxpr(), PassContext())
    assert _files(tmp_path / "arg")[1] == ["00-effectful.txt", "02-td-noop.txt"]


def test_dump_after_an_unknown_pass_is_an_error():
    with pytest.raises(PipelineError, match="unknown pass 'td-noopp'"):
        Pipeline.parse("td-noop", dump_after=["td-noopp"])


@dataclasses.dataclass(frozen=True)
class Prepend(Pass):
    """Inserts one equation in front: JAX renames every variable after it."""
    name = "td-prepend"

    def run(self, jaxpr, ctx):
        return jax.make_jaxpr(lambda x: jex.jaxpr_as_fun(jaxpr)(x * 2.0))(jnp.ones(2, jnp.float32))


def _longer(x):
    y = jnp.sin(x) * jnp.cos(x)
    z = jnp.exp(y) + jnp.tanh(x)
    return (z * y).sum(), z - 1.0


def test_diff_ignores_renaming_and_shows_the_inserted_equation(tmp_path):
    jaxpr = jax.make_jaxpr(_longer)(jnp.ones(2, jnp.float32))
    Pipeline.parse("td-prepend", dump_dir=tmp_path).run(jaxpr, PassContext())
    (run_dir,) = run_dirs(tmp_path)
    changed = [line for line in (run_dir / "01-td-prepend.diff").read_text().splitlines()
               if line[:1] in "+-" and not line.startswith(("---", "+++"))]
    # The new mul, and the three equations that read x (sin, cos, tanh), now reading its
    # output; the six other equations and the outputs are context, not changes.
    ops = [line.split("=")[1].split()[0] for line in changed]
    assert sorted(ops) == ["cos", "cos", "mul", "sin", "sin", "tanh", "tanh"], changed
    assert any(line.startswith("+") and "mul a 2.0" in line for line in changed)
    assert len(jaxpr.eqns) == 9     # a diff of the raw texts changes every line


def test_diff_shows_an_operand_change():
    """Variables are matched through their binders, so reading another variable is a change."""
    from varjax.passes.framework.dump import unified_diff
    before = ("{ lambda ; a:f32[2]. let\n    b:f32[2] = sin a\n    c:f32[2] = mul b 2.0:f32[]\n"
              "    var_set[params:w] c\n  in (c, b) }")
    after = ("{ lambda ; a:f32[2]. let\n    b:f32[2] = neg a\n    c:f32[2] = sin b\n"
             "    d:f32[2] = mul c 2.0:f32[]\n    var_set[params:w] d\n  in (d, b) }")
    lines = unified_diff("x", before, "y", after).splitlines()[3:]
    assert [line for line in lines if line[:1] in "+-"] == [
        "-    c:f32[2] = sin a", "+    b:f32[2] = neg a", "+    c:f32[2] = sin b",
        "-  in (d, c) }", "+  in (d, b) }"]


def _stale_a(x):
    return jnp.cos(x)


def _stale_b(x):
    return jax.nn.relu(x) + jnp.linalg.norm(x) + jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)


def test_pretty_shows_no_line_of_another_trace_in_a_cached_body():
    """JAX caches library bodies (``relu``'s and ``norm``'s ``jit``, ``cond`` branches)
    and reuses them in later traces.  One first traced while a pass re-binds an equation
    of another program under that equation's source info (``_jax.source_info_of``) must
    not show that program's line when a later program reuses it: JAX traces nested bodies
    under their own source info, so their equations hold no user line at all."""
    from varjax import _jax
    from varjax.ir.printing import pretty
    x = jnp.ones((7, 5), jnp.float32)        # shapes no other test traces these with
    a_eqn = jax.make_jaxpr(_stale_a)(x).eqns[0]

    def rebind(y):
        with _jax.source_info_of(a_eqn):
            return _stale_b(y)
    first = pretty(jax.make_jaxpr(rebind)(x), source=True, color=False)
    assert "(_stale_a)" in first              # the re-bound top-level equations: A's line
    text = pretty(jax.make_jaxpr(_stale_b)(x), source=True, color=False)
    assert "(_stale_a)" not in text, text     # the shared bodies do not claim it
    assert "(_stale_b)" in text


def test_pretty_keeps_the_lines_of_a_jitted_helper():
    """A jitted function's body has its own lines (JAX stops its traceback at the jit),
    right for every caller."""
    from varjax.ir.printing import pretty

    @jax.jit
    def helper(y):
        return jnp.sin(y)
    text = pretty(jax.make_jaxpr(lambda x: helper(x) + 1.0)(jnp.ones(3)), source=True, color=False)
    assert "(test_pretty_keeps_the_lines_of_a_jitted_helper.<locals>.helper)" in text
