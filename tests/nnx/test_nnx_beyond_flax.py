"""Where varjax.nnx goes beyond flax.nnx 0.12.8 (issue 35, "Where varjax goes beyond NNX"):
things flax.nnx's own hijax/Ref Variables fail at, each checked against the pure-JAX
computation written by hand, against flax.nnx's default Variables where they give an answer,
and with flax.nnx's hijax/Ref failure asserted.

* Variables as scan carries: a module carried by ``nnx.scan``/``vj.scan`` and written each
  step gives the unrolled loop's values (hijax and Ref Variables cannot be carried).
* A Variable closed over by ``nnx.vmap`` (not passed) and written inside: refused with a
  ``TransformError`` naming its collection and the line (``varjax/trace/raw_writes.py``),
  the Variable left as it was, where it used to keep a leaked tracer; passing the module with
  ``in_axes=None`` writes the update back once.  JAX's own Refs and flax.nnx's default
  Variables refuse it too; flax.nnx's hijax Variables write an update that does not depend
  on the batch (once) and fail on one that does: not matched yet (a closed-over Variable
  would have to become an input of the object-mode trace).
* ``nnx.grad`` through a module whose Variables are updated (BatchNorm statistics and a
  counter): ``jax.grad`` of the pure function, the updates written back once (hijax: no jvp
  of a Variable read; Ref: a Ref cotangent).
* ``nnx.remat`` with a state write under ``nnx.grad``: the write happens once (a Ref under
  ``jax.checkpoint`` under ``jax.grad`` runs it twice; hijax refuses the effect).
* ``nnx.eval_shape`` keeps a Variable's sharding metadata (flax#5110); on an Explicit mesh
  (``jax.make_mesh``'s default) its abstract value carries the ``NamedSharding`` and a
  sharded init under ``nnx.jit`` places the params, as flax.nnx's.
* Batch-statistic writes inside ``nnx.custom_vjp`` under ``nnx.grad`` (flax#4847): here
  against pure JAX and flax.nnx's hijax/Ref failures; against flax.nnx's default Variables,
  in both custom_vjp forms, ``tests/nnx/test_nnx_differentiation.py::
  test_batchnorm_statistics_updated_inside_custom_vjp_under_grad_match_flax``.
"""
import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

import varjax as vj
from varjax import nnx

XS = jnp.arange(12.0).reshape(3, 2, 2) / 7      # 3 steps of a (2, 2) batch
X = XS[1]
EPS, MOMENTUM = 1e-5, 0.99
W, XW = jnp.array([0.5, -1.5]), jnp.array([1.0, 2.0])


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


# --- Variables as scan carries -------------------------------------------------------------

