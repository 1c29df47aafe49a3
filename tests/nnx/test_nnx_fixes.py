"""Small fixes against flax.nnx 0.12.8: ``set_view`` on Dropout and BatchNorm (``nnx.view``,
``nnx.view_info``), ``Perturbation`` an ``Intermediate``, and Variables with logical
``out_sharding`` names under ``nnx.jit`` on a mesh (the ``shard-variables`` pass)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as fnnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import varjax as vj
from varjax import errors, nnx
from varjax.nnx import module_helpers as mh
from varjax.nnx import spmd
from varjax.nnx.normalization import BatchNorm
from varjax.nnx.stochastic import Dropout
from varjax.nnx.variablelib import Intermediate, Perturbation

X = jnp.arange(6.0).reshape(2, 3) / 5
LAYERS = {nnx: (Dropout, BatchNorm), fnnx: (fnnx.Dropout, fnnx.BatchNorm)}


def _block(lib):
    dropout, batch_norm = LAYERS[lib]

    class Block(lib.Module):
        def __init__(self, rngs):
            self.linear = lib.Linear(3, 3, rngs=rngs)
            self.dropout = dropout(0.5, rngs=rngs)
            self.bn = batch_norm(3, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.bn(self.linear(x)))
    return Block(lib.Rngs(0))


@pytest.fixture(scope="module")
def blocks():
    return _block(nnx), _block(fnnx)


# --- set_view ------------------------------------------------------------------------------

def test_view_sets_deterministic_and_use_running_average_on_a_copy_as_flax(blocks):
    ours, theirs = blocks
    mine = nnx.view(ours, deterministic=True, use_running_average=True)
    flax_ = fnnx.view(theirs, deterministic=True, use_running_average=True)
    assert (mine.dropout.deterministic, mine.bn.use_running_average) == \
        (flax_.dropout.deterministic, flax_.bn.use_running_average) == (True, True)
    assert (ours.dropout.deterministic, ours.bn.use_running_average) == (False, False)
    assert mine.bn.mean is ours.bn.mean and mine.linear.kernel is ours.linear.kernel
    np.testing.assert_array_equal(mine(X), flax_(X))      # no mask, running averages


def test_view_only_dropout_leaves_batchnorm_as_flax(blocks):
    ours, theirs = blocks
    mine = nnx.view(ours, only=Dropout, deterministic=True)
    flax_ = fnnx.view(theirs, only=fnnx.Dropout, deterministic=True)
    assert (mine.dropout.deterministic, mine.bn.use_running_average) == \
        (flax_.dropout.deterministic, flax_.bn.use_running_average) == (True, False)


def test_set_view_of_none_keeps_the_attribute_as_flax():
    for lib in (nnx, fnnx):
        dropout, batch_norm = LAYERS[lib]
        d, bn = dropout(0.5, deterministic=True), batch_norm(2, use_running_average=True,
                                                            rngs=lib.Rngs(0))
        d.set_view()
        bn.set_view(None)
        assert (d.deterministic, bn.use_running_average) == (True, True)


def test_view_info_of_dropout_and_batchnorm_is_flax_text(blocks):
    ours, theirs = blocks
    text = mh.view_info(ours)
    assert text == fnnx.view_info(theirs)
    assert text.startswith("BatchNorm:\n  use_running_average: bool | None = None\n")
    assert "Dropout:\n  deterministic: bool | None = None\n    if True, disables dropout " \
           "masking." in text


def test_view_of_an_option_no_layer_takes_names_it(blocks):
    with pytest.raises(errors.ConfigError, match="decode") as info:
        nnx.view(blocks[0], deterministic=True, decode=True)
    assert "test_nnx_fixes.py" in str(info.value)
    with pytest.raises(ValueError):
        fnnx.view(blocks[1], deterministic=True, decode=True)


# --- Perturbation is an Intermediate ---------------------------------------------------------

def _sown(lib):
    class Sown(lib.Module):
        def __init__(self):
            self.i = lib.Intermediate(jnp.ones(2))
            self.p = lib.Perturbation(jnp.zeros(2))
    return Sown()


def _same(ours, theirs):
    a, b = nnx.to_pure_dict(ours), fnnx.to_pure_dict(theirs)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_perturbation_is_an_intermediate_as_flax():
    assert issubclass(Perturbation, Intermediate) and issubclass(fnnx.Perturbation,
                                                                 fnnx.Intermediate)
    assert nnx.variable_name_from_type(Perturbation) == \
        fnnx.variable_name_from_type(fnnx.Perturbation) == "perturbations"


def test_state_of_intermediate_includes_perturbations_as_flax():
    ours, theirs = _sown(nnx), _sown(fnnx)
    _same(nnx.state(ours, Intermediate), fnnx.state(theirs, fnnx.Intermediate))
    _same(nnx.state(ours, Perturbation), fnnx.state(theirs, fnnx.Perturbation))
    assert set(nnx.state(ours, Intermediate)) == {"i", "p"}
    assert set(nnx.state(ours, Perturbation)) == {"p"}


def test_a_perturbation_keeps_its_own_collection():
    """A collection name selects that collection only (SPEC §6), as 'params' does not
    select a LoRAParam."""
    model = _sown(nnx)
    assert set(nnx.state(model, "intermediates")) == {"i"}
    assert set(nnx.state(model, "perturbations")) == {"p"}
    assert sorted(vj.state(model)) == ["intermediates", "perturbations"]


# --- logical out_sharding names under nnx.jit ------------------------------------------------

MESH = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
RULES = (("embed", "model"),)


def _linear(lib, with_partitioning):
    return lib.Linear(2, 3, kernel_init=with_partitioning(lib.initializers.lecun_normal(),
                                                          ("embed", None)), rngs=lib.Rngs(0))


def _constraints(jaxpr):
    """The specs of every sharding constraint in ``jaxpr`` and the jaxprs inside it."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == "sharding_constraint":
            found.append(e.params["sharding"].spec)
        for p in e.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                found += _constraints(inner)
    return found


