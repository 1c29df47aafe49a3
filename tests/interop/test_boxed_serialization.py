"""Boxed checkpoints interchange with Linen: variables holding ``nn.with_partitioning`` /
``nn.with_logical_partitioning`` boxes go through ``flax.serialization`` (and Orbax) from
either library into the other's boxes, bitwise, the names coming from the target.

varjax does not import flax: its boxes are registered with ``flax.serialization`` when the
user imports it, before varjax or after (``varjax.ir.axis_metadata``)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import flax.core.meta
import flax.linen
import flax.serialization as serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from orbax_io import restore, save

import varjax.nn

X = jnp.arange(6.0).reshape(2, 3)


def make_model(nn: Any) -> Any:
    """One architecture, written against the ``nn`` namespace it is given."""

    class Boxed(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4, kernel_init=nn.with_partitioning(
                nn.initializers.lecun_normal(), (None, "model")))(x)
            return nn.Dense(2, kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("embed", "mlp")))(x)

    return Boxed()


LINEN, VARJAX = make_model(flax.linen), make_model(varjax.nn)


def _boxes(variables: Any) -> list[Any]:
    return [x for x in jax.tree.leaves(variables, is_leaf=lambda x: hasattr(x, "names"))
            if hasattr(x, "names")]


def _assert_restored(restored: Any, source: Any, target: Any, box_module: str) -> None:
    """``restored`` has ``target``'s boxes (class and names) around ``source``'s values."""
    assert jax.tree.structure(restored) == jax.tree.structure(target)
    for got, want in zip(_boxes(restored), _boxes(target)):
        assert type(got) is type(want) and type(got).__module__.startswith(box_module)
        assert tuple(got.names) == tuple(want.names)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(source)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("source, target, box_module", [(LINEN, VARJAX, "varjax"), (VARJAX, LINEN, "flax")],
                         ids=["linen-into-varjax", "varjax-into-linen"])
def test_boxed_checkpoint_restores_into_the_other_librarys_boxes_bitwise(source, target, box_module):
    saved = source.init(jax.random.key(0), X)
    into = target.init(jax.random.key(1), X)
    restored = serialization.from_bytes(into, serialization.to_bytes(saved))
    _assert_restored(restored, saved, into, box_module)
    np.testing.assert_allclose(target.apply(restored, X), source.apply(saved, X), rtol=1e-6)


def test_unboxed_checkpoint_restores_into_varjax_boxes():
    """As ``apply`` takes unboxed values for a boxing initializer."""
    plain = flax.core.meta.unbox(LINEN.init(jax.random.key(0), X))
    target = VARJAX.init(jax.random.key(1), X)
    restored = serialization.from_bytes(target, serialization.to_bytes(plain))
    _assert_restored(restored, plain, target, "varjax")


def test_a_checkpoint_dict_that_is_no_box_names_the_variable():
    target = VARJAX.init(jax.random.key(0), X)
    state = serialization.to_state_dict(target)
    state["params"]["Dense_0"]["kernel"] = {"kernel": state["params"]["Dense_0"]["kernel"]["value"]}
    with pytest.raises(varjax.errors.InvalidVariablesError, match="keys \\['kernel'\\]") as e:
        serialization.from_state_dict(target, state)
    assert e.value.collection == "params" and e.value.path == ("Dense_0", "kernel")
    assert "test_boxed_serialization.py" in e.value.source


def test_orbax_boxed_checkpoints_interchange_bitwise(tmp_path):
    linen = LINEN.init(jax.random.key(0), X)
    ours = VARJAX.init(jax.random.key(1), X)
    save(tmp_path / "linen", linen)
    save(tmp_path / "varjax", ours)
    _assert_restored(restore(tmp_path / "linen", ours), linen, ours, "varjax")
    _assert_restored(restore(tmp_path / "varjax", linen), ours, linen, "flax")


def test_boxes_serialize_when_flax_is_imported_after_varjax():
    script = textwrap.dedent('''
        import sys
        import jax
        import varjax.nn as nn
        assert "flax" not in sys.modules, "varjax imported flax"
        import flax.serialization as serialization
        box = nn.with_partitioning(nn.initializers.ones, ("a",))(jax.random.key(0), (2,))
        back = serialization.from_bytes(box, serialization.to_bytes(box.replace(value=box.value * 3)))
        assert type(back) is type(box) and back.names == ("a",), back
        print(back.value.tolist())
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[3.0, 3.0]"


def test_frozen_dicts_interchange_with_linens_through_flax_serialization():
    """A varjax ``nn.FrozenDict`` saves as the dict it holds (as Linen's does) and restores into
    either library's FrozenDict, bitwise; a missing key is flax's own error."""
    tree = {"params": {"w": jnp.arange(3.0), "b": jnp.ones((2,), jnp.int32)}}
    ours, theirs = varjax.nn.FrozenDict(tree), flax.core.FrozenDict(tree)
    assert serialization.to_bytes(ours) == serialization.to_bytes(theirs)
    back = serialization.from_bytes(varjax.nn.FrozenDict(jax.tree.map(jnp.zeros_like, tree)),
                                    serialization.to_bytes(theirs))
    assert isinstance(back, varjax.nn.FrozenDict)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), back.unfreeze(), tree)
    into_linen = serialization.from_bytes(flax.core.FrozenDict(jax.tree.map(jnp.zeros_like, tree)),
                                          serialization.to_bytes(ours))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), flax.core.unfreeze(into_linen), tree)
    with pytest.raises(ValueError, match="b"):
        serialization.from_bytes(ours, serialization.to_bytes({"params": {"w": jnp.arange(3.0)}}))
