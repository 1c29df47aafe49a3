"""Graph updates through ``nnx.shard_map`` and ``nnx.pmap``, against flax.nnx 0.12.8: an
argument's object the function returns is the caller's own, a structural change inside (a
``sow``, new, removed and static attributes, a new submodule, an alias) reaches the caller's
module, its new values coming out with the module's own entry; without graph updates what
flax.nnx refuses is refused and what it loses silently is an error.  ``pmap``'s donated
module and static module.  ``checkify`` as ``nnx.jit``; ``make_jaxpr`` and ``jit_partial``
(without graph updates only) refuse a returned Variable as flax.nnx does; ``scan`` gives back
an argument's module returned along the axis it is scanned along, and refuses any other as
flax.nnx does.  Two CPU devices (tests/conftest.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax.sharding import PartitionSpec as P

from varjax import errors, nnx
from varjax.nnx.sharding_transforms import pmap, shard_map

MESH = jax.sharding.Mesh(jax.devices()[:2], ("data",))
SHARD_MAP = {nnx: shard_map, flax_nnx: flax_nnx.shard_map}
PMAP = {nnx: pmap, flax_nnx: flax_nnx.pmap}
LIBS = (nnx, flax_nnx)
X = jnp.arange(4.0).reshape(2, 2) / 3


def _model(lib):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.linear = lib.Linear(2, 2, rngs=rngs)

        def __call__(self, x):
            y = self.linear(x)
            self.sow(lib.Intermediate, "y", y)
            return y
    return Model(lib.Rngs(0))


def _attributes(module):
    return sorted(k for k in vars(module) if not k.startswith("_"))


def _replicated(lib, fn, out_specs=P(), **options):
    return SHARD_MAP[lib](fn, mesh=MESH, in_specs=(P(), P()), out_specs=out_specs, **options)


# --- shard_map ------------------------------------------------------------------------------

def test_shard_map_returns_the_callers_module_and_submodule_as_flax():
    for lib in LIBS:
        model = _model(lib)
        m, sub, y = _replicated(lib, lambda m, x: (m, m.linear, m.linear(x)),
                                out_specs=(P(), P(), P()))(model, X)
        assert m is model and sub is model.linear
        np.testing.assert_array_equal(y, model.linear(X))


def test_shard_map_carries_a_sow_to_the_callers_module_as_flax():
    """Twice: the second call sees the module the first changed, and sows a second value."""
    sown = []
    for lib in LIBS:
        model = _model(lib)
        step = _replicated(lib, lambda m, x: m(x))
        step(model, X)
        step(model, 2 * X)
        sown.append([np.asarray(v) for v in model.y.get_value()])
    assert len(sown[0]) == len(sown[1]) == 2
    for a, b in zip(*sown):
        np.testing.assert_array_equal(a, b)


def test_shard_map_new_attribute_comes_out_with_its_modules_in_specs_as_flax():
    """A module sharded along 'data' gets its new Variable back sharded (concatenated): each
    shard's value differs, as flax.nnx gives the argument back with its in_specs."""
    got = []
    for lib in LIBS:
        class Holder(lib.Module):
            def __init__(self):
                self.w = lib.Param(jnp.arange(2.0))

        def mark(h):
            h.seen = lib.BatchStat(h.w[...] + jax.lax.axis_index("data").astype(jnp.float32))
            return jnp.zeros(())
        holder = Holder()
        SHARD_MAP[lib](mark, mesh=MESH, in_specs=(P("data"),), out_specs=P())(holder)
        got.append((type(holder.seen).__name__, np.asarray(holder.seen[...])))
    assert got[0][0] == got[1][0] == "BatchStat"
    np.testing.assert_array_equal(got[0][1], [0.0, 2.0])
    np.testing.assert_array_equal(got[0][1], got[1][1])


