"""Options of nnx.fori_loop, nnx.scan, nnx.vmap, nnx.pmap and nnx.shard_map against flax.nnx
0.12.8 (``unroll``, ``_split_transpose``, ``transform_metadata``, ``pmap``'s JAX options,
``StateAxes``/``StateSharding`` where flax takes them, a module scanned along a nonzero
axis): the same values and Variable metadata, the same updates written back, an option
reaching JAX's primitive where it has a parameter; what stays refused, with flax.nnx's
behaviour that the refusal names."""
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from counting_model import X
from counting_model import counting_model as _model
from counting_model import same_state as _same_state
from flax import nnx as flax_nnx
from jax.sharding import PartitionSpec as P

from varjax import errors, nnx
from varjax.nnx.batching import vmap
from varjax.nnx.control import fori_loop
from varjax.nnx.iteration import Carry, scan
from varjax.nnx.sharding_transforms import pmap


def _params(jaxpr, name):
    """The ``name`` parameter of every ``scan`` equation of ``jaxpr``, nested ones too."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn.params[name])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _params(sub, name)
    return found


def _body(i, carry):
    m, h = carry
    return m, m(h)


# --- fori_loop(unroll=...) ---------------------------------------------------------------

@pytest.mark.parametrize("unroll", [2, True])
def test_fori_loop_unroll_matches_flax_and_writes_updates_back(unroll):
    ours, theirs = _model(nnx), _model(flax_nnx)
    m, h = fori_loop(0, 3, _body, (ours, X), unroll=unroll)
    fm, fh = flax_nnx.fori_loop(0, 3, _body, (theirs, X), unroll=unroll)
    np.testing.assert_array_equal(h, fh)
    assert m is ours
    assert int(ours.count[...]) == 3
    _same_state(ours, theirs)


def test_fori_loop_unroll_reaches_jaxs_scan():
    jaxpr = jax.make_jaxpr(lambda x: fori_loop(0, 4, lambda i, h: h * 2, x, unroll=2))(X)
    assert _params(jaxpr.jaxpr, "unroll") == [2]


def test_fori_loop_unroll_with_traced_bounds_is_jaxs_error():
    ours = _model(nnx)
    with pytest.raises(ValueError, match="unroll"):
        jax.jit(lambda n: fori_loop(0, n, _body, (ours, X), unroll=2)[1])(3)


# --- scan(_split_transpose=...) ----------------------------------------------------------

def _rnn_loss(lib, scan_):
    def loss(m, xs):
        def step(m, h, x):
            return m(h + x), None
        h, _ = scan_(step, in_axes=(None, lib.Carry, 0), out_axes=(lib.Carry, 0),
                     _split_transpose=True)(m, jnp.zeros(2), xs)
        return h.sum()
    return loss


def test_scan_split_transpose_gradients_match_flax():
    ours, theirs = _model(nnx), _model(flax_nnx)
    g = nnx.grad(_rnn_loss(nnx, scan))(ours, X)
    fg = flax_nnx.grad(_rnn_loss(flax_nnx, flax_nnx.scan))(theirs, X)
    a, b = nnx.to_pure_dict(g), flax_nnx.to_pure_dict(fg)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6)


def test_scan_split_transpose_is_taken_and_ignored_as_jax_ignores_it():
    def traced(**kw):
        run = scan(lambda c, x: (c * x, c), in_axes=(Carry, 0), out_axes=(Carry, 0), **kw)
        return str(jax.make_jaxpr(jax.grad(lambda c, xs: run(c, xs)[0]))(1.0, X[:, 0]))
    assert traced(_split_transpose=True) == traced()


# --- vmap(transform_metadata=...) --------------------------------------------------------

TM = {nnx.PARTITION_NAME: "layers"}


def _layer(lib, seen):
    class Layer(lib.Module):
        def __init__(self, rngs):
            self.w = lib.Param(rngs.params.uniform((2,)), out_sharding=("embed",))
            seen.append(self.w.out_sharding)

        def __call__(self, x):
            seen.append(self.w.out_sharding)
            return x * self.w[...]
    return Layer


def _vmapped_stack(lib, vmap_, out_axes=0):
    seen = []
    with flax_nnx.use_eager_sharding(False):    # no mesh: flax would place it eagerly
        stack = vmap_(_layer(lib, seen), out_axes=out_axes, transform_metadata=TM)(
            lib.Rngs(0).split(3))
        y = vmap_(lambda m, x: m(x), in_axes=(out_axes, None), transform_metadata=TM)(
            stack, X[0])
    return stack, y, seen


def test_vmap_transform_metadata_adds_the_partition_to_made_variables_as_flax():
    ours, y, seen = _vmapped_stack(nnx, vmap)
    theirs, fy, fseen = _vmapped_stack(flax_nnx, flax_nnx.vmap)
    assert ours.w.out_sharding == theirs.w.out_sharding == ("layers", "embed")
    assert seen == fseen == [("embed",), ("embed",)]    # inside: one member's names
    np.testing.assert_array_equal(ours.w[...], theirs.w[...])
    np.testing.assert_array_equal(y, fy)


def test_vmap_transform_metadata_puts_the_partition_at_out_axes_as_flax():
    ours, _, _ = _vmapped_stack(nnx, vmap, out_axes=1)
    theirs, _, _ = _vmapped_stack(flax_nnx, flax_nnx.vmap, out_axes=1)
    assert ours.w.out_sharding == theirs.w.out_sharding == ("embed", "layers")
    assert ours.w.shape == theirs.w.shape == (2, 3)


def test_vmap_transform_metadata_without_partition_name_changes_nothing_as_flax():
    seen = []
    stack = vmap(_layer(nnx, seen), transform_metadata={"other": "x"})(nnx.Rngs(0).split(2))
    assert stack.w.out_sharding == ("embed",) and seen == [("embed",)]


def test_scan_transform_metadata_with_a_state_axes_in_out_axes_is_not_provided():
    with pytest.raises(errors.NotProvidedError, match="StateAxes in out_axes"):
        scan(lambda x: x, in_axes=0, out_axes=nnx.StateAxes({nnx.Param: 0, ...: 1}),
             transform_metadata=TM)


def test_vmap_transform_metadata_with_a_state_axes_output_as_flax():
    def made(lib):
        with flax_nnx.use_eager_sharding(False):
            return lib.vmap(_layer(lib, []), out_axes=lib.StateAxes({lib.Param: 1, ...: 0}),
                            transform_metadata=TM)(lib.Rngs(0).split(3))
    ours, theirs = made(nnx), made(flax_nnx)
    assert ours.w.out_sharding == theirs.w.out_sharding == ("embed", "layers")
    np.testing.assert_array_equal(ours.w[...], theirs.w[...])


def _half_mapped(lib, transform, axes):
    """A stack whose Params are mapped and whose BatchStat (also named) is broadcast: only
    the Params' names lose the partition inside."""
    seen = []
    with flax_nnx.use_eager_sharding(False):
        stack = _vmapped_stack(lib, lib.vmap)[0]
        stack.s = lib.BatchStat(jnp.ones((3,)), out_sharding=("layers",))

        def apply(m, x):
            seen.append((m.w.out_sharding, m.s.out_sharding))
            return m(x) * m.s[...].sum()
        y = transform(apply, in_axes=(axes(lib), None), transform_metadata=TM)(stack, X[0])
    return stack, y, seen


