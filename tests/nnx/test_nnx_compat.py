"""``nnx.compat``: flax.nnx's names, each the varjax.nnx function with graph mode (and graph
updates) given, so graph-mode code keeps its meaning under ``set_graph_mode(False)``."""
import inspect

import flax.nnx
import jax.numpy as jnp
import pytest

from varjax import nnx
from varjax.nnx import compat


def test_compat_has_flax_nnx_compat_names():
    ours = {n for n in dir(compat) if not n.startswith("_") and callable(getattr(compat, n))}
    theirs = {n for n in dir(flax.nnx.compat) if not n.startswith("_")
              and callable(getattr(flax.nnx.compat, n)) and n not in ("functools",)}
    assert theirs - ours == set()


@pytest.mark.parametrize("name", compat.__all__)
def test_each_compat_function_takes_the_modes_it_is_given(name):
    f = getattr(compat, name)
    inspect.signature(f.func).bind_partial(**f.keywords)   # raises on an unknown option
    assert f.keywords["graph"] is True


class _Counter(nnx.Module):
    def __init__(self):
        self.n = nnx.Variable(jnp.zeros(()))

    def __call__(self):
        self.n[...] += 1
        self.sown = nnx.Intermediate(self.n[...])
        return self.n[...]


def test_compat_jit_keeps_graph_updates_under_tree_mode():
    m = _Counter()
    with nnx.set_graph_mode(False), nnx.set_graph_updates(False):
        compat.jit(lambda m: m())(m)
    assert float(m.n[...]) == 1.0 and float(m.sown[...]) == 1.0
