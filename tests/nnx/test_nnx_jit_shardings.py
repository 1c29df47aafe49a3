"""``nnx.jit``'s ``in_shardings`` (a ``StateSharding`` per module argument),
``out_shardings`` and ``static_argnames``, against flax.nnx 0.12.8, on the 2 CPU devices
``tests/conftest.py`` asks for: a train step's Variables come in, and their updates out,
with their entry's sharding, and the values are flax.nnx's and the unsharded step's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from varjax import nnx
from varjax.ir import errors
from varjax.nnx.filter_maps import StateSharding
from varjax.nnx.transforms import jit

MESH = jax.make_mesh((2,), ("x",))
COLUMNS = NamedSharding(MESH, P(None, "x"))
ROWS = NamedSharding(MESH, P("x"))
REPLICATED = NamedSharding(MESH, P())
X = jnp.arange(6.0).reshape(2, 3) / 6
LIBS = [(nnx, jit, StateSharding), (flax_nnx, flax_nnx.jit, flax_nnx.StateSharding)]


def _step(lib):
    def step(m, x):
        grads = lib.grad(lambda m: jnp.sum(m(x) ** 2))(m)
        m.kernel[...] = m.kernel[...] - 0.1 * grads["kernel"][...]
        m.bias[...] = m.bias[...] - 0.1 * grads["bias"][...]
        return m(x)
    return step


def _linear(lib):
    return lib.Linear(3, 4, rngs=lib.Rngs(0))


@pytest.fixture(scope="module")
def stepped():
    """Per library, a Linear after two steps with its kernel split by columns (and an
    unsharded step's for varjax), with the last output."""
    found = {}
    for lib, jit_, sharding in LIBS:
        model = _linear(lib)
        step = jit_(_step(lib), in_shardings=(
            sharding({lib.PathContains("kernel"): COLUMNS, ...: REPLICATED}), REPLICATED))
        step(model, X)
        found[lib] = (model, step(model, X))
    plain = _linear(nnx)
    jit(_step(nnx))(plain, X)
    found["plain"] = (plain, jit(_step(nnx))(plain, X))
    return found


def test_state_sharding_in_shardings_keeps_the_kernel_sharded_through_updating_steps(stepped):
    for lib in (nnx, flax_nnx):
        model, out = stepped[lib]
        assert model.kernel[...].sharding == COLUMNS
        assert model.bias[...].sharding == REPLICATED
    assert stepped[nnx][1].sharding == stepped[flax_nnx][1].sharding


def test_sharded_step_computes_the_unsharded_steps_values_and_flax_nnxs(stepped):
    (ours, out), (theirs, fout), (plain, pout) = (
        stepped[nnx], stepped[flax_nnx], stepped["plain"])
    for name in ("kernel", "bias"):
        np.testing.assert_array_equal(getattr(ours, name)[...], getattr(theirs, name)[...])
        np.testing.assert_allclose(getattr(ours, name)[...], getattr(plain, name)[...],
                                   rtol=1e-6)
    np.testing.assert_array_equal(out, fout)
    np.testing.assert_allclose(out, pout, rtol=1e-6)


def test_a_sharding_entry_places_every_variable_of_the_module_as_flax_nnx():
    """A module's entry that is one Sharding is every Variable's, read or written."""
    got = []
    for lib, jit_, _ in LIBS:
        model = _linear(lib)
        jit_(lambda m, x: m(x), in_shardings=(REPLICATED, REPLICATED))(model, X)
        got.append((model.kernel[...].sharding, model.bias[...].sharding))
    assert got[0] == got[1]


def test_out_shardings_places_the_output_as_flax_nnx():
    outs = []
    for lib, jit_, _ in LIBS:
        model = _linear(lib)
        outs.append(jit_(lambda m, x: m(x), out_shardings=ROWS)(model, X))
    assert outs[0].sharding == outs[1].sharding == ROWS
    np.testing.assert_array_equal(outs[0], outs[1])


def test_static_argnames_makes_an_argument_a_python_value_as_flax_nnx():
    """A static argument, by name or by position, is a Python value inside (an ``if`` on it
    works); ``in_shardings`` then covers the other arguments, as in ``jax.jit``."""
    def scaled(m, x, scale):
        return m(x) * 2 if scale > 1 else m(x)
    for lib, jit_, sharding in LIBS:
        model = _linear(lib)
        by_name = jit_(scaled, static_argnames="scale")
        np.testing.assert_allclose(by_name(model, X, scale=2), 2 * model(X), rtol=1e-6)
        np.testing.assert_allclose(by_name(model, X, 1), model(X), rtol=1e-6)
        with_shardings = jit_(scaled, static_argnames="scale", in_shardings=(
            sharding({lib.PathContains("kernel"): COLUMNS, ...: REPLICATED}), REPLICATED))
        np.testing.assert_allclose(with_shardings(model, X, 2), 2 * model(X), rtol=1e-6)


def test_in_shardings_not_matching_the_arguments_is_an_error_naming_it():
    step = jit(lambda m, x: m(x), in_shardings=(REPLICATED, REPLICATED, REPLICATED))
    with pytest.raises(errors.TransformError, match="jit: in_shardings has 3 entries for 2 "
                       "arguments") as info:
        step(_linear(nnx), X)
    assert "test_nnx_jit_shardings.py" in str(info.value)
    with pytest.raises(ValueError):       # flax.nnx raises JAX's pytree prefix error
        flax_nnx.jit(lambda m, x: m(x), in_shardings=(REPLICATED,) * 3)(_linear(flax_nnx), X)


def test_state_sharding_without_graph_updates_is_flax_nnxs_value_error():
    for lib, jit_, sharding in LIBS:
        with pytest.raises(ValueError, match="cannot contain `StateSharding`"):
            jit_(lambda m: m(X), in_shardings=(sharding({...: REPLICATED}),),
                 graph_updates=False)(_linear(lib))


def _kernel_columns(sharding):
    return sharding({lambda path, _: path[-1] == "kernel": COLUMNS, ...: REPLICATED})


def test_state_sharding_in_out_shardings_places_a_module_made_inside_as_flax_nnx():
    """The module returned at a ``StateSharding`` entry is split by its filters inside, each
    state on its sharding, and merged outside, as flax.nnx does."""
    placed = []
    for lib, jit_, sharding in LIBS:
        out = jit_(lambda x: (_linear(lib), x * 2), out_shardings=(_kernel_columns(sharding),
                                                                   REPLICATED))(X)
        module = out[0]
        placed.append([(v[...].sharding.spec, np.asarray(v[...]))
                       for v in (module.kernel, module.bias)])
        assert isinstance(module, lib.Linear)
    (ours_kernel, ours_bias), (theirs_kernel, theirs_bias) = placed
    assert ours_kernel[0] == theirs_kernel[0] == P(None, "x")
    assert ours_bias[0] == theirs_bias[0] == P()
    np.testing.assert_array_equal(ours_kernel[1], theirs_kernel[1])


def test_state_sharding_in_out_shardings_refusals_are_flax_nnxs():
    """An argument's module returned there (its Variables come back with its in_shardings
    entry), and any StateSharding without graph updates, are flax.nnx's ValueErrors."""
    for lib, jit_, sharding in LIBS:
        with pytest.raises(ValueError):
            jit_(lambda m: m, out_shardings=_kernel_columns(sharding))(_linear(lib))
        for graph in (True, False):
            with pytest.raises(ValueError, match="cannot contain `StateSharding`"):
                jit_(lambda m: m, out_shardings=_kernel_columns(sharding), graph=graph,
                     graph_updates=False)(_linear(lib))


def test_state_sharding_nested_in_an_in_shardings_entry_places_that_module_as_flax_nnx():
    """``in_shardings=((state_sharding, replicated),)`` for a ``(model, x)`` argument: the
    module inside the tuple is placed by its filters, its updates come back so."""
    placed = []
    for lib, jit_, sharding in LIBS:
        model = _linear(lib)

        def step(pair):
            m, x = pair
            m.bias[...] = m.bias[...] + 1.0
            return m(x)
        y = jit_(step, in_shardings=((_kernel_columns(sharding), REPLICATED),))((model, X))
        placed.append((model.kernel[...].sharding.spec, np.asarray(model.bias[...]),
                       np.asarray(y)))
    assert placed[0][0] == placed[1][0] == P(None, "x")
    np.testing.assert_array_equal(placed[0][1], placed[1][1])
    np.testing.assert_allclose(placed[0][2], placed[1][2], rtol=1e-6)