@pytest.mark.parametrize("name", ["vmap", "scan"])
def test_transform_metadata_with_a_state_axes_argument_as_flax(name):
    def axes(lib):
        return lib.StateAxes({lib.Param: 0, ...: None})
    ours_t, flax_t = {"vmap": (vmap, flax_nnx.vmap), "scan": (scan, flax_nnx.scan)}[name]
    kw = {} if name == "vmap" else {"out_axes": 0}
    ours, y, seen = _half_mapped(nnx, functools.partial(ours_t, **kw), axes)
    theirs, fy, fseen = _half_mapped(flax_nnx, functools.partial(flax_t, **kw), axes)
    assert seen[-1] == fseen[-1] == (("embed",), ("layers",))
    assert ours.w.out_sharding == theirs.w.out_sharding == ("layers", "embed")
    np.testing.assert_array_equal(y, fy)


def test_vmap_transform_metadata_of_another_partition_is_a_value_error_as_flax():
    for lib, vmap_ in [(nnx, vmap), (flax_nnx, flax_nnx.vmap)]:
        stack, _, _ = _vmapped_stack(lib, vmap_)
        with pytest.raises(ValueError, match="'layers'"):
            vmap_(lambda m: m.w[...], transform_metadata={nnx.PARTITION_NAME: "other"})(stack)


