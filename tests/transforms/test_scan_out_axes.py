"""``nn.scan``'s ``out_axes`` as Linen takes it: one axis for every output, or a pytree
prefix of the body's ``ys`` with an axis per part; what it cannot stack is refused (before,
anything but an int was ignored and ``ys`` came back stacked along axis 0)."""
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn
from varjax.errors import TransformError


def _model(lib, out_axes):
    def body(mdl, c, x):
        return c + x, (2.0 * x, {"twice": jnp.stack([x, x])})

    class M(lib.Module):
        @lib.compact
        def __call__(self, c, xs):
            return lib.scan(body, out_axes=out_axes)(self, c, xs)
    return M()


XS = jnp.arange(12.0).reshape(4, 3)          # 4 steps of a (3,) x


@pytest.mark.parametrize("out_axes", [0, 1, -1, (1, 0), (0, {"twice": 2})],
                         ids=["0", "1", "-1", "per-part", "nested"])
def test_out_axes_stacks_each_part_as_linen_does(out_axes):
    carry, ys = _model(nn, out_axes).apply({}, jnp.zeros(3), XS)
    ref_carry, ref_ys = _model(flax_nn, out_axes).apply({}, jnp.zeros(3), XS)
    np.testing.assert_array_equal(carry, ref_carry)
    assert jax.tree.structure(ys) == jax.tree.structure(ref_ys)
    for a, b in zip(jax.tree.leaves(ys), jax.tree.leaves(ref_ys)):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_a_broadcast_output_is_refused_naming_the_option():
    with pytest.raises(TransformError, match=r"out_axes=vj.broadcast .*not supported") as info:
        _model(nn, (vj.broadcast, 0)).apply({}, jnp.zeros(3), XS)
    assert __file__ in info.value.source


def test_an_out_axes_leaf_that_is_no_axis_is_refused():
    with pytest.raises(TransformError, match=r"out_axes has 'rows'"):
        _model(nn, "rows").apply({}, jnp.zeros(3), XS)


def test_an_out_axes_tree_that_is_no_prefix_of_ys_is_refused():
    with pytest.raises(TransformError, match=r"not a pytree prefix of the body's ys"):
        _model(nn, (0, 1, 2)).apply({}, jnp.zeros(3), XS)