def test_logical_names_under_nnx_jit_are_constrained_through_the_rules_as_flax_shards_them():
    x = jnp.ones((1, 2))
    with jax.set_mesh(MESH), fnnx.logical_axis_rules(RULES):
        theirs = _linear(fnnx, fnnx.with_partitioning)      # flax.nnx shards when made
        placed = theirs.kernel[...].sharding.spec
        want = fnnx.jit(lambda m, x: m(x))(theirs, x)
    ours = _linear(nnx, spmd.with_partitioning)
    f = nnx.jit(lambda m, x: m(x))
    with jax.set_mesh(MESH), spmd.logical_axis_rules(RULES):
        np.testing.assert_array_equal(f(ours, x), want)
        specs = _constraints(jax.make_jaxpr(f)(ours, x).jaxpr)
    assert specs == [placed] == [P("model", None)]


def test_an_unmapped_logical_name_under_nnx_jit_is_an_error_naming_the_variable():
    """flax.nnx raises JAX's ValueError when it shards the Variable; varjax a
    PartitioningError (a ValueError) where the pass places it, naming the variable."""
    with jax.set_mesh(MESH):
        with pytest.raises(ValueError, match="embed"):
            _linear(fnnx, fnnx.with_partitioning)
        model = _linear(nnx, spmd.with_partitioning)
        with pytest.raises(errors.PartitioningError,
                           match=r"kernel of collection 'params'.*'embed' is no axis") as info:
            nnx.jit(lambda m, x: m(x))(model, jnp.ones((1, 2)))
    assert isinstance(info.value, ValueError) and "test_nnx_fixes.py" in str(info.value)


def test_an_unmapped_logical_name_of_a_variable_made_under_nnx_jit_is_an_error():
    with jax.set_mesh(MESH):
        with pytest.raises(errors.PartitioningError, match=r"a Variable of collection "
                           r"'params' made inside the transform.*'embed' is no axis") as info:
            nnx.jit(lambda: _linear(nnx, spmd.with_partitioning))()
    assert info.value.collection == "params"