# --- scan(transform_metadata=...) --------------------------------------------------------

def _scanned(lib, vmap_, scan_):
    stack, _, seen = _vmapped_stack(lib, vmap_)
    seen.clear()
    with flax_nnx.use_eager_sharding(False):
        h = scan_(lambda m, h: m(h), in_axes=(0, lib.Carry), out_axes=lib.Carry,
                  transform_metadata=TM)(stack, X[0])
        ys = scan_(lambda c, x: (c, lib.Variable(x, out_sharding=("embed",))),
                   in_axes=(lib.Carry, 0), out_axes=(lib.Carry, 0),
                   transform_metadata=TM)(jnp.zeros(()), X)[1]
    return stack, h, seen, ys


def test_scan_transform_metadata_removes_and_adds_the_partition_as_flax():
    ours, h, seen, ys = _scanned(nnx, vmap, scan)
    theirs, fh, fseen, fys = _scanned(flax_nnx, flax_nnx.vmap, flax_nnx.scan)
    assert seen == fseen == [("embed",)]                # inside a step: one layer's names
    assert ours.w.out_sharding == theirs.w.out_sharding == ("layers", "embed")
    assert ys.out_sharding == fys.out_sharding == ("layers", "embed")
    np.testing.assert_array_equal(h, fh)
    np.testing.assert_array_equal(ys[...], fys[...])


# --- pmap(static_broadcasted_argnums=, backend=, donate_argnums=, transform_metadata=) ----

PMAP = {nnx: pmap, flax_nnx: flax_nnx.pmap}


def _one_device_stack(lib, vmap_, seen):
    with flax_nnx.use_eager_sharding(False):
        return vmap_(_layer(lib, seen), transform_metadata=TM)(lib.Rngs(0).split(1))


def _pmapped(lib, vmap_, **options):
    seen = []
    stack = _one_device_stack(lib, vmap_, seen)
    seen.clear()

    def apply(m, x, power):
        return m(x) ** power
    y = PMAP[lib](apply, in_axes=(0, 0, None), **options)(stack, X[None, 0], 2)
    return stack, y, seen


@pytest.mark.parametrize("options", [dict(static_broadcasted_argnums=2),
                                     dict(static_broadcasted_argnums=(2,), backend="cpu"),
                                     dict(donate_argnums=1, transform_metadata=TM)])
def test_pmap_options_match_flax_and_write_updates_back(options):
    ours, y, seen = _pmapped(nnx, vmap, **options)
    theirs, fy, fseen = _pmapped(flax_nnx, flax_nnx.vmap, **options)
    np.testing.assert_array_equal(y, fy)
    assert ours.w.out_sharding == theirs.w.out_sharding == ("layers", "embed")
    assert seen == fseen == [("embed",) if "transform_metadata" in options
                             else ("layers", "embed")]


def test_pmap_static_argument_reaches_jax_as_a_python_value():
    got = []
    pmap(lambda x, k: got.append(type(k)) or x * k, static_broadcasted_argnums=1)(X[None], 3)
    assert got == [int]


