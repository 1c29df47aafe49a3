"""``nnx.grad``/``nnx.value_and_grad`` with ``holomorphic=True``: the complex derivative of a
complex function of complex Params, as ``jax.grad(holomorphic=True)`` gives it, against
flax.nnx; a real output or a real Variable differentiated raises JAX's ``TypeError``, as
there."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import nnx as vnnx
from varjax.nnx.transforms import grad, value_and_grad

LIBS = {"varjax": vnnx, "flax": flax_nnx}
GRAD = {"varjax": grad, "flax": flax_nnx.grad}
VALUE_AND_GRAD = {"varjax": value_and_grad, "flax": flax_nnx.value_and_grad}


def _model(nnx):
    class Complex(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.array([1 + 2j, 3 - 1j], jnp.complex64))
            self.n = nnx.BatchStat(jnp.zeros((), jnp.float32))
    return Complex()


def _square(m):
    return jnp.sum(m.w[...] ** 2)


def test_holomorphic_grad_of_complex_params_is_flax_nnx_s():
    grads = {lib: GRAD[lib](_square, holomorphic=True)(_model(LIBS[lib])) for lib in LIBS}
    np.testing.assert_array_equal(grads["varjax"]["w"][...], grads["flax"]["w"][...])
    np.testing.assert_array_equal(grads["varjax"]["w"][...], [2 + 4j, 6 - 2j])


def test_holomorphic_value_and_grad_gives_the_complex_value():
    value, grads = VALUE_AND_GRAD["varjax"](_square, holomorphic=True)(_model(vnnx))
    theirs, _ = VALUE_AND_GRAD["flax"](_square, holomorphic=True)(_model(flax_nnx))
    assert complex(value) == complex(theirs) == 5 - 2j
    assert grads["w"][...].dtype == jnp.complex64


@pytest.mark.parametrize("lib", LIBS)
def test_holomorphic_grad_of_a_real_output_raises_jax_s_type_error(lib):
    with pytest.raises(TypeError, match="requires outputs with complex dtype"):
        GRAD[lib](lambda m: _square(m).real, holomorphic=True)(_model(LIBS[lib]))


@pytest.mark.parametrize("lib", LIBS)
def test_holomorphic_grad_in_tree_mode_refuses_a_real_variable(lib):
    """Tree mode differentiates every Variable of the argument: the float BatchStat too."""
    with pytest.raises(TypeError, match="requires inputs with complex dtype"):
        GRAD[lib](_square, holomorphic=True, graph=False)(_model(LIBS[lib]))
