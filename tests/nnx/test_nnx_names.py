"""``varjax.nnx`` has every public name of ``flax.nnx``: built, or listed in ``unbuilt.NOT_YET``
with the part it belongs to, where using it raises ``NotProvidedError`` saying so."""
import re

import flax.nnx
import pytest

import varjax.nnx as nnx
from varjax import errors
from varjax.nnx import unbuilt


def _public(module) -> set[str]:
    return {n for n in dir(module) if not n.startswith("_")}


def test_every_flax_nnx_name_is_built_or_listed_with_its_reason():
    flax_names = _public(flax.nnx)
    assert flax_names - set(nnx.__all__) - set(unbuilt.NOT_YET) == set()
    assert set(nnx.__all__) - flax_names == set()              # nothing extra
    assert set(nnx.__all__) & set(unbuilt.NOT_YET) == set()    # a built name leaves the table
    assert set(unbuilt.NOT_YET) <= flax_names
    assert _public(nnx) == flax_names


def test_an_unbuilt_name_raises_not_provided_naming_its_part():
    with pytest.raises(errors.NotProvidedError, match="nnx.summary .*internal submodules") as info:
        nnx.summary
    assert __file__ in info.value.source
    for name, why in unbuilt.NOT_YET.items():
        with pytest.raises(NotImplementedError, match=re.escape(why)):
            getattr(nnx, name)


def test_a_submodule_named_as_an_unbuilt_name_still_imports():
    from varjax.nnx import transforms  # noqa: F401  (flax.nnx has a `transforms` too)


def test_a_name_flax_nnx_does_not_have_is_an_attribute_error():
    with pytest.raises(AttributeError):
        nnx.no_such_name


def test_nnx_variables_is_state_as_in_flax_nnx_and_variablelib_the_variable_module():
    assert nnx.variables is nnx.state
    assert nnx.variablelib.Variable is nnx.Variable
