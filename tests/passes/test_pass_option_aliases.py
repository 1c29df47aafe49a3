"""A pass option annotated with a ``vj.typing`` alias (``CastParams.dtype: Dtype``) is given
in a pipeline string as text and kept as that text: the alias names what Python may pass,
and the pass reads the name itself."""
from __future__ import annotations

import typing

import jax.numpy as jnp
import pytest

from varjax import errors
from varjax.ir.typing import Dtype
from varjax.passes import CastParams, Pipeline


def test_cast_params_dtype_option_is_annotated_with_the_dtype_alias():
    assert typing.get_type_hints(CastParams)["dtype"] is Dtype


def test_an_alias_annotated_option_parsed_from_text_stays_its_text():
    (cast,) = Pipeline.parse("cast-params{dtype=float16}").passes
    assert cast.dtype == "float16" and type(cast.dtype) is str
    assert cast == CastParams(dtype="float16") and hash(cast) == hash(CastParams(dtype="float16"))
    assert str(Pipeline.parse(str(Pipeline([cast])))) == "cast-params{dtype=float16}"


def test_an_alias_annotated_option_still_takes_a_dtype_in_python_and_checks_its_constraint():
    assert CastParams(dtype=jnp.bfloat16).spec() == "cast-params{dtype=bfloat16}"
    with pytest.raises(errors.PipelineError, match="dtype must be a floating dtype"):
        Pipeline.parse("cast-params{dtype=int8}")
