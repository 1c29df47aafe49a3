"""``nnx.Linear``: flax.nnx's parameters and outputs, bit for bit, from the same seed."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import nnx


@pytest.mark.parametrize("kwargs", [{}, {"use_bias": False}, {"dtype": jnp.bfloat16},
                                    {"param_dtype": jnp.float16, "dtype": jnp.float16}])
def test_linear_matches_flax_nnx_bitwise(kwargs):
    ours = nnx.Linear(3, 4, rngs=nnx.Rngs(7), **kwargs)
    theirs = flax_nnx.Linear(3, 4, rngs=flax_nnx.Rngs(7), **kwargs)
    np.testing.assert_array_equal(ours.kernel[...], theirs.kernel[...])
    if kwargs.get("use_bias", True):
        np.testing.assert_array_equal(ours.bias[...], theirs.bias[...])
    else:
        assert ours.bias is None
    x = jnp.arange(6.0).reshape(2, 3) / 5
    got, want = ours(x), theirs(x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_two_layers_from_one_rngs_draw_as_flax_nnx():
    r, fr = nnx.Rngs(0), flax_nnx.Rngs(0)
    for _ in range(2):
        np.testing.assert_array_equal(nnx.Linear(2, 2, rngs=r).kernel[...],
                                      flax_nnx.Linear(2, 2, rngs=fr).kernel[...])
