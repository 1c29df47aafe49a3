"""``nnx.cond``/``switch``/``while_loop``/``fori_loop``/``eval_shape``/``vmap`` in graph mode,
against flax.nnx 0.12.8: the same outputs and the same updates written back to the caller's
module, bit for bit; what is not built is refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx
from jax.sharding import PartitionSpec as P

from varjax import errors, nnx
from varjax.nnx.batching import vmap
from varjax.nnx.control import cond, eval_shape, fori_loop, switch, while_loop

X = jnp.arange(10.0).reshape(5, 2) / 7


def _model(lib, seed=0):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 3, rngs=rngs)
            self.bn = lib.BatchNorm(3, rngs=rngs)
            self.count = lib.BatchStat(jnp.array(0))

        def __call__(self, x):
            self.count[...] += 1
            return self.bn(self.lin(x))
    return Model if seed is None else Model(lib.Rngs(seed))


def _same_state(ours, theirs, same_paths=True):
    """The same values (RNG keys by their data); with ``same_paths`` the same tree too (a
    Dropout's stream sits one level deeper in varjax.nnx, notes/nnx.md)."""
    a, b = nnx.to_pure_dict(nnx.state(ours)), flax_nnx.to_pure_dict(flax_nnx.state(theirs))
    if same_paths:
        assert jax.tree.structure(a) == jax.tree.structure(b)
    leaves = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves[0]) == len(leaves[1])
    for x, y in zip(*leaves):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(x, y)


def _pair():
    return _model(nnx), _model(flax_nnx)


# --- cond / switch -----------------------------------------------------------------------

@pytest.mark.parametrize("pred", [True, False])
def test_cond_batchnorm_and_counter_updates_in_a_branch_are_written_back(pred):
    ours, theirs = _pair()

    def branches(lib):
        return (lambda m, x: m(x)), (lambda m, x: m.lin(x))
    y = cond(pred, *branches(nnx), ours, X)
    fy = flax_nnx.cond(pred, *branches(flax_nnx), theirs, X)
    np.testing.assert_array_equal(y, fy)
    _same_state(ours, theirs)
    assert int(ours.count[...]) == int(pred)


def test_switch_picks_the_branch_and_writes_its_updates_back():
    ours, theirs = _pair()

    def branches(m, x):
        return m(x)

    def other(m, x):
        m.count[...] += 10
        return m.lin(x)
    for index in (1, 0, 2):
        np.testing.assert_array_equal(
            switch(index, [branches, other, other], ours, X),
            flax_nnx.switch(index, [branches, other, other], theirs, X))
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 21


def test_cond_inside_nnx_jit_with_a_traced_predicate():
    from varjax.nnx.transforms import jit
    ours, theirs = _pair()

    def step(lib, cond_fn):
        return lambda m, x: cond_fn(jnp.sum(x) > 0, lambda m, x: m(x), lambda m, x: -m.lin(x),
                                    m, x)
    np.testing.assert_array_equal(jit(step(nnx, cond))(ours, X),
                                  flax_nnx.jit(step(flax_nnx, flax_nnx.cond))(theirs, X))
    _same_state(ours, theirs)


# --- while_loop / fori_loop ----------------------------------------------------------------

def _body(i, carry):
    m, h = carry
    return m, m(h)[:, :2]


def test_fori_loop_writes_updates_back_and_returns_the_callers_module():
    ours, theirs = _pair()
    m, h = fori_loop(0, 3, _body, (ours, X))
    fm, fh = flax_nnx.fori_loop(0, 3, _body, (theirs, X))
    assert m is ours and fm is theirs
    np.testing.assert_array_equal(h, fh)
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 3


def test_fori_loop_with_traced_bounds_inside_jit():
    from varjax.nnx.transforms import jit
    ours, theirs = _pair()

    def run(lib, loop):
        return lambda m, x, n: loop(0, n, _body, (m, x))[1]
    np.testing.assert_array_equal(jit(run(nnx, fori_loop))(ours, X, jnp.array(2)),
                                  flax_nnx.jit(run(flax_nnx, flax_nnx.fori_loop))(theirs, X,
                                                                                jnp.array(2)))
    _same_state(ours, theirs)


def test_while_loop_counter_in_cond_fun_and_batchnorm_updates_come_back():
    ours, theirs = _pair()

    def body(carry):
        return _body(None, carry)
    m, h = while_loop(lambda c: c[0].count[...] < 4, body, (ours, X))
    fm, fh = flax_nnx.while_loop(lambda c: c[0].count[...] < 4, body, (theirs, X))
    assert m is ours
    np.testing.assert_array_equal(h, fh)
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 4


