"""``vj.dump`` and the readable printer ``vj.pretty``."""
import jax
import jax.numpy as jnp
import pytest

import varjax as vj
import varjax.nn as nn
from varjax import errors

X = jnp.ones(3)


class MLP(nn.Module):
    def setup(self):
        self.hidden = nn.Dense(3)
        self.out = nn.Dense(2)

    def __call__(self, x):
        return self.out(nn.relu(self.hidden(x)))

    def encode(self, x):
        return self.hidden(x)


@pytest.fixture(scope="module")
def mlp_vars():
    return MLP().init(jax.random.key(0), X)


def test_dump_lists_the_effectful_ir_then_every_pass(mlp_vars):
    entries = vj.dump(MLP(), X, variables=mlp_vars)
    assert [name for name, _ in entries] == [
        "effectful", "check-mutability", "lower-rng", "forward-stores", "dead-reads", "shard-variables",
        "discharge"]
    assert "var_get[params:hidden/kernel]" in entries[0][1]
    assert "var_get" not in entries[-1][1]                 # discharged: pure
    assert "test_vj_dump.py" in entries[0][1]                  # source lines by default


def test_dump_accepts_functions_functionalized_and_module_methods(mlp_vars):
    def plain(x):
        return x * vj.param("w", jax.nn.initializers.ones, (3,))
    w = {"params": {"w": jnp.ones(3)}}
    assert "var_get[params:w]" in vj.dump(plain, X, variables=w)[0][1]
    assert "var_get[params:w]" in vj.dump(vj.functionalize(plain), X, variables=w)[0][1]
    encode = vj.dump(MLP().encode, X, variables=mlp_vars)[0][1]
    assert "hidden/kernel" in encode and "out/kernel" not in encode


def test_dump_adds_extra_passes(mlp_vars):
    entries = vj.dump(MLP(), X, variables=mlp_vars, passes="cast-params{dtype=bfloat16}")
    names = [name for name, _ in entries]
    assert "cast-params" in names
    assert "bf16" in dict(entries)["cast-params"]


def test_dump_to_a_directory_writes_numbered_files_and_diffs(mlp_vars, tmp_path):
    entries = vj.dump(MLP(), X, variables=mlp_vars, to=tmp_path, source=False)
    (run_dir,) = tmp_path.iterdir()
    files = sorted(p.name for p in run_dir.iterdir())
    assert files[0] == "00-effectful.txt" and "06-discharge.txt" in files
    assert "06-discharge.diff" in files and "01-check-mutability.diff" not in files   # unchanged
    assert (run_dir / "00-effectful.txt").read_text().split("\n", 2)[2].rstrip() == \
        entries[0][1].split("\n", 2)[2].rstrip()
    assert "test_vj_dump.py" not in entries[0][1]


def test_dump_to_a_directory_writes_once_even_when_the_dump_environment_variable_is_set(
        mlp_vars, tmp_path, monkeypatch):
    monkeypatch.setenv("VARJAX_DUMP_DIR", str(tmp_path))
    vj.dump(MLP(), X, variables=mlp_vars, to=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1      # the explicit Dump replaces the default one


def test_dump_of_a_failing_pipeline_raises_the_varjax_error(tmp_path):
    def writes(x):
        vj.variable("stats", "n").value = x
        return x
    with pytest.raises(errors.ImmutableCollectionError):
        vj.dump(writes, X, variables={"stats": {"n": X}}, to=tmp_path)
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "00-effectful.txt").exists()


def test_dump_of_something_that_is_not_code_raises():
    with pytest.raises(TypeError, match="cannot inspect"):
        vj.dump(42, X)


def test_pretty_annotates_every_equation_with_module_and_source(mlp_vars):
    jaxpr = MLP().functionalize().jaxpr(X, variables=mlp_vars, mutable=True)
    text = vj.pretty(jaxpr, source=True, color=False)
    (line,) = [ln for ln in text.splitlines() if "var_get[params:out/bias]" in ln]
    assert "# MLP/out" in line and "test_vj_dump.py" in line
    assert text.splitlines()[0].endswith("# effects { Var[params] }")     # on the header line
    assert ": { Var[" not in text


def test_pretty_shows_effects_on_nested_bodies_and_annotates_writes():
    @vj.functionalize
    def counted(x):
        n = vj.variable("stats", "n", jnp.zeros, (), jnp.int32)

        def body(c, _):
            n.value += 1
            return c, None
        return jax.lax.scan(body, x, None, length=2)[0]
    variables = counted.init(jax.random.key(0), X)
    text = vj.pretty(counted.jaxpr(X, variables=variables, mutable=True), source=True, color=False)
    (body_header,) = [ln for ln in text.splitlines() if "jaxpr={ lambda" in ln]
    assert body_header.endswith("# effects { Var[stats] }")
    (write,) = [ln for ln in text.splitlines() if "var_set[stats:n]" in ln]
    assert "test_vj_dump.py" in write                           # JAX's printer shows none for it


def test_pretty_colours_only_when_asked(mlp_vars):
    jaxpr = MLP().functionalize().jaxpr(X, variables=mlp_vars)
    assert "\x1b[" in vj.pretty(jaxpr, color=True)
    assert "\x1b[" not in vj.pretty(jaxpr, color=False)
    assert "\x1b[" not in vj.pretty(jaxpr)                   # pytest's stdout is not a terminal


def test_a_module_class_instead_of_an_instance_is_a_clear_error():
    with pytest.raises(TypeError, match="Module class: pass an instance"):
        vj.dump(MLP, X)
