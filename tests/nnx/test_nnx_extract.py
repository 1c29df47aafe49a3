"""``to_tree``/``from_tree`` and ``NodeStates``: a pytree holding NNX objects as a pure
pytree and back, shared objects kept shared, against flax.nnx."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx import extract

LIBS = [(nnx, extract), (flax_nnx, flax_nnx)]


def _tree(lib):
    lin = lib.Linear(1, 2, rngs=lib.Rngs(0))

    class Holder(lib.Module):
        def __init__(self, child):
            self.child = child
    return lin, Holder, {"a": lin, "b": [Holder(lin), 3], "v": lib.Param(jnp.ones(1))}


@pytest.mark.parametrize("lib, ex", LIBS)
def test_to_tree_splits_objects_once_and_from_tree_rebuilds_the_sharing(lib, ex):
    lin, _, tree = _tree(lib)
    pure = ex.to_tree(tree)
    assert isinstance(pure["a"], ex.NodeStates) and pure["b"][1] == 3
    assert len(jax.tree.leaves(pure)) == 4       # lin's two params once, the Param, the int
    assert isinstance(pure["a"].graphdef, lib.GraphDef) and len(pure["a"].states) == 1
    back = ex.from_tree(jax.jit(lambda p: p)(pure))
    assert back["b"][0].child is back["a"] and back["a"] is not lin
    assert type(back["v"]) is lib.Param and back["b"][1] == 3


@pytest.mark.parametrize("lib, ex", LIBS)
def test_to_tree_refuses_a_shared_object_under_two_prefixes(lib, ex):
    lin, holder, _ = _tree(lib)
    with pytest.raises(ValueError):
        ex.to_tree((lin, holder(lin)), prefix=(0, 1))
    pure = ex.to_tree((lin, holder(lin)), prefix=(0, 0))
    assert len(jax.tree.leaves(pure)) == 2


def test_to_tree_passes_each_leaf_its_prefix_and_path_to_split_fn():
    lin, holder, _ = _tree(nnx)
    got = []

    def split_fn(ctx, path, prefix, leaf):
        got.append((jax.tree_util.keystr(path), prefix))
        return extract.NodeStates.from_split(*ctx.split(leaf), metadata=prefix)
    pure = extract.to_tree({"x": lin, "y": [holder(lin)]}, prefix={"x": 0, "y": None},
                           split_fn=split_fn, check_aliasing=False)
    assert got == [("['x']", 0), ("['y'][0]", None)] and pure["x"].metadata == 0
    with pytest.raises(errors.InconsistentAliasError, match="different prefixes"):
        extract.to_tree((lin, holder(lin)), prefix=(0, 1))
    with pytest.raises(errors.MissingVariableError, match="no GraphDef"):
        extract.NodeStates.from_states(1).graphdef
