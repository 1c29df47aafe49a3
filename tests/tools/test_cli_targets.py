"""What ``python -m varjax`` can reach (issue 38): keyword arguments (``--kw train=true``),
partials of a Module class, functions over a module, the refusal of a class it cannot
build, and the names of the pure IR's inputs.  In-process through ``main`` (no subprocess)."""
import functools
import re
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from varjax.ir import errors
from varjax.tools.cli import main, parse_keyword
from varjax.tools.cli_target import load_target
from varjax.tools.target import as_functionalized

MODEL = '''
from __future__ import annotations

import functools

import jax

import varjax as vj
import varjax.nn as nn


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(4)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dropout(0.5, deterministic=not train)(x)


class Wide(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features)(x)


def doubled(model: Net, x, train=False):
    return 2 * model(x, train=train)


def widened(model: Wide, x):
    return model(x)


def builds_its_own(x):
    return Net()(x)


def shifted(x, shift):
    return x * vj.param("w", jax.nn.initializers.ones, (2,)) + shift


wide3 = functools.partial(Wide, features=3)
widened5 = functools.partial(widened, Wide(features=5))
'''


def _line(text: str) -> int:
    """The line of the model file that starts with ``text``."""
    lines = textwrap.dedent(MODEL).splitlines()
    return 1 + next(i for i, line in enumerate(lines) if line.startswith(text))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_targets") / "cli_targets_model.py"
    path.write_text(textwrap.dedent(MODEL))
    return path


def test_kw_values_are_python_literals_or_shell_words():
    assert parse_keyword("train=true") == ("train", True)
    assert parse_keyword("train=False") == ("train", False)
    assert parse_keyword("mask=none") == ("mask", None)
    assert parse_keyword("n=3") == ("n", 3) and parse_keyword("rate=0.5") == ("rate", 0.5)
    assert parse_keyword("shape=(2, 3)") == ("shape", (2, 3))
    assert parse_keyword("mode='fast'") == ("mode", "fast") == parse_keyword("mode=fast")
    for bad in ("train", "=1", "2x=1"):
        with pytest.raises(Exception, match="expected NAME=VALUE"):
            parse_keyword(bad)


def _access(out: str, collection: str) -> set[str]:
    """The summary's access column for ``collection``'s rows."""
    return {line.split("|")[-1].strip() for line in out.splitlines()
            if line.split("|")[1:2] and line.split("|")[1].strip() == collection}


def test_kw_train_true_reaches_the_call(model, capsys):
    assert main(["summary", f"{model}:Net", "--shape", "x=f32[2,3]", "--detail"]) == 0
    assert _access(capsys.readouterr().out, "batch_stats") == {"read"}
    assert main(["summary", f"{model}:Net", "--shape", "x=f32[2,3]", "--detail",
                 "--kw", "train=true"]) == 0
    assert _access(capsys.readouterr().out, "batch_stats") == {"read/write"}


def test_repeated_or_unknown_kw_is_a_usage_error(model, capsys):
    for argv, message in (
            (["--kw", "train=true", "--kw", "train=false"], "--kw train given more than once"),
            (["--kw", "rate=0.5"], "got an unexpected keyword argument 'rate'; its parameters "
                                   "are (x, train: 'bool' = False)"),
            (["--shape", "y=f32[2]", "--shape", "z=f32[2]"],
             "cannot be called with 3 --shape argument(s): too many positional arguments")):
        with pytest.raises(SystemExit) as exit:
            main(["summary", f"{model}:Net", "--shape", "x=f32[2,3]", *argv])
        assert exit.value.code == 2 and message in capsys.readouterr().err


