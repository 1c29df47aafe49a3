"""Pass options are checked, not trusted: a bad value fails when the pass is made, an option
that selects nothing fails instead of doing nothing, variables a pass declares are
type-checked like the model's, and two passes may not create one collection's variables."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import varjax.nn as nn
from varjax import errors
from varjax.passes import CastParams, Lora, Pipeline
from varjax.passes.library.lora import merge

X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
KEY = jax.random.key(0)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(jax.nn.relu(nn.Dense(3)(x)))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return nn.Dense(4)(x), None


class Scanned(nn.Module):
    """Every kernel lives in a lifted body."""

    @nn.compact
    def __call__(self, x):
        return nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=2)()(x, None)[0]


# --- item 15: bad option values fail when the pipeline is parsed -------------------------

@pytest.mark.parametrize("spec, message", [
    ("lora{rank=0}", "rank must be 1 or more, got 0"),
    ("lora{rank=-1}", "rank must be 1 or more, got -1"),
    ("lora{targets=[}", r"targets is not a regular expression \(unterminated character set"),
    ("lora{collection=params}", "collection must not be params"),
    ("cast-params{dtype=foo}", "dtype is not a dtype name"),
    ("cast-params{dtype=int8}", "dtype must be a floating dtype"),
    ("stop-gradient{collection=__rngs__}", "names one of varjax's own collections"),
    ("stop-gradient{collection=params,under=a//b}", "under has an empty name"),
    ("tie{src=a,dst=/}", "dst must name a variable"),
    ("fake-quant{collection=}", "collection must be a collection name"),
])
def test_bad_option_values_are_a_pipeline_error_when_parsed(spec, message):
    with pytest.raises(errors.PipelineError, match=message) as e:
        Pipeline.parse(spec)
    assert f"pass '{spec.partition('{')[0]}'" in str(e.value)
    assert "valid options:" in str(e.value)


def test_bad_option_values_are_refused_when_a_pass_is_made_in_python():
    with pytest.raises(errors.PipelineError, match="rank must be 1 or more, got 0"):
        Lora(rank=0)
    with pytest.raises(errors.PipelineError, match="rank must be a int, got '2'"):
        Lora(rank="2")
    assert CastParams(dtype=jnp.float16).spec() == "cast-params{dtype=float16}"


def test_naming_a_default_pass_that_discharges_again_is_a_pipeline_error():
    with pytest.raises(errors.PipelineError, match="discharges twice") as e:
        MLP().apply(MLP().init(KEY, X), X, passes="discharge")
    assert "name 'discharge' once" in str(e.value)


# --- item 6: an option that selects nothing fails ---------------------------------------

@pytest.fixture(scope="module")
def mlp_vars():
    return MLP().init(KEY, X)


@pytest.mark.parametrize("spec, option, listed", [
    ("stop-gradient{collection=params,under=Dense_9}", "under=Dense_9", "Dense_0, Dense_1"),
    ("stop-gradient{collection=parms}", "collection=parms", "the collections are: params."),
    ("fake-quant{collection=parms}", "collection=parms", "the collections are: params."),
    ("lora{targets=zzz}", "targets=zzz", "params variables are: Dense_0/bias, Dense_0/kernel, Dense_1/bias"),
])
def test_an_option_that_selects_nothing_names_itself_and_what_exists(mlp_vars, spec, option, listed):
    with pytest.raises(errors.PipelineError) as e:
        MLP().apply(mlp_vars, X, passes=spec)
    message = str(e.value)
    assert f"option {option}" in message and "would do nothing" in message
    assert listed in message
    assert "test_pass_options.py" in message      # the user's line


def test_options_selecting_only_variables_of_a_lifted_body_are_not_refused():
    specs = "stop-gradient{collection=params,under=ScanBlock_0/Dense_0},lora{rank=2}"
    v = Scanned().init(KEY, X, passes=specs)
    assert jax.tree.map(jnp.shape, v["lora"]) == {
        "ScanBlock_0": {"Dense_0": {"kernel": {"a": (2, 4, 2), "b": (2, 2, 4)}}}}
    Scanned().apply(v, X, passes=specs)


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        return nn.BatchNorm(use_running_average=not train)(nn.Dense(3)(x))


def test_a_collection_only_written_in_init_or_only_given_in_apply_is_not_refused():
    spec = "stop-gradient{collection=batch_stats}"
    v = Normed().init(KEY, X, False, passes=spec)
    assert "batch_stats" in v
    Normed().apply(v, X, True, passes=spec, mutable=["batch_stats"])


# --- item 7: pass-declared variables are type-checked; one creator per collection -------

def test_adapters_of_another_rank_are_a_variable_shape_error():
    v = MLP().init(KEY, X, passes="lora{rank=4}")
    with pytest.raises(errors.VariableShapeError) as e:
        MLP().apply(v, X, passes="lora{rank=2}")
    message = str(e.value)
    assert "collection: lora" in message and "kernel/a" in message
    assert "float32[4,4]" in message and "float32[4,2]" in message
    assert "lora{rank=2" in message       # the fix names the options in force


def test_two_passes_creating_one_collections_variables_is_a_pipeline_error():
    with pytest.raises(errors.PipelineError, match="both create the variables of collection 'lora'"):
        MLP().init(KEY, X, passes="lora{rank=4},lora{rank=2}")
    Pipeline.parse("lora{rank=4},lora{rank=2,collection=lora2}")    # two collections: fine


# --- item 16: merge names an adapter whose kernel params lacks ---------------------------

def test_merge_of_an_adapter_whose_kernel_params_lacks_names_both():
    v = MLP().init(KEY, X, passes="lora{rank=2}")
    params = {"Dense_0": v["params"]["Dense_0"]}
    with pytest.raises(errors.MissingVariableError) as e:
        merge({**v, "params": params})
    message = str(e.value)
    assert "lora:Dense_1/kernel" in message and "it has: Dense_0" in message
    with pytest.raises(errors.MissingVariableError, match="at Dense_1 it has: bias"):
        merge({**v, "params": {**v["params"], "Dense_1": {"bias": v["params"]["Dense_1"]["bias"]}}})