def test_shard_map_adds_removes_and_changes_attributes_of_the_callers_module_as_flax():
    seen = []
    for lib in LIBS:
        model = _model(lib)
        linear = model.linear

        def change(m, x):
            m.new = lib.Param(jnp.ones(3))
            m.rate = 5
            m.fresh = lib.Linear(2, 1, rngs=lib.Rngs(1))
            m.alias = m.linear
            del m.linear
            return x
        _replicated(lib, change)(model, X)
        assert model.alias is linear
        seen.append((_attributes(model), type(model.new).__name__, model.rate,
                     np.asarray(model.new[...]), np.asarray(model.fresh.kernel[...])))
    ours, theirs = seen
    assert ours[:3] == theirs[:3] == (["alias", "fresh", "new", "rate"], "Param", 5)
    for a, b in zip(ours[3:], theirs[3:]):
        np.testing.assert_array_equal(a, b)


def test_shard_map_new_array_attribute_reaches_the_caller_as_an_array():
    """Beyond flax.nnx 0.12.8, whose shard_map leaves a tracer at such an attribute."""
    model = _model(nnx)

    def add(m, x):
        m.array = jnp.full((1,), 2.0)
        return x
    _replicated(nnx, add)(model, X)
    assert isinstance(model.array, jax.Array)
    np.testing.assert_array_equal(model.array, [2.0])


def test_shard_map_without_graph_updates_refuses_a_returned_variable_as_flax():
    for lib, error in ((nnx, errors.InconsistentAliasError), (flax_nnx, ValueError)):
        with pytest.raises(error):
            _replicated(lib, lambda m, x: m.linear.kernel, graph_updates=False)(_model(lib), X)


def test_jit_without_graph_updates_refuses_a_variable_returned_bare_as_flax():
    for lib, error in ((nnx, errors.InconsistentAliasError), (flax_nnx, ValueError)):
        model = lib.Linear(2, 2, rngs=lib.Rngs(0))
        with pytest.raises(error):
            lib.jit(lambda m: m.kernel, graph_updates=False)(model)


def test_shard_map_without_graph_updates_refuses_the_sow_flax_loses():
    theirs = _model(flax_nnx)
    _replicated(flax_nnx, lambda m, x: m(x), graph_updates=False)(theirs, X)
    assert "y" not in _attributes(theirs)        # flax.nnx drops it silently
    with pytest.raises(errors.TransformError, match="attribute 'y' of Model .* was added"):
        _replicated(nnx, lambda m, x: m(x), graph_updates=False)(_model(nnx), X)


def test_shard_map_change_to_a_module_split_by_state_sharding_is_not_provided():
    specs = (nnx.StateSharding({nnx.Param: P(), ...: P()}), P())
    with pytest.raises(errors.NotProvidedError, match="module split by filters"):
        shard_map(lambda m, x: m(x), mesh=MESH, in_specs=specs, out_specs=P())(_model(nnx), X)


# --- pmap -----------------------------------------------------------------------------------

def test_pmap_returns_the_callers_module_and_sows_along_its_in_axes_as_flax():
    """A broadcast module's sown value comes back once; a stacked module's, stacked."""
    got = []
    for lib in LIBS:
        model = _model(lib)
        m, _ = PMAP[lib](lambda m, x: (m, m(x)), in_axes=(None, 0), out_axes=(None, 0))(
            model, X)
        assert m is model
        stack = lib.vmap(lambda r: _model(lib).__class__(r))(lib.Rngs(0).fork(split=2))
        PMAP[lib](lambda m, x: m(x), in_axes=(0, 0))(stack, X)
        got.append((np.asarray(model.y.get_value()[0]), np.asarray(stack.y.get_value()[0])))
    assert got[0][0].shape == (2,) and got[0][1].shape == (2, 2)
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


def test_pmap_without_graph_updates_refuses_a_returned_variable_as_flax():
    for lib, error in ((nnx, errors.InconsistentAliasError), (flax_nnx, ValueError)):
        with pytest.raises(error):
            PMAP[lib](lambda m, x: (m.linear.bias, x), in_axes=(None, 0), out_axes=(None, 0),
                      graph_updates=False)(_model(lib), X)


