"""An object made inside an ``nnx`` transform and returned keeps what it shares, as in
flax.nnx's graph mode: a submodule held twice comes back as one object (``m.a is m.b``), its
Variables one Variable, so an update through one place is seen at the other; tree mode
(``graph=False``) refuses a shared output, as flax.nnx does (``ValueError``).  Before, JAX's
copy of the output came back with each place a separate object."""
import flax.nnx as flax_nnx
import jax.numpy as jnp
import pytest

import varjax.nnx as nnx

GRAPH_MODES = [(True, True), (True, False)]
ALL_MODES = GRAPH_MODES + [(False, False)]


def _classes(lib):
    class Block(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)

    class Twice(lib.Module):
        def __init__(self, rngs):
            self.a = Block(rngs)
            self.b = self.a

        def __call__(self, x):
            return self.b.lin(self.a.lin(x))
    return Block, Twice


def _made(lib, how, graph, updates):
    Block, Twice = _classes(lib)
    kw = dict(graph=graph, graph_updates=updates)
    if how == "jit":
        return lib.jit(lambda: Twice(lib.Rngs(0)), **kw)()
    if how == "remat":
        return lib.remat(lambda: Twice(lib.Rngs(0)), **kw)()
    if how == "cond":
        return lib.cond(True, lambda: Twice(lib.Rngs(0)), lambda: Twice(lib.Rngs(1)), **kw)
    if how == "eval_shape":
        return lib.eval_shape(lambda: Twice(lib.Rngs(0)), **kw)
    raise AssertionError(how)


HOWS = ["jit", "remat", "cond", "eval_shape"]


@pytest.mark.parametrize("graph,updates", GRAPH_MODES, ids=["graph", "no_updates"])
@pytest.mark.parametrize("how", HOWS)
def test_a_made_module_returned_keeps_its_shared_submodule_as_flax(how, graph, updates):
    theirs = _made(flax_nnx, how, graph, updates)
    ours = _made(nnx, how, graph, updates)
    assert (ours.a is ours.b) == (theirs.a is theirs.b) == True     # noqa: E712
    assert ours.a.lin.kernel is ours.b.lin.kernel


@pytest.mark.parametrize("how", ["jit", "remat", "cond", "eval_shape"])
def test_tree_mode_refuses_a_shared_output_as_flax(how):
    with pytest.raises(ValueError):
        _made(flax_nnx, how, False, False)
    with pytest.raises(ValueError, match="shared|reached"):
        _made(nnx, how, False, False)


def test_an_argument_module_returned_with_a_made_one_sharing_it_keeps_both():
    Block, _ = _classes(nnx)
    given = Block(nnx.Rngs(0))

    def wrap(b):
        new = nnx.List([b, b])
        return new, b
    new, same = nnx.jit(wrap)(given)
    assert same is given and new[0] is given and new[1] is given


def test_a_list_returning_one_module_twice_is_one_module():
    Block, _ = _classes(nnx)
    out = nnx.jit(lambda: (lambda b: [b, b])(Block(nnx.Rngs(0))))()
    assert out[0] is out[1]


def test_an_update_through_one_place_of_a_returned_shared_module_is_seen_at_the_other():
    m = _made(nnx, "jit", True, True)
    m.a.lin.kernel[...] = jnp.zeros((2, 2))
    assert float(jnp.abs(m.b.lin.kernel[...]).sum()) == 0.0
