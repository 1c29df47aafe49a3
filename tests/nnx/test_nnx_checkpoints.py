"""Checkpoints both ways (issue 36 item 4): flax.nnx's checkpointing guide walked with
varjax.nnx, each checkpoint written by one library and read by the other.

A model's ``nnx.state`` saved with Orbax restores into an abstract model (``nnx.eval_shape``
then ``nnx.split``) of either library, shardings and their metadata included; so does its
``nnx.to_pure_dict``, restored without a target and put in with ``replace_by_pure_dict``; a
flat state's ``(path, value)`` pairs are the same in both.  Both libraries build the models
from the same seeds, so every restored value is compared bitwise with the saved one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx as flax_nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from varjax import errors, nnx

LIBS = {"varjax": nnx, "flax": flax_nnx}
PAIRS = [(src, dst) for src in LIBS for dst in LIBS]
X = jax.random.normal(jax.random.key(42), (3, 4))
MESH = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))


def _mlp(lib, bias: bool = False, seed: int = 0):
    """The guide's TwoLayerMLP (``bias=True``: its ModifiedTwoLayerMLP), with an ``nnx.List``
    (an index in its paths), a BatchNorm (batch statistics) and a Dropout (RNG state).  Its
    call reads its state only, so the saved models stay as saved."""

    class TwoLayerMLP(lib.Module):
        def __init__(self, dim, rngs):
            self.linear1 = lib.Linear(dim, dim, rngs=rngs, use_bias=bias)
            self.linear2 = lib.Linear(dim, dim, rngs=rngs, use_bias=bias)
            self.blocks = lib.List([lib.BatchNorm(dim, use_running_average=True, rngs=rngs)])
            self.drop = lib.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.blocks[0](self.linear2(self.linear1(x)))

    return TwoLayerMLP(4, rngs=lib.Rngs(seed, dropout=seed + 1))


def _sharded(lib):
    class Sharded(lib.Module):
        def __init__(self, rngs):
            init = lib.with_partitioning(lib.initializers.lecun_normal(), (None, "model"))
            self.linear = lib.Linear(4, 2, kernel_init=init, rngs=rngs)

    return Sharded(lib.Rngs(0))


def _plain(x):
    return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x)


def _pairs(state, lib):
    """The state's ``(path, value)`` pairs, values as NumPy arrays (a key as its data)."""
    return [(p, _plain(v.get_value() if isinstance(v, lib.Variable) else v))
            for p, v in lib.to_flat_state(state)]


def _assert_same(ours, theirs) -> None:
    assert [p for p, _ in ours] == [p for p, _ in theirs]
    for (p, a), (_, b) in zip(ours, theirs):
        assert a.dtype == b.dtype, p
        np.testing.assert_array_equal(a, b, err_msg=str(p))


def _moved(lib):
    """The guide's model after a training-like step: statistics and the stream's count moved,
    so that a restore keeping an abstract model's initial values would be caught."""
    model = _mlp(lib)
    model.blocks[0].mean.set_value(model.blocks[0].mean.get_value() + 0.25)
    model.drop(jnp.ones((2, 4)), deterministic=False)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each library's model, its state and its pure dict, saved once: ``(model, dir)``."""
    root = tmp_path_factory.mktemp("ckpt")
    models = {name: _moved(lib) for name, lib in LIBS.items()}
    _assert_same(_pairs(nnx.state(models["varjax"]), nnx),
                 _pairs(flax_nnx.state(models["flax"]), flax_nnx))
    with ocp.StandardCheckpointer() as checkpointer:
        for name, lib in LIBS.items():
            _, state = lib.split(models[name])
            checkpointer.save(root / name / "state", state)
            checkpointer.save(root / name / "pure_dict", lib.to_pure_dict(state))
    return {name: (models[name], root / name) for name in LIBS}