def test_fori_loop_design_note_example_sets_the_kernel_each_step():
    ours, theirs = nnx.Linear(3, 3, rngs=nnx.Rngs(0)), flax_nnx.Linear(3, 3, rngs=flax_nnx.Rngs(0))
    x = jnp.arange(3.0)

    def fwd(i, carry):
        m, y = carry
        m.kernel[...] = jnp.identity(3) * i
        return m, m(y)
    _, y = fori_loop(2, 4, fwd, (ours, x))
    _, fy = flax_nnx.fori_loop(2, 4, fwd, (theirs, x))
    np.testing.assert_array_equal(y, fy)
    np.testing.assert_array_equal(y, x * 2 * 3)
    np.testing.assert_array_equal(ours.kernel[...], theirs.kernel[...])


def _swap(i, carry):
    a, b = carry
    a.count[...] += 1
    return b, a


def test_fori_loop_body_moving_carry_objects_is_refused():
    with pytest.raises(errors.CarryIdentityError, match="other places"):
        fori_loop(0, 3, _swap, (_model(nnx), _model(nnx, 1)))


def test_while_loop_body_moving_carry_objects_is_refused_as_flax_refuses_it():
    p, q = _model(nnx), _model(nnx, 1)
    with pytest.raises(errors.TransformError, match="other places"):
        while_loop(lambda c: c[0].count[...] < 3, lambda c: _swap(0, c), (p, q))
    with pytest.raises(ValueError, match="same reference"):
        flax_nnx.while_loop(lambda c: c[0].count[...] < 3, lambda c: _swap(0, c),
                            (_model(flax_nnx), _model(flax_nnx, 1)))


def test_fori_loop_body_returning_a_new_module_is_refused():
    with pytest.raises(errors.TransformError, match="not the ones it was given"):
        fori_loop(0, 2, lambda i, c: (_model(nnx, 3), c[1]), (_model(nnx), X))


# --- eval_shape ----------------------------------------------------------------------------

def test_eval_shape_of_a_constructor_gives_an_abstract_model_like_flax():
    Model, FModel = _model(nnx, None), _model(flax_nnx, None)
    abstract = eval_shape(lambda: Model(nnx.Rngs(0)))
    fabstract = flax_nnx.eval_shape(lambda: FModel(flax_nnx.Rngs(0)))
    assert type(abstract) is Model and type(abstract.lin.kernel) is nnx.Param
    ours = jax.tree.map(lambda s: (s.shape, s.dtype), nnx.to_pure_dict(nnx.state(abstract)))
    theirs = jax.tree.map(lambda s: (s.shape, s.dtype),
                          flax_nnx.to_pure_dict(flax_nnx.state(fabstract)))
    assert ours == theirs


def test_eval_shape_of_a_forward_writes_nothing_back():
    ours, theirs = _pair()
    out = eval_shape(lambda m, x: m(x), ours, x=X)
    fout = flax_nnx.eval_shape(lambda m, x: m(x), theirs, x=X)
    assert out == fout == jax.ShapeDtypeStruct((5, 3), jnp.float32)
    _same_state(ours, theirs)
    assert int(ours.count[...]) == 0


def test_eval_shape_of_a_bound_method_is_refused_as_flax_refuses_it():
    ours, theirs = _pair()
    with pytest.raises(ValueError, match="does not support bound methods"):
        eval_shape(ours.__call__, X)
    with pytest.raises(ValueError, match="does not support bound methods"):
        flax_nnx.eval_shape(theirs.__call__, X)


# --- vmap ----------------------------------------------------------------------------------

def test_vmap_ensemble_created_from_forked_rngs_matches_flax_and_forward_updates_stats():
    Model, FModel = _model(nnx, None), _model(flax_nnx, None)
    ens = vmap(lambda rngs: Model(rngs), in_axes=0)(nnx.Rngs(0).fork(split=4))
    with pytest.warns(DeprecationWarning):
        fens = flax_nnx.vmap(lambda rngs: FModel(rngs), in_axes=0)(
            flax_nnx.Rngs(0).fork(split=4))
    assert ens.lin.kernel.shape == (4, 2, 3)
    _same_state(ens, fens)
    y = vmap(lambda m, x: m(x), in_axes=(0, None))(ens, X)
    # varjax compiles the whole body as jit does; flax.nnx's eager vmap differs from its own
    # jitted one by 3e-5 here (BatchNorm's fast variance), so compare with that
    fy = flax_nnx.jit(flax_nnx.vmap(lambda m, x: m(x), in_axes=(0, None)))(fens, X)
    assert y.shape == (4, 5, 3)
    np.testing.assert_array_equal(y, fy)
    _same_state(ens, fens)
    np.testing.assert_array_equal(ens.count[...], [1, 1, 1, 1])