def _cell(lib):
    """A recurrent cell whose state is Variables: ``h`` and a step counter, both written
    every call."""
    class Cell(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
            self.h = lib.Variable(jnp.zeros((2, 2)))
            self.steps = lib.Variable(jnp.array(0))

        def __call__(self, x):
            self.h[...] = jnp.tanh(self.lin(x) + self.h[...])
            self.steps[...] += 1
            return self.h[...] * 2
    return Cell(lib.Rngs(0))


def _cell_by_hand(kernel, bias, xs):
    """The cell's loop in pure JAX: ``(h, steps), ys``."""
    def body(carry, x):
        h, steps = carry
        h = jnp.tanh(x @ kernel + bias[None] + h)
        return (h, steps + 1), h * 2
    return jax.lax.scan(body, (jnp.zeros((2, 2)), jnp.array(0)), xs)


def _step(cell, x):
    return cell, cell(x)


@pytest.mark.parametrize("scan", ["nnx.scan", "vj.scan"])
def test_a_module_carried_by_scan_has_its_variables_written_each_step_as_an_unrolled_loop(scan):
    cell = _cell(nnx)
    kernel, bias = cell.lin.kernel[...], cell.lin.bias[...]
    out, ys = (nnx.scan(_step) if scan == "nnx.scan" else vj.scan(_step))(cell, XS)
    (h, steps), want = _cell_by_hand(kernel, bias, XS)
    assert out is cell if scan == "nnx.scan" else type(out) is type(cell)  # vj: JAX's copy
    _close(ys, want)
    _close(cell.h[...], h)
    assert int(cell.steps[...]) == int(steps) == 3
    unrolled = _cell(nnx)
    _close(jnp.stack([unrolled(x) for x in XS]), ys)
    _close(unrolled.h[...], cell.h[...])


def test_flax_carries_default_variables_through_nnx_scan_as_varjax_but_not_hijax_or_refs():
    theirs = _cell(flax_nnx)
    (h, _), want = _cell_by_hand(theirs.lin.kernel[...], theirs.lin.bias[...], XS)
    _close(flax_nnx.scan(_step)(theirs, XS)[1], want)        # the values varjax gives
    _close(theirs.h[...], h)
    with flax_nnx.var_defaults(hijax=True):
        with pytest.raises(AttributeError, match="treedef"):
            flax_nnx.scan(_step)(_cell(flax_nnx), XS)
    with flax_nnx.var_defaults(ref=True):
        with pytest.raises(TypeError, match="same pytree structure"):
            flax_nnx.scan(_step)(_cell(flax_nnx), XS)


# --- a Variable closed over by vmap and written inside -----------------------------------

def _tally(lib):
    class Tally(lib.Module):
        def __init__(self):
            self.n = lib.BatchStat(jnp.array(1.0))
    return Tally()


def _bump(m, x):
    m.n[...] = m.n[...] + 1
    return x * m.n[...]


def test_a_variable_closed_over_by_nnx_vmap_and_written_is_refused_and_left_as_it_was():
    ours = _tally(nnx)
    with pytest.raises(vj.errors.TransformError, match="'batch_stats' was written inside a JAX "
                       "transformation that holds it as a constant") as info:
        nnx.vmap(lambda x: _bump(ours, x))(XW)
    assert "test_nnx_beyond_flax.py" in str(info.value)      # the line that wrote it
    assert float(ours.n[...]) == 1.0
    np.testing.assert_array_equal(nnx.vmap(_bump, in_axes=(None, 0))(ours, XW), XW * 2)
    assert float(ours.n[...]) == 2.0                          # passed: written back once


def test_a_closed_over_write_under_vmap_is_refused_by_jax_refs_and_flax_default_variables():
    ref = jax.new_ref(jnp.array(1.0))

    def bump(x):
        ref[...] = ref[...] + 1
        return x
    with pytest.raises(Exception, match="unbatched array reference"):
        jax.vmap(bump)(XW)
    theirs = _tally(flax_nnx)
    with pytest.raises(flax.errors.TraceContextError):
        flax_nnx.vmap(lambda x: _bump(theirs, x))(XW)
    with flax_nnx.var_defaults(hijax=True):      # hijax: once if unbatched, else it fails
        theirs = _tally(flax_nnx)
        np.testing.assert_array_equal(flax_nnx.vmap(lambda x: _bump(theirs, x))(XW), XW * 2)
        assert float(theirs.n[...]) == 2.0

        def add(x):
            theirs.n[...] = theirs.n[...] + x
            return x
        with pytest.raises(NotImplementedError, match="Batching rule"):
            flax_nnx.vmap(add)(XW)


# --- grad through a module whose Variables are updated ------------------------------------

def _normed(lib):
    """BatchNorm in training mode (its statistics updated on every call), then Linear, and
    a counter."""
    class Normed(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
            self.bn = lib.BatchNorm(2, momentum=MOMENTUM, epsilon=EPS, rngs=rngs)
            self.calls = lib.BatchStat(jnp.array(0))

        def __call__(self, x):
            self.calls[...] += 1
            return self.lin(self.bn(x))
    return Normed(lib.Rngs(0))


def _loss(m, x):
    return jnp.mean(jnp.sin(m(x)) ** 2)


def _normed_by_hand(params, stats, x):
    """``_loss`` of the model as a pure function: ``(loss, new statistics)``."""
    mean = jnp.mean(x, axis=0)
    var = jnp.mean(x * x, axis=0) - mean * mean
    y = (x - mean[None]) * jax.lax.rsqrt(var + EPS)[None] * params["scale"][None] \
        + params["offset"][None]
    y = y @ params["kernel"] + params["bias"][None]
    new = {"mean": MOMENTUM * stats["mean"] + (1 - MOMENTUM) * mean,
           "var": MOMENTUM * stats["var"] + (1 - MOMENTUM) * var}
    return jnp.mean(jnp.sin(y) ** 2), new


def _params_and_stats(m):
    return ({"kernel": m.lin.kernel[...], "bias": m.lin.bias[...], "scale": m.bn.scale[...],
             "offset": m.bn.bias[...]}, {"mean": m.bn.mean[...], "var": m.bn.var[...]})


@pytest.mark.parametrize("jitted", [False, True])
def test_grad_through_batchnorm_and_a_counter_is_jax_grad_of_the_pure_function(jitted):
    ours = _normed(nnx)
    params, stats = _params_and_stats(ours)
    g = (nnx.jit(nnx.grad(_loss)) if jitted else nnx.grad(_loss))(ours, X)
    want, new = jax.grad(_normed_by_hand, has_aux=True)(params, stats, X)
    _close(g["lin"]["kernel"][...], want["kernel"])
    _close(g["lin"]["bias"][...], want["bias"])
    _close(g["bn"]["scale"][...], want["scale"])
    _close(g["bn"]["bias"][...], want["offset"])
    _close(ours.bn.mean[...], new["mean"])
    _close(ours.bn.var[...], new["var"])
    assert int(ours.calls[...]) == 1                         # written back once


def test_flax_gives_the_same_grad_with_default_variables_but_not_with_hijax_or_refs():
    theirs = _normed(flax_nnx)
    params, stats = _params_and_stats(theirs)
    fg = flax_nnx.grad(_loss)(theirs, X)
    want, new = jax.grad(_normed_by_hand, has_aux=True)(params, stats, X)
    _close(fg["lin"]["kernel"][...], want["kernel"])         # the values varjax gives
    _close(fg["bn"]["scale"][...], want["scale"])
    _close(theirs.bn.var[...], new["var"])
    assert int(theirs.calls[...]) == 1
    with flax_nnx.var_defaults(hijax=True):
        with pytest.raises(NotImplementedError, match="jvp not implemented"):
            jax.grad(_loss)(_normed(flax_nnx), X)
    with flax_nnx.var_defaults(ref=True):
        with pytest.raises(ValueError, match="cotangent type Ref"):
            flax_nnx.grad(_loss)(_normed(flax_nnx), X)


# --- remat with a state write under grad --------------------------------------------------

def _counted(lib):
    class Counted(lib.Module):
        def __init__(self):
            self.w = lib.Param(jnp.array([0.5, -1.5]))
            self.calls = lib.BatchStat(jnp.array(0))
            self.last = lib.BatchStat(jnp.zeros(2))

        def __call__(self, x):
            self.calls[...] += 1
            y = jnp.sin(self.w[...] * x)
            self.last[...] = y
            return jnp.sum(y ** 2)
    return Counted()



def _remat_loss(m, x):
    return nnx.remat(lambda m, x: m(x))(m, x)


@pytest.mark.parametrize("jitted", [False, True])
def test_remat_writes_state_once_under_grad_with_jax_grad_of_checkpoint_values(jitted):
    m = _counted(nnx)
    g = (nnx.jit(nnx.grad(_remat_loss)) if jitted else nnx.grad(_remat_loss))(m, XW)
    want = jax.grad(jax.checkpoint(lambda w, x: jnp.sum(jnp.sin(w * x) ** 2)))(W, XW)
    _close(g["w"][...], want)
    assert int(m.calls[...]) == 1
    _close(m.last[...], jnp.sin(W * XW))


def test_a_jax_ref_under_checkpoint_under_grad_writes_twice_where_nnx_remat_writes_once():
    with flax_nnx.var_defaults(ref=True):
        theirs = _counted(flax_nnx)
        jax.grad(jax.checkpoint(lambda w: theirs(XW) + 0 * jnp.sum(w)))(W)
        assert int(theirs.calls[...]) == 2                    # the write ran twice
        with pytest.raises(ValueError, match="cotangent type Ref"):
            flax_nnx.grad(lambda m: flax_nnx.remat(lambda m: m(XW))(m))(_counted(flax_nnx))
    with flax_nnx.var_defaults(hijax=True):
        with pytest.raises(NotImplementedError):
            flax_nnx.grad(lambda m: flax_nnx.remat(lambda m: m(XW))(m))(_counted(flax_nnx))
    ours = _counted(nnx)
    nnx.grad(lambda m: nnx.remat(lambda m: m(XW))(m))(ours)
    assert int(ours.calls[...]) == 1


# --- eval_shape keeps sharding metadata (flax#5110) ---------------------------------------

def _sharded(lib):
    def make():
        return lib.Linear(2, 4, rngs=lib.Rngs(0), kernel_init=lib.with_partitioning(
            lib.initializers.lecun_normal(), (None, "model")),
            bias_init=lib.with_partitioning(lib.initializers.zeros_init(), ("model",)))
    return make


def test_eval_shape_keeps_out_sharding_metadata_as_flax():
    ours = nnx.eval_shape(_sharded(nnx))
    with flax_nnx.use_eager_sharding(False):       # no mesh: flax would place it eagerly
        theirs = flax_nnx.eval_shape(_sharded(flax_nnx))
    for name in ("kernel", "bias"):
        v, fv = getattr(ours, name), getattr(theirs, name)
        assert isinstance(v[...], jax.ShapeDtypeStruct) and v.shape == fv.shape
        assert v.out_sharding == fv.out_sharding
        assert v.get_metadata()["out_sharding"] == fv.get_metadata()["out_sharding"]
    assert ours.kernel.out_sharding == (None, "model") and ours.bias.out_sharding == ("model",)
    spec = nnx.get_partition_spec(nnx.state(ours))
    assert spec["kernel"][...] == jax.sharding.PartitionSpec(None, "model")


EXPLICIT = jax.make_mesh((1,), ("model",))          # jax.make_mesh's default: Explicit axes


def _spec(x):
    return x.sharding.spec if x.sharding is not None else None


def test_eval_shape_under_an_explicit_mesh_gives_the_abstract_kernel_its_sharding_as_flax():
    with jax.set_mesh(EXPLICIT):
        ours = nnx.eval_shape(_sharded(nnx))
        theirs = flax_nnx.eval_shape(_sharded(flax_nnx))
    for name in ("kernel", "bias"):
        v, fv = getattr(ours, name)[...], getattr(theirs, name).get_value()
        assert isinstance(v, jax.ShapeDtypeStruct) and v.shape == fv.shape
        assert _spec(v) == _spec(fv)
    assert _spec(ours.kernel[...]) == jax.sharding.PartitionSpec(None, "model")
    assert ours.kernel.out_sharding == (None, "model")


def test_a_sharded_init_under_nnx_jit_on_an_explicit_mesh_places_the_params_as_flax():
    with jax.set_mesh(EXPLICIT):
        ours = nnx.jit(_sharded(nnx))()
        theirs = _sharded(flax_nnx)()                        # flax places it when made
    for name in ("kernel", "bias"):
        v, fv = getattr(ours, name)[...], getattr(theirs, name)[...]
        assert v.sharding.spec == fv.sharding.spec
        np.testing.assert_array_equal(v, fv)
    assert ours.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "model")


# --- batch-statistic writes inside custom_vjp under grad (flax#4847) ----------------------

def _normalized(lib):
    """``sum(bn(x) * w)`` under ``custom_vjp`` (tree-mode form), bwd giving ``w`` its
    cotangent: the BatchNorm's statistics are written inside, under ``grad``."""
    class Net(lib.Module):
        def __init__(self, rngs):
            self.bn = lib.BatchNorm(2, momentum=MOMENTUM, epsilon=EPS, rngs=rngs)
            self.w = lib.Param(jnp.array([1.0, -2.0]))

    @lib.custom_vjp(graph_updates=False)
    def f(net, x):
        return jnp.sum(net.bn(x) * net.w[...][None])

    def f_fwd(net, x):
        y = net.bn(x)
        return jnp.sum(y * net.w[...][None]), (y, net)

    def f_bwd(res, g):
        y, net = res
        net_g = jax.tree.map(jnp.zeros_like, net)
        net_g.w[...] = jnp.sum(y, axis=0) * g
        return net_g, jnp.zeros_like(y)
    f.defvjp(f_fwd, f_bwd)
    return f, Net(lib.Rngs(0))


def test_batch_stat_writes_inside_custom_vjp_under_grad_where_flax_hijax_and_refs_fail():
    f, ours = _normalized(nnx)
    g = nnx.grad(f, graph_updates=False)(ours, XS[2])
    x = XS[2]
    mean, var = jnp.mean(x, axis=0), jnp.var(x, axis=0)
    y = (x - mean[None]) * jax.lax.rsqrt(var + EPS)[None]
    _close(g.w[...], jnp.sum(y, axis=0))                      # bwd's rule
    _close(ours.bn.mean[...], (1 - MOMENTUM) * mean)         # written back once
    _close(ours.bn.var[...], MOMENTUM + (1 - MOMENTUM) * var)
    with flax_nnx.var_defaults(hijax=True):
        f, theirs = _normalized(flax_nnx)
        with pytest.raises(NotImplementedError, match="jvp not implemented"):
            flax_nnx.grad(f, graph_updates=False)(theirs, XS[2])
    with flax_nnx.var_defaults(ref=True):
        f, theirs = _normalized(flax_nnx)
        with pytest.raises(TypeError, match="bwd rule must produce"):
            flax_nnx.grad(f, graph_updates=False)(theirs, XS[2])