# --- scan over a module along an axis other than 0 ---------------------------------------

def _counted_layer(lib):
    class Layer(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
            self.count = lib.BatchStat(jnp.zeros((1,)))

        def __call__(self, x):
            self.count[...] += 1
            return self.lin(x)
    return Layer


def _scan_along_1(lib, scan_, axes, jit=False):
    stack = lib.vmap(_counted_layer(lib), out_axes=1)(lib.Rngs(0).split(3))
    run = scan_(lambda h, m: m(h), in_axes=(lib.Carry, axes), out_axes=lib.Carry)
    h = (lib.jit(run) if jit else run)(X[0], stack)
    return stack, h


@pytest.mark.parametrize("state_axes", [False, True])
def test_scan_over_a_module_along_axis_1_matches_flax_and_writes_updates_back(state_axes):
    def axes(lib):
        return lib.StateAxes({lib.Param: 1, ...: 1}) if state_axes else 1
    ours, h = _scan_along_1(nnx, scan, axes(nnx))
    theirs, fh = _scan_along_1(flax_nnx, flax_nnx.scan, axes(flax_nnx))
    np.testing.assert_array_equal(h, fh)
    assert ours.lin.kernel.shape == (2, 3, 2) and ours.count.shape == (1, 3)
    _same_state(ours, theirs)
    np.testing.assert_array_equal(ours.count[...], jnp.ones((1, 3)))


def test_scan_over_a_module_along_axis_1_inside_nnx_jit_matches_eager():
    ours, h = _scan_along_1(nnx, scan, 1, jit=True)
    eager, eh = _scan_along_1(nnx, scan, 1)
    np.testing.assert_array_equal(h, eh)
    np.testing.assert_array_equal(ours.count[...], eager.count[...])


def test_scan_returns_a_variable_made_inside_along_out_axes_1_as_flax():
    def made(lib, scan_):
        return scan_(lambda c, x: (c, lib.Param(jnp.stack([x, 2 * x]))), in_axes=(lib.Carry, 0),
                     out_axes=(lib.Carry, 1))(jnp.zeros(()), X)[1]
    ours, theirs = made(nnx, scan), made(flax_nnx, flax_nnx.scan)
    assert ours.shape == theirs.shape == (2, 3, 2)
    np.testing.assert_array_equal(ours[...], theirs[...])


# --- vmap(out_axes=StateAxes({...: None})) -----------------------------------------------

def _ensemble(lib, axes, n=3):
    class Member(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
            self.count = lib.BatchStat(jnp.zeros(()))
    return lib.vmap(Member, out_axes=axes)(lib.Rngs(0).split(n))


def test_vmap_out_axes_state_axes_none_gives_the_state_once_as_flax():
    ours = _ensemble(nnx, nnx.StateAxes({nnx.Param: 1, ...: None}))
    theirs = _ensemble(flax_nnx, flax_nnx.StateAxes({flax_nnx.Param: 1, ...: None}))
    assert ours.lin.kernel.shape == theirs.lin.kernel.shape == (2, 3, 2)
    assert ours.count.shape == theirs.count.shape == ()
    _same_state(ours, theirs)


def test_vmap_out_axes_none_of_a_state_that_differs_per_member_is_jaxs_error():
    for lib in (nnx, flax_nnx):
        with pytest.raises(ValueError, match="out_axes"):
            _ensemble(lib, lib.StateAxes({lib.BatchStat: 0, ...: None}))


def test_vmap_returning_an_argument_at_a_state_axes_output_gives_the_callers_object():
    """With graph updates, as flax.nnx; without them the aliasing is refused, as flax.nnx
    refuses it."""
    outs = []
    for lib in (nnx, flax_nnx):
        stack = _ensemble(lib, 0)
        vmap_ = vmap if lib is nnx else flax_nnx.vmap
        outs.append((vmap_(lambda m: m, out_axes=lib.StateAxes({...: 0}))(stack), stack))
    assert all(out is stack for out, stack in outs)
    with pytest.raises(errors.InconsistentAliasError, match="cannot be an output"):
        vmap(lambda m: m, out_axes=nnx.StateAxes({...: 0}), graph_updates=False)(outs[0][1])


# --- StateAxes in pmap, StateSharding nested in shard_map's specs ---------------------------

MESH = jax.sharding.Mesh(jax.devices()[:1], ("data",))


@pytest.mark.parametrize("nested", [False, True])
def test_pmap_state_axes_anywhere_in_in_axes_matches_flax(nested):
    def run(lib, pmap_):
        stack = _ensemble(lib, lib.StateAxes({lib.Param: 0, ...: None}), n=1)
        sa = lib.StateAxes({lib.Param: 0, ...: None})

        def apply(m, x):
            m = m[0] if nested else m
            m.count[...] += 1
            return m.lin(x)
        y = pmap_(apply, in_axes=((sa, None) if nested else sa, 0))(
            (stack, 1.0) if nested else stack, X[None, 0])
        return stack, y
    (ours, y), (theirs, fy) = run(nnx, pmap), run(flax_nnx, flax_nnx.pmap)
    np.testing.assert_array_equal(y, fy)
    _same_state(ours, theirs)
    assert float(ours.count[...]) == 1.0


def test_pmap_out_axes_state_axes_gives_each_state_its_axis_as_flax():
    def made(lib, pmap_):
        class Member(lib.Module):
            def __init__(self, rngs):
                self.lin = lib.Linear(2, 2, rngs=rngs)
                self.count = lib.BatchStat(jnp.zeros(()))
        return pmap_(Member, out_axes=lib.StateAxes({lib.Param: 0, ...: None}))(
            lib.Rngs(0).split(1))
    ours, theirs = made(nnx, pmap), made(flax_nnx, flax_nnx.pmap)
    assert ours.lin.kernel.shape == theirs.lin.kernel.shape == (1, 2, 2)
    assert ours.count.shape == theirs.count.shape == ()
    _same_state(ours, theirs)


def test_shard_map_state_sharding_nested_in_specs_matches_flax():
    def run(lib):
        m = _model(lib)
        spec = lib.StateSharding({lib.Param: P(), ...: P()})

        def apply(pair, x):
            return (lib.Linear(2, 2, rngs=lib.Rngs(1)), pair[0](x)),
        out = lib.shard_map(apply, mesh=MESH, in_specs=((spec, P()), P("data")),
                            out_specs=((spec, P("data")),))((m, jnp.ones(())), X)
        return m, out[0]
    (ours, (made, y)), (theirs, (fmade, fy)) = run(nnx), run(flax_nnx)
    np.testing.assert_array_equal(y, fy)
    _same_state(ours, theirs)
    _same_state(made, fmade)
    assert type(made) is nnx.Linear


# --- fori_loop: carry objects moved by the body --------------------------------------------

def _swapping(lib):
    class Cell(lib.Module):
        def __init__(self, v):
            self.v = lib.BatchStat(jnp.array(v))

    def body(i, c):
        p, q = c
        p.v[...] = p.v[...] * 10 + i
        return q, p
    return Cell(1.0), Cell(2.0), body


def test_fori_loop_moving_carry_objects_stays_refused_as_flax_places_them_per_one_step():
    """After 4 swaps Python's loop gives (p, q) with p.v == 102; flax.nnx gives q first, its
    objects placed by one step's output, holding the values of those places."""
    p, q, body = _swapping(flax_nnx)
    out = flax_nnx.fori_loop(0, 4, body, (p, q))
    assert out[0] is q and float(p.v[...]) == 213.0 and float(q.v[...]) == 102.0
    p, q, body = _swapping(nnx)
    with pytest.raises(errors.CarryIdentityError, match="whatever the number of steps"):
        fori_loop(0, 4, body, (p, q))
