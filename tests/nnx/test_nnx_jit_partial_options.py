"""``nnx.jit_partial``'s ``jax.jit`` options against flax.nnx 0.12.8's: ``in_shardings`` (a
bound argument's entry broadcast to its Variables, then the call's), ``out_shardings``,
``static_argnames``, ``donate_argnums``/``donate_argnames`` (position 0, or a bound
parameter's name, is every bound Variable), ``keep_unused``, ``device``/``backend`` (built,
as ``nnx.jit``'s; flax.nnx refuses them) and ``inline``; a ``StateSharding`` refused as in
flax.nnx.  Over the CPU's two devices (tests/conftest.py)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from varjax import errors
from varjax import nnx as vnnx
from varjax.nnx.compilation import jit_partial
from varjax.nnx.filter_maps import StateSharding

LIBS = {"varjax": vnnx, "flax": flax_nnx}
JIT_PARTIAL = {"varjax": jit_partial, "flax": flax_nnx.jit_partial}
MESH = jax.sharding.Mesh(jax.local_devices(), ("model",))
SPLIT = NamedSharding(MESH, P("model"))
REPLICATED = NamedSharding(MESH, P())


def _model(nnx):
    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4,)))
            self.c = nnx.Variable(jnp.full((4,), 2.0))     # read, never written

    return Model()


def _step(m, x, scale=1.0):
    m.w[...] = m.w[...] + m.c[...] * x * scale
    return m.w[...] * 2


def _run(lib, model=None, args=(jnp.ones(4),), **options):
    """One call of ``jit_partial(_step, model, **options)``: (output, the model)."""
    m = _model(LIBS[lib]) if model is None else model
    return JIT_PARTIAL[lib](_step, m, graph_updates=False, **options)(*args), m


@pytest.mark.parametrize("in_shardings", [(SPLIT, REPLICATED), SPLIT], ids=["tuple", "one"])
def test_in_shardings_shard_a_bound_module_and_its_updates_as_flax_nnx(in_shardings):
    seen = {}
    for lib in LIBS:
        out, m = _run(lib, in_shardings=in_shardings)
        seen[lib] = (np.asarray(out), np.asarray(m.w[...]), m.w[...].sharding, out.sharding)
    ours, theirs = seen["varjax"], seen["flax"]
    np.testing.assert_array_equal(ours[0], theirs[0])
    np.testing.assert_array_equal(ours[1], theirs[1])
    assert ours[2] == theirs[2] == SPLIT and ours[3] == theirs[3] == SPLIT


def test_in_shardings_entry_of_a_bound_tuple_is_broadcast_over_its_variables_as_flax_nnx():
    def bump(pair, x):
        for v in pair:
            v[...] = v[...] + x
        return x
    seen = {}
    for lib, nnx in LIBS.items():
        pair = (nnx.Param(jnp.ones(4)), nnx.Param(jnp.ones(4)))
        JIT_PARTIAL[lib](bump, pair, in_shardings=((SPLIT, REPLICATED), None),
                         graph=False)(jnp.ones(4))
        seen[lib] = [v[...].sharding for v in pair]
    assert seen["varjax"] == seen["flax"] == [SPLIT, REPLICATED]


def test_in_shardings_entry_may_be_a_tree_of_the_bound_module():
    """Beyond flax.nnx 0.12.8 (whose jit_partial takes such a tree and then fails in
    jax.jit on the Variables holding its shardings)."""
    m = _model(vnnx)
    tree = jax.tree.map(lambda _: SPLIT, m)
    out = jit_partial(_step, m, in_shardings=(tree, REPLICATED), graph=False)(jnp.ones(4))
    assert m.w[...].sharding == SPLIT and out.sharding == SPLIT
    np.testing.assert_array_equal(m.w[...], [3.0] * 4)


def test_in_shardings_skip_a_static_call_argument_as_jax_jit_s():
    """``jax.jit``'s convention: entries for the traced arguments only (flax.nnx 0.12.8's
    jit_partial fails on static arguments with a tuple of in_shardings, either way)."""
    m = _model(vnnx)
    fn = jit_partial(_branching, m, static_argnums=2, in_shardings=(SPLIT, REPLICATED),
                     graph_updates=False)
    np.testing.assert_array_equal(fn(jnp.ones(4), 3.0), [3.0] * 4)
    assert m.w[...].sharding == SPLIT


def test_in_shardings_with_too_few_entries_or_a_wrong_tree_is_a_config_error():
    m = _model(vnnx)
    with pytest.raises(errors.ConfigError, match="1 entries for 2 bound arguments"):
        jit_partial(lambda a, b, x: x, m, m, in_shardings=(SPLIT,), graph_updates=False)
    with pytest.raises(errors.ConfigError, match="entry 0 is not a prefix of bound argument 0"):
        jit_partial(_step, m, in_shardings=([SPLIT, SPLIT, SPLIT], None), graph_updates=False)


def test_out_shardings_place_the_output_as_flax_nnx():
    seen = {lib: _run(lib, out_shardings=SPLIT) for lib in LIBS}
    (ours, _), (theirs, _) = seen["varjax"], seen["flax"]
    assert ours.sharding == theirs.sharding == SPLIT
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("option", ["in_shardings", "out_shardings"])
def test_a_state_sharding_is_refused_as_flax_nnx(option):
    for lib, state_sharding in [("flax", flax_nnx.StateSharding), ("varjax", StateSharding)]:
        entry = state_sharding({...: SPLIT})
        value = (entry, None) if option == "in_shardings" else entry
        with pytest.raises(ValueError, match="cannot contain `StateSharding`"):
            JIT_PARTIAL[lib](_step, _model(LIBS[lib]), graph_updates=False, **{option: value})


@pytest.mark.parametrize("donate", [{"donate_argnums": 0}, {"donate_argnums": 1},
                                    {"donate_argnames": "x"}, {"donate_argnames": "m"}],
                         ids=["argnums-bound", "argnums-call", "argnames-call", "argnames-bound"])
def test_donation_counts_the_bound_arguments_as_one_as_flax_nnx(donate):
    """The same buffers deleted and the same output as flax.nnx; here every donated
    Variable comes back, written or not, so a second call (on the kept graph) runs too
    (flax.nnx's donate_argnames leaves the unwritten one deleted)."""
    seen = {}
    for lib in LIBS:
        m, x = _model(LIBS[lib]), jnp.ones(4)
        before = [m.w[...], m.c[...]]
        fn = JIT_PARTIAL[lib](_step, m, graph_updates=False, **donate)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # a buffer XLA could not reuse
            out = np.asarray(fn(x))
            seen[lib] = [out] + [b.is_deleted() for b in before + [x]]
            if lib == "varjax":
                np.testing.assert_array_equal(fn(jnp.ones(4)), [10.0] * 4)
                np.testing.assert_array_equal(m.c[...], [2.0] * 4)
    ours, theirs = seen["varjax"], seen["flax"]
    np.testing.assert_array_equal(ours[0], theirs[0])
    assert ours[1:] == theirs[1:]
    donates_bound = "m" in donate.values() or donate.get("donate_argnums") == 0
    assert ours[1:] == ([True, True, False] if donates_bound else [False, False, True])


def _branching(m, x, scale):
    return m.w[...] * (2.0 if scale > 1 else 1.0) + x     # a traced scale cannot branch


def test_static_argnames_makes_a_call_argument_static_by_name_or_position_as_flax_nnx():
    seen = {}
    for lib in LIBS:
        fn = JIT_PARTIAL[lib](_branching, _model(LIBS[lib]), static_argnames="scale",
                              graph_updates=False)
        seen[lib] = [np.asarray(fn(jnp.ones(4), scale=3.0)), np.asarray(fn(jnp.ones(4), 0.5))]
    np.testing.assert_array_equal(seen["varjax"], seen["flax"])
    np.testing.assert_array_equal(seen["varjax"], [[3.0] * 4, [2.0] * 4])


def test_static_argnames_names_fun_s_parameter_after_several_bound_arguments():
    """Positions past two bound arguments: ``scale`` is the call's second argument."""
    def two(m, n, x, scale):
        return _branching(m, x, scale) + n.w[...]
    fn = jit_partial(two, _model(vnnx), _model(vnnx), static_argnames="scale",
                     graph_updates=False)
    np.testing.assert_array_equal(fn(jnp.ones(4), 3.0), [4.0] * 4)


@pytest.mark.parametrize("static", [{"static_argnums": 0}, {"static_argnames": "m"}],
                         ids=["argnums", "argnames"])
def test_static_options_naming_the_bound_arguments_are_a_config_error(static):
    with pytest.raises(errors.ConfigError, match="names the bound arguments"):
        jit_partial(_step, _model(vnnx), graph_updates=False, **static)


@pytest.mark.parametrize("lib", LIBS)
def test_keep_unused_passes_an_unused_call_argument_to_the_program(lib):
    """Pruned, an unused argument is not handed to XLA: a deleted array there goes
    unnoticed; kept, it is JAX's error."""
    def fn(m, x, unused):
        return m.w[...] + x
    gone = jnp.ones(3)
    gone.delete()
    m = _model(LIBS[lib])
    np.testing.assert_array_equal(
        JIT_PARTIAL[lib](fn, m, graph_updates=False)(jnp.ones(4), gone), [2.0] * 4)
    with pytest.raises(RuntimeError, match="deleted"):
        JIT_PARTIAL[lib](fn, m, keep_unused=True, graph_updates=False)(jnp.ones(4), gone)


@pytest.mark.parametrize("option", [{"device": "first"}, {"backend": "cpu"}],
                         ids=["device", "backend"])
def test_device_and_backend_are_jax_jit_s_where_flax_nnx_refuses_them(option):
    """flax.nnx 0.12.8 passes out_shardings to jax.jit with them, which jax.jit refuses;
    here they are ``jax.jit``'s, as ``nnx.jit``'s are (deprecated there, with its warning)."""
    if "device" in option:
        option = {"device": jax.devices()[0]}
    with pytest.raises(ValueError, match="out_shardings"), warnings.catch_warnings():
        warnings.simplefilter("ignore")     # jax.jit's deprecation, before its refusal
        _run("flax", **option)
    with pytest.warns(DeprecationWarning, match="backend and device"):
        out, m = _run("varjax", **option)
    np.testing.assert_array_equal(out, [6.0] * 4)
    np.testing.assert_array_equal(m.w[...], [3.0] * 4)


@pytest.mark.parametrize("lib", LIBS)
def test_inline_puts_the_call_s_program_into_the_caller_s_as_flax_nnx(lib):
    """Inlined, the call is no ``jit`` of its own in the jaxpr of a function calling it."""
    def nested_jits(inline):
        fn = JIT_PARTIAL[lib](lambda m, x: m.w[...] * x, _model(LIBS[lib]), inline=inline,
                              graph_updates=False)
        return str(jax.make_jaxpr(fn)(jnp.ones(4))).count("jit[")
    assert nested_jits(True) == nested_jits(False) - 1
