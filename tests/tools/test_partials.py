"""``functools.partial`` targets: ``vj.functionalize``, ``vj.dump``, the summary and the
command line take a partial of a function, of a module, or of a module's method, and name
it after the function it wraps (a partial has no ``__name__``)."""
import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn
from varjax.tools.cli import main
from varjax.tools.model_summary import summary

X = jnp.arange(6.0).reshape(2, 3)


def scaled(x, scale):
    w = vj.param("w", jax.nn.initializers.ones, (1, x.shape[-1]))
    return w * x * scale


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, scale=1.0):
        return nn.Dense(2)(x) * scale

    def encode(self, x, scale=1.0):
        return self(x) * scale


def test_functionalize_of_a_partial_is_named_for_its_function_and_computes_it():
    fz = vj.functionalize(functools.partial(scaled, scale=2.0))
    assert fz.__name__ == "scaled"
    variables = fz.init(jax.random.key(0), X)
    np.testing.assert_array_equal(fz.apply(variables, X), 2.0 * X)   # w is ones


@pytest.mark.parametrize("target, name", [
    (functools.partial(scaled, scale=2.0), "scaled"),
    (functools.partial(Net(), scale=2.0), "Net.__call__"),
    (functools.partial(Net().encode, scale=2.0), "Net.encode"),
])
def test_dump_of_a_partial_traces_the_call_it_wraps(target, name):
    from varjax.tools.target import as_functionalized

    fz = as_functionalized(target)
    assert fz.__name__ == name
    variables = fz.init(jax.random.key(0), X)
    entries = vj.dump(target, X, variables=variables)
    assert entries and "var_get" in entries[0][1]


def test_partial_of_a_module_method_keeps_its_arguments():
    """The partial's keyword reaches the method: the output is the method's with it."""
    from varjax.tools.target import as_functionalized

    variables = Net().init(jax.random.key(0), X)
    fz = as_functionalized(functools.partial(Net().encode, scale=3.0))
    np.testing.assert_allclose(fz.apply(variables, X), 3.0 * Net().apply(variables, X), rtol=1e-6)


def test_summary_of_a_partial_module_counts_its_variables():
    table = summary(functools.partial(Net(), scale=2.0), X)
    assert table.totals()["params"].count == 3 * 2 + 2


def test_command_line_dumps_a_partial(tmp_path, capsys):
    path = tmp_path / "partial_model.py"
    path.write_text(textwrap.dedent('''
        import functools
        import jax
        import varjax as vj


        def scaled(x, scale):
            return vj.param("w", jax.nn.initializers.ones, (1, x.shape[-1])) * x * scale


        loss = functools.partial(scaled, scale=2.0)
    '''))
    assert main(["dump", f"{path}:loss", "--shape", "x=f32[2,3]", "--after", "discharge"]) == 0
    assert "f32[1,3]" in capsys.readouterr().out
