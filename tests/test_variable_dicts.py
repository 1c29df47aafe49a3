"""The one nested <-> flat translation of variables dicts (``varjax.trace.variable_dicts``)."""
from __future__ import annotations

import ast
from pathlib import Path

import jax.numpy as jnp
import pytest

from varjax.ir import errors
from varjax.trace.variable_dicts import (
    nested_set,
    unflatten_variables,
    variable_entries,
    variable_values,
)

ROOT = Path(__file__).resolve().parent.parent
_TRANSLATION = {"flatten_variables", "unflatten_variables", "variable_values", "variable_entries",
                "nested_set"}


def test_variable_values_and_unflatten_variables_are_inverse():
    variables = {"params": {"a": {"w": jnp.ones(2)}, "b": 1.0}, "stats": {"n": (jnp.zeros(()),)}}
    flat = variable_values(variables)
    assert list(flat) == [("params", ("a", "w")), ("params", ("b",)), ("stats", ("n",))]
    assert unflatten_variables(flat) == variables


def test_variable_values_checks_the_values_and_variable_entries_does_not():
    odd = {"params": {"w": None, "s": "text"}, "whole": object}
    with pytest.raises(errors.InvalidVariablesError, match="is None"):
        variable_values(odd)
    assert list(variable_entries(odd)) == [(("params", ("w",)), None), (("params", ("s",)), "text"),
                                           (("whole", ()), object)]


def test_nested_set_makes_the_scopes_on_the_way():
    tree: dict = {"a": {"x": 1}}
    nested_set(tree, ("a", "b", "c"), 2)
    assert tree == {"a": {"x": 1, "b": {"c": 2}}}


def test_every_module_imports_the_variables_dict_translation_from_variable_dicts():
    """No layer re-exports it: an import of one of its functions names the module itself."""
    wrong = []
    for folder in ("varjax", "passes", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module != "varjax.trace.variable_dicts":
                    wrong += [f"{path.relative_to(ROOT)}: {a.name} from {node.module}"
                              for a in node.names if a.name in _TRANSLATION]
    assert wrong == []
