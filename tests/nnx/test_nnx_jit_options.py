"""``nnx.jit``'s ``jax.jit`` options: ``donate_argnums``/``donate_argnames`` (a donated
module's buffers are deleted, and every one of its Variables comes back, written or not, as
in flax.nnx), ``keep_unused``, ``device``/``backend`` and ``inline``."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import nnx as vnnx
from varjax.nnx.transforms import jit

LIBS = {"varjax": vnnx, "flax": flax_nnx}
JIT = {"varjax": jit, "flax": flax_nnx.jit}


def _model(nnx):
    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((3,)))
            self.c = nnx.Variable(jnp.full((3,), 2.0))     # read, never written

    return Model()


def _step(m, x):
    m.w[...] = m.w[...] + m.c[...] * x
    return jnp.sum(m.w[...])


@pytest.mark.parametrize("donate", [{"donate_argnums": 0}, {"donate_argnames": "m"}],
                         ids=["argnums", "argnames"])
def test_a_donated_module_loses_its_buffers_and_keeps_every_variable_as_flax_nnx(donate):
    seen = {}
    for lib, nnx in LIBS.items():
        m = _model(nnx)
        step = JIT[lib](_step, **donate)
        before = [m.w[...], m.c[...]]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # a buffer XLA could not reuse
            losses = [float(step(m, jnp.float32(i))) for i in range(3)]   # kept calls too
        seen[lib] = ([b.is_deleted() for b in before], losses,
                     np.asarray(m.w[...]), np.asarray(m.c[...]))
    ours, theirs = seen["varjax"], seen["flax"]
    assert ours[0] == theirs[0] == [True, True]
    assert ours[1] == theirs[1]
    np.testing.assert_array_equal(ours[2], theirs[2])
    np.testing.assert_array_equal(ours[3], theirs[3])


def test_an_undonated_module_keeps_its_buffers():
    m = _model(vnnx)
    c = m.c[...]
    jit(_step)(m, jnp.float32(1.0))
    assert not c.is_deleted() and m.c[...] is c


@pytest.mark.parametrize("lib", LIBS)
def test_keep_unused_passes_an_unused_argument_to_the_program(lib):
    """Pruned, an unused argument is not handed to XLA: a deleted array there goes
    unnoticed; kept, it is JAX's error."""
    def fn(x, unused):
        return x + 1
    gone = jnp.ones(3)
    gone.delete()
    np.testing.assert_array_equal(JIT[lib](fn)(jnp.ones(2), gone), [2.0, 2.0])
    with pytest.raises(RuntimeError, match="deleted"):
        JIT[lib](fn, keep_unused=True)(jnp.ones(2), gone)


@pytest.mark.parametrize("option", [{"device": "first"}, {"backend": "cpu"}],
                         ids=["device", "backend"])
def test_device_and_backend_are_jax_jit_s(option):
    """As ``jax.jit`` (deprecated there, with its warning; flax.nnx 0.12.8 refuses them with
    a ValueError, as it also passes out_shardings)."""
    if "device" in option:
        option = {"device": jax.devices()[0]}
    m = _model(vnnx)
    with pytest.warns(DeprecationWarning, match="backend and device"):
        out = jit(_step, **option)(m, jnp.float32(1.0))
    assert float(out) == 9.0 and float(m.w[0]) == 3.0


def test_inline_jit_inside_an_outer_jit_updates_the_module():
    m = _model(vnnx)
    inner = jit(_step, inline=True)

    @jit
    def outer(m, x):
        return inner(m, x) + inner(m, x)
    assert float(outer(m, jnp.float32(1.0))) == 9.0 + 15.0
    np.testing.assert_array_equal(m.w[...], [5.0, 5.0, 5.0])