def test_partial_of_a_module_class_is_the_instance_it_builds(model, capsys):
    built = load_target(f"{model}:wide3")
    assert type(built).__name__ == "Wide" and built.features == 3
    assert main(["summary", f"{model}:wide3", "--shape", "x=f32[2,2]"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()]
    assert ["Dense_0", "2 arrays, 9 (36 B)"] in [[c.strip() for c in row] for row in rows]


def _loaded(model, name):
    """``load_target``'s answer and the file's module it executed (its classes are the ones
    the target holds: each load executes the file again)."""
    return load_target(f"{model}:{name}"), sys.modules["cli_targets_model"]


def test_function_over_a_module_runs_it_bound_as_apply_method_does(model, capsys):
    target, module = _loaded(model, "doubled")
    assert isinstance(target, functools.partial) and type(target.args[0]) is module.Net
    x = jnp.arange(6.0).reshape(2, 3)
    variables = module.Net().init(jax.random.key(0), x)
    np.testing.assert_array_equal(as_functionalized(target).apply(variables, x),
                                  module.Net().apply(variables, x, method=module.doubled))
    assert main(["dump", f"{model}:doubled", "--shape", "x=f32[2,3]", "--after",
                 "discharge"]) == 0
    out = capsys.readouterr().out
    assert "params/Dense_0/kernel" in out and "mul 2.0" in out


def test_partial_over_a_module_instance_keeps_its_fields(model, capsys):
    target, module = _loaded(model, "widened5")
    x = jnp.ones((1, 2))
    variables = module.Wide(features=5).init(jax.random.key(0), x)
    expected = module.Wide(features=5).apply(variables, x, method=module.widened)
    np.testing.assert_array_equal(as_functionalized(target).apply(variables, x), expected)
    entries = vj.dump(target, x, variables=variables, source=False)
    assert "var_get[params:Dense_0/kernel]" in dict(entries)["effectful"]
    assert main(["summary", f"{model}:widened5", "--shape", "x=f32[1,2]"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()]
    assert ["Dense_0", "2 arrays, 15 (60 B)"] in [[c.strip() for c in row] for row in rows]


@pytest.mark.parametrize("name, fix", [
    ("Wide", "name an instance in the file (model = Wide(features=...)) and give FILE:model"),
    ("widened", "(widened_bound = functools.partial(widened, Wide(features=...))) and give "
                "FILE:widened_bound")])
def test_module_class_with_required_fields_is_refused_asking_for_an_instance(model, capsys,
                                                                             name, fix):
    with pytest.raises(errors.ModuleError, match="required fields: features"):
        load_target(f"{model}:{name}")
    assert main(["dump", f"{model}:{name}", "--shape", "x=f32[1,2]"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"varjax: ModuleError: {model}:{name}: the command line builds Wide "
                          "with no arguments, but it has required fields: features.")
    assert f"at:         {model}:{_line('class Wide')}" in err and fix in err and "Traceback" not in err


def test_function_building_its_own_module_is_told_how_to_pass_it(model, capsys):
    assert main(["summary", f"{model}:builds_its_own", "--shape", "x=f32[1,3]"]) == 1
    err = capsys.readouterr().err
    assert "UnboundModuleError" in err
    assert f"cli_targets_model.py:{_line('    return Net()(x)')} (builds_its_own)" in err
    assert "take it as the function's first parameter" in err and "Traceback" not in err
    assert "functools.partial(builds_its_own, Net(...))" in err


def test_pure_ir_inputs_are_named_by_variable_path_and_shape_name(model, capsys):
    assert main(["dump", f"{model}:Net", "--shape", "x=f32[2,3]", "--kw", "train=true",
                 "--rng", "dropout", "--mutable", "batch_stats", "--after", "discharge"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "// after discharge (changed)" and lines[1].startswith("// inputs: ")
    named = [line[3:] for line in lines[1:] if line.startswith("// ")]
    names = dict(pair.split("=") for text in named for pair in text.split()[text == named[0]:])
    main_jaxpr = "\n".join(lines[next(i for i, line in enumerate(lines) if line.startswith("{")):])
    binders = dict(re.findall(r"(\w+):(\S+)", main_jaxpr.split(". let")[0].split(";")[1]))
    types = {names[letter]: binders[letter] for letter in names}
    assert types == {"rngs/dropout": "key<fry>[]", "x": "f32[2,3]",
                     "batch_stats/BatchNorm_0/mean": "f32[4]",
                     "batch_stats/BatchNorm_0/var": "f32[4]",
                     "params/BatchNorm_0/bias": "f32[4]", "params/BatchNorm_0/scale": "f32[4]",
                     "params/Dense_0/bias": "f32[4]", "params/Dense_0/kernel": "f32[3,4]"}
    assert "# Net/Dropout_0" in main_jaxpr  # train=true reached Dropout: it draws a mask


def test_arguments_are_named_in_order_even_when_names_repeat(model, capsys):
    assert main(["dump", f"{model}:shifted", "--shape", "x=f32[2]", "--shape", "x=f32[1]",
                 "--after", "discharge"]) == 0
    assert "// inputs: a=params/w b=x c=x\n{ lambda ; a:f32[2] b:f32[2] c:f32[1]. let" in \
        capsys.readouterr().out