def test_pmap_donated_module_gets_every_variable_back_as_flax():
    got = []
    for lib in LIBS:
        model = _model(lib)
        kernel = model.linear.kernel[...]

        def step(m, x):
            m.linear.bias[...] += 1
            return m.linear(x)
        y = PMAP[lib](step, in_axes=(None, 0), donate_argnums=0)(model, X)
        assert kernel.is_deleted() and not model.linear.kernel[...].is_deleted()
        got.append((np.asarray(y), np.asarray(model.linear.kernel[...]),
                    np.asarray(model.linear.bias[...])))
    for a, b in zip(*got):
        np.testing.assert_array_equal(a, b)


def test_pmap_static_module_is_refused_with_flax_s_value_error():
    for lib, error in ((nnx, errors.ConfigError), (flax_nnx, ValueError)):
        with pytest.raises(error, match="static"):
            PMAP[lib](lambda x, m: m(x), in_axes=(0, None), static_broadcasted_argnums=1)(
                X, _model(lib))
    assert issubclass(errors.ConfigError, ValueError)

# --- checkify, make_jaxpr, jit_partial ------------------------------------------------------

def test_checkify_returns_the_callers_module_and_carries_a_sow_as_flax():
    sown = []
    for lib in LIBS:
        model = _model(lib)
        _, (m, _) = lib.checkify(lambda m, x: (m, m(x)))(model, X)
        assert m is model
        sown.append(np.asarray(model.y.get_value()[0]))
    np.testing.assert_array_equal(*sown)


def test_checkify_without_graph_updates_refuses_a_returned_variable_as_flax():
    for lib, error in ((nnx, errors.InconsistentAliasError), (flax_nnx, ValueError)):
        with pytest.raises(error):
            lib.checkify(lambda m, x: (m.linear, x), graph_updates=False)(_model(lib), X)


def test_make_jaxpr_refuses_a_returned_variable_as_flax():
    for lib, error in ((nnx, errors.InconsistentAliasError), (flax_nnx, ValueError)):
        with pytest.raises(error):
            lib.make_jaxpr(lambda m, x: (m.linear.kernel, x), graph_updates=False)(
                _model(lib), X)


def test_jit_partial_refuses_a_returned_bound_module_as_flax():
    for lib, error in ((nnx, errors.InconsistentAliasError), (flax_nnx, ValueError)):
        with pytest.raises(error):
            lib.jit_partial(lambda m, x: (m.linear, x), _model(lib), graph_updates=False)(X)


# --- scan's stacked outputs -----------------------------------------------------------------

def _stack(lib, out_axes=0):
    return lib.vmap(lambda r: lib.Linear(2, 2, rngs=r), out_axes=out_axes)(
        lib.Rngs(0).fork(split=3))


def test_scan_gives_back_a_module_returned_along_its_own_axis_as_flax():
    for lib in LIBS:
        stack, wide = _stack(lib), _stack(lib, out_axes=1)
        _, m, kernel = lib.scan(lambda c, m: (c, m, m.kernel), out_axes=(lib.Carry, 0, 0))(
            jnp.zeros(()), stack)
        assert m is stack and kernel is stack.kernel
        _, m = lib.scan(lambda c, m: (c, m), in_axes=(lib.Carry, 1), out_axes=(lib.Carry, 1))(
            jnp.zeros(()), wide)
        assert m is wide


@pytest.mark.parametrize("axes", ["mismatch", "broadcast"])
def test_scan_refuses_a_module_returned_along_another_axis_as_flax(axes):
    for lib, error in ((nnx, errors.InconsistentAliasError), (flax_nnx, ValueError)):
        stack = _stack(lib)
        if axes == "mismatch":
            run = lib.scan(lambda c, m: (c, m), out_axes=(lib.Carry, 1))
        else:
            run = lib.scan(lambda c, m, x: (c, m), in_axes=(lib.Carry, None, 0))
        with pytest.raises(error):
            run(jnp.zeros(()), stack) if axes == "mismatch" else run(
                jnp.zeros(()), stack, jnp.ones((3,)))


def test_scan_without_graph_updates_refuses_a_returned_module_as_flax():
    for lib, error in ((nnx, errors.InconsistentAliasError), (flax_nnx, ValueError)):
        with pytest.raises(error):
            lib.scan(lambda c, m: (c, m), graph_updates=False)(jnp.zeros(()), _stack(lib))