def test_vmap_broadcast_module_over_a_batch_with_keyword_argument_and_decorator():
    ours, theirs = nnx.Linear(2, 3, rngs=nnx.Rngs(0)), flax_nnx.Linear(2, 3, rngs=flax_nnx.Rngs(0))

    @vmap(in_axes=(None, 0), out_axes=1)
    def forward(m, x):
        return m(x)
    ftheirs = flax_nnx.vmap(lambda m, x: m(x), in_axes=(None, 0), out_axes=1)
    np.testing.assert_array_equal(forward(ours, x=X), ftheirs(theirs, x=X))
    assert forward(ours, X).shape == (3, 5)


def test_vmap_axis_name_and_axis_size():
    ours = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    total = vmap(lambda m, x: jax.lax.psum(m(x), "b"), in_axes=(None, 0), axis_name="b")(ours, X)
    np.testing.assert_allclose(total[0], ours(X).sum(0), rtol=1e-6)
    ones = vmap(lambda m: m(jnp.ones(2)), in_axes=None, axis_size=3)(ours)
    assert ones.shape == (3, 3)


def test_vmap_broadcast_module_written_per_member_is_an_error():
    ours = _model(nnx)
    with pytest.raises(errors.TransformError, match="in_axes=None"):
        vmap(lambda m, x: m(x), in_axes=(None, 0))(ours, X[:, None, :])


@pytest.mark.parametrize("spmd", [None, "x"])
def test_vmap_spmd_axis_name_shards_the_mapped_axis_over_the_mesh_as_flax(spmd):
    """A sharding constraint inside the body is per member; ``spmd_axis_name`` adds the mesh
    axis at the mapped dimension, as ``jax.vmap`` (and flax.nnx) do."""
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    specs = []
    for lib, vmap_ in ((flax_nnx, flax_nnx.vmap), (nnx, vmap)):
        layer = lib.Linear(2, 3, rngs=lib.Rngs(0))

        def body(m, x):
            return jax.lax.with_sharding_constraint(m(x), jax.sharding.NamedSharding(mesh, P()))
        with jax.set_mesh(mesh):
            y = vmap_(body, in_axes=(None, 0), spmd_axis_name=spmd)(layer, X[:4])
        specs.append(y.sharding.spec)
    assert specs[0] == specs[1] == (P("x") if spmd else P())


def test_vmap_of_a_bound_method_is_refused_as_flax_refuses_it():
    with pytest.raises(ValueError, match="does not support bound methods"):
        vmap(_model(nnx).__call__)


def _dropout_model(lib):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 3, rngs=rngs)
            self.drop = lib.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))
    return Model


def test_vmap_ensemble_with_dropout_draws_flax_masks_per_member_and_advances_streams():
    Model, FModel = _dropout_model(nnx), _dropout_model(flax_nnx)
    ens = vmap(lambda rngs: Model(rngs))(nnx.Rngs(0, dropout=1).fork(split=4))
    with pytest.warns(DeprecationWarning):
        fens = flax_nnx.vmap(lambda rngs: FModel(rngs))(flax_nnx.Rngs(0, dropout=1).fork(split=4))
    for _ in range(2):     # the second call draws new masks: the stream counts came back
        y = vmap(lambda m, x: m(x), in_axes=(0, None))(ens, X)
        np.testing.assert_array_equal(
            y, flax_nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(fens, X))
    assert not all(np.array_equal(y[0], y[i]) for i in range(1, 4))
    _same_state(ens, fens, same_paths=False)


def test_fori_loop_dropout_draws_flax_masks_each_step():
    ours, theirs = _dropout_model(nnx)(nnx.Rngs(0, dropout=1)), \
        _dropout_model(flax_nnx)(flax_nnx.Rngs(0, dropout=1))
    np.testing.assert_array_equal(fori_loop(0, 3, _body, (ours, X))[1],
                                  flax_nnx.fori_loop(0, 3, _body, (theirs, X))[1])
    _same_state(ours, theirs, same_paths=False)


def test_fori_loop_body_is_traced_once_for_repeated_calls():
    traced = []

    def body(i, carry):
        traced.append(i)
        return _body(i, carry)
    ours = _model(nnx)
    fori_loop(0, 2, body, (ours, X))
    first = len(traced)
    fori_loop(0, 2, body, (ours, X))
    assert len(traced) == first and int(ours.count[...]) == 4