@pytest.mark.parametrize("src, dst", PAIRS)
def test_guide_state_checkpoint_restores_into_an_abstract_model_and_merges(saved, src, dst):
    model, where = saved[src]
    lib = LIBS[dst]
    abstract_model = lib.eval_shape(lambda: _mlp(lib))
    graphdef, abstract_state = lib.split(abstract_model)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(where / "state", abstract_state)
    assert isinstance(restored, lib.State)
    assert type(restored["linear1"]["kernel"]) is lib.Param
    _assert_same(_pairs(restored, lib), _pairs(LIBS[src].state(model), LIBS[src]))
    merged = lib.merge(graphdef, restored)
    np.testing.assert_allclose(merged(X), model(X), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("src, dst", PAIRS)
def test_guide_pure_dict_restores_without_a_target_into_either_library_in_place(saved, src, dst):
    model, where = saved[src]
    lib = LIBS[dst]
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(where / "pure_dict")
    assert list(restored["blocks"]) == ["0"]            # a checkpoint's index is a string
    assert list(lib.restore_int_paths(restored)["blocks"]) == [0]
    abstract_model = lib.eval_shape(lambda: _mlp(lib))
    graphdef, abstract_state = lib.split(abstract_model)
    lib.replace_by_pure_dict(abstract_state, restored)
    # varjax writes the state's Variables, the abstract model's, in place; flax.nnx puts new
    # Variables in the state, leaving the abstract model's abstract
    held = abstract_model.linear1.kernel.get_value()
    assert isinstance(held, jax.ShapeDtypeStruct) is (lib is flax_nnx)
    merged = lib.merge(graphdef, abstract_state)
    _assert_same(_pairs(lib.state(merged), lib), _pairs(LIBS[src].state(model), LIBS[src]))
    np.testing.assert_allclose(merged(X), model(X), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("src, dst", PAIRS)
def test_guide_old_checkpoint_fills_a_model_that_needs_more(saved, src, dst):
    """The guide's ModifiedTwoLayerMLP: biases added to the old pure dict, then restored."""
    model, where = saved[src]
    lib = LIBS[dst]
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(where / "pure_dict")
    restored["linear1"]["bias"] = jnp.zeros((4,))
    restored["linear2"]["bias"] = jnp.zeros((4,))
    graphdef, abstract_state = lib.split(lib.eval_shape(lambda: _mlp(lib, bias=True)))
    lib.replace_by_pure_dict(abstract_state, restored)
    merged = lib.merge(graphdef, abstract_state)
    np.testing.assert_array_equal(merged.linear1.bias.get_value(), np.zeros(4, np.float32))
    np.testing.assert_allclose(merged(X), model(X), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("src, dst", PAIRS)
def test_partial_restore_loads_only_the_params_into_a_new_model(saved, src, dst):
    """Orbax's partial restore: a state of Params alone (no Dropout stream, no statistics) is
    the target; the restored Params update a model built from another seed."""
    model, where = saved[src]
    lib = LIBS[dst]
    other = _mlp(lib, seed=7)
    params = lib.state(other, lib.Param)
    with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(where / "state", args=ocp.args.PyTreeRestore(
            item=params, restore_args=ocp.checkpoint_utils.construct_restore_args(params),
            partial_restore=True))
    lib.update(other, restored)
    theirs = LIBS[src]
    _assert_same(_pairs(lib.state(other, lib.Param), lib),
                 _pairs(theirs.state(model, theirs.Param), theirs))
    assert int(lib.state(other)["drop"]["rngs"]["count"].get_value()) == 0    # not restored


@pytest.mark.parametrize("src, dst", PAIRS)
def test_flat_state_checkpoint_restores_through_from_flat_state(tmp_path, src, dst):
    model = _moved(LIBS[src])
    lib = LIBS[dst]
    graphdef, abstract_state = lib.split(lib.eval_shape(lambda: _mlp(lib)))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "flat", LIBS[src].to_flat_state(LIBS[src].state(model)))
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "flat", lib.to_flat_state(abstract_state))
    merged = lib.merge(graphdef, lib.from_flat_state(restored))
    _assert_same(_pairs(lib.state(merged), lib), _pairs(LIBS[src].state(model), LIBS[src]))


@pytest.mark.parametrize("src, dst", PAIRS)
def test_flat_state_pairs_of_one_library_update_a_model_of_the_other(saved, src, dst):
    model = saved[src][0]
    pairs = [(p, v.get_value()) for p, v in LIBS[src].to_flat_state(LIBS[src].state(model))]
    lib = LIBS[dst]
    other = _mlp(lib, seed=7)
    lib.update(other, lib.from_flat_state(pairs))
    _assert_same(_pairs(lib.state(other), lib), _pairs(LIBS[src].state(model), LIBS[src]))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Each library's model with a partitioned kernel, built and saved on a 1-device mesh:
    ``(model, checkpoint)``."""
    root = tmp_path_factory.mktemp("sharded")
    out = {}
    with jax.set_mesh(MESH), ocp.StandardCheckpointer() as checkpointer:
        for name, lib in LIBS.items():
            model = _sharded(lib)
            checkpointer.save(root / name, lib.state(model))
            out[name] = (model, root / name)
    return out


@pytest.mark.parametrize("src, dst", PAIRS)
def test_sharded_state_restores_onto_its_shardings_with_their_metadata(sharded, src, dst):
    """The GSPMD guide's restore: an abstract state carrying each leaf's NamedSharding on
    the mesh (``get_abstract_model``) is Orbax's target."""
    model, where = sharded[src]
    lib = LIBS[dst]
    graphdef, abstract_state = lib.get_abstract_model(lambda: _sharded(lib), MESH)
    spec = NamedSharding(MESH, P(None, "model"))
    assert abstract_state["linear"]["kernel"].get_value().sharding == spec
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(where, abstract_state)
    kernel = lib.merge(graphdef, restored).linear.kernel
    assert kernel.get_value().sharding == spec
    assert kernel.get_metadata()["out_sharding"] == (None, "model")
    assert lib.get_partition_spec(restored)["linear"]["kernel"].get_value() == P(None, "model")
    _assert_same(_pairs(restored, lib), _pairs(LIBS[src].state(model), LIBS[src]))


@pytest.mark.parametrize("src, dst", PAIRS)
def test_a_state_checkpoint_into_a_model_of_another_structure_is_orbaxs_value_error(
        saved, src, dst):
    lib = LIBS[dst]
    _, abstract_state = lib.split(lib.eval_shape(lambda: _mlp(lib, bias=True)))
    with ocp.StandardCheckpointer() as checkpointer, pytest.raises(ValueError, match="bias"):
        checkpointer.restore(saved[src][1] / "state", abstract_state)


@pytest.mark.parametrize("pure, path", [({"linear1": {"nope": 1.0}}, ("linear1", "nope")),
                                        ({"zz": 1.0}, ("zz",)),
                                        ({"linear1": 1.0}, ("linear1",))],
                         ids=["unknown leaf", "unknown attribute", "a leaf for a module"])
def test_replace_by_pure_dict_refuses_a_path_the_state_lacks_as_flax_nnx(pure, path):
    _, theirs = flax_nnx.split(flax_nnx.eval_shape(lambda: _mlp(flax_nnx)))
    with pytest.raises(ValueError, match="not available in state"):
        flax_nnx.replace_by_pure_dict(theirs, pure)
    _, ours = nnx.split(nnx.eval_shape(lambda: _mlp(nnx)))
    with pytest.raises(errors.ConfigError, match="no leaf at") as caught:   # a ValueError
        nnx.replace_by_pure_dict(ours, pure)
    assert caught.value.path == path and "test_nnx_checkpoints.py" in caught.value.source
