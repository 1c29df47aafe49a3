"""Every error a user can trigger in ``varjax/lifting/region.py`` and ``varjax/transforms/batching.py``.

Each test asserts the error class, its ``collection`` / ``path`` fields where it has them,
the user's source line (``test_lift_errors.py:<line>``, found by a ``# LINE:<tag>`` marker)
and the words of the fix.
"""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import varjax as vj
import varjax.nn as nn
from varjax.errors import ScopeError, TransformError

XS = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)), jnp.float32)
INIT = jax.nn.initializers.normal(1.0)


def _at(tag):
    """``test_lift_errors.py:<line>`` of the line marked ``# LINE:<tag>``."""
    lines = pathlib.Path(__file__).read_text().splitlines()
    (line,) = [i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# LINE:{tag}")]
    return f"test_lift_errors.py:{line}"


def _identity_transform(region, groups, rng_groups, *args):
    return region(groups, rng_groups, *args)


# --- a collection the transform was not told about -----------------------------------------


def test_vmap_body_touching_a_collection_missing_from_variable_axes():
    @vj.functionalize
    def f(xs):
        def body(x):
            count = vj.variable("counters", "n", jnp.zeros, ())  # LINE:touch-fn
            count.value = count.value + 1.0
            return x * vj.param("w", INIT, ())
        return vj.vmap(body, variable_axes={"params": 0}, split_rngs={"params": True})(xs)

    with pytest.raises(TransformError) as info:
        f.init(jax.random.key(0), XS)
    err = info.value
    assert (err.collection, err.path) == ("counters", ("n",))
    text = str(err)
    assert "'counters'" in text and "variable:   n" in text and "vj.vmap" in text
    assert _at("touch-fn") in text
    assert "variable_axes" in err.fix and "'counters'" in err.fix


def test_vmapped_module_touching_a_collection_missing_from_variable_axes():
    class Stats(nn.Module):
        @nn.compact
        def __call__(self, x):
            mean = self.variable("batch_stats", "mean", jnp.zeros, x.shape)  # LINE:touch-module
            return x - mean.value

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, xs):
            return nn.vmap(Stats, variable_axes={"params": 0})(name="members")(xs)

    with pytest.raises(TransformError) as info:
        Outer().init(jax.random.key(0), XS)
    err = info.value
    assert (err.collection, err.path) == ("batch_stats", ("members", "mean"))
    assert "members/mean" in str(err) and _at("touch-module") in str(err)
    assert err.module is not None and "members" in err.module
    assert "variable_axes" in str(err)


def test_shard_map_body_touching_a_collection_missing_from_variable_specs():
    mesh = jax.sharding.Mesh(jax.devices(), ("d",))

    @vj.functionalize
    def f(x):
        def body(x):
            return x * vj.param("w", INIT, ())  # LINE:touch-shard
        return vj.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                            variable_specs={"state": P()})(x)

    with pytest.raises(TransformError) as info:
        f.init(jax.random.key(0), jnp.ones((2, 3)))
    err = info.value
    assert (err.collection, err.path) == ("params", ("w",))
    assert "vj.shard_map" in str(err) and _at("touch-shard") in str(err)
    assert "variable_specs" in err.fix


def test_custom_lift_touching_a_collection_no_filter_matches():
    @vj.functionalize
    def f(x):
        def body(x):
            vj.sow("intermediates", "h", x)  # LINE:touch-lift
            return x
        return vj.lift(_identity_transform, body, variables=("params",), name="mine")(x)

    with pytest.raises(TransformError) as info:
        f.init(jax.random.key(0), XS)
    err = info.value
    assert (err.collection, err.path) == ("intermediates", ("h",))
    assert "vj.mine" in str(err) and _at("touch-lift") in str(err)
    assert err.fix == "add 'intermediates' to one of the variable filters of vj.mine"


# --- an RNG stream the transform was not told about ------------------------------------------


@pytest.mark.parametrize("lifted", ["lift", "jit"])
def test_body_drawing_an_rng_stream_excluded_by_the_rngs_filter(lifted):
    def body(x):
        return x + jax.random.normal(vj.make_rng("dropout"), x.shape)  # LINE:draw

    @vj.functionalize
    def f(x):
        if lifted == "lift":
            return vj.lift(_identity_transform, body, rngs=(["params"],), name="mine")(x)
        return vj.jit(body, rngs=["params"])(x)

    with pytest.raises(TransformError) as info:
        f.apply({}, XS, rngs={"dropout": jax.random.key(0), "params": jax.random.key(1)})
    err = info.value
    assert err.collection == "dropout"
    name = "mine" if lifted == "lift" else "jit"
    assert f"RNG stream 'dropout' is used inside vj.{name}" in str(err)
    assert _at("draw") in str(err)
    assert "rngs filter" in err.fix and "'dropout'" in err.fix


# --- a transform that breaks the contract --------------------------------------------------


def _counter_body(x):
    n = vj.variable("state", "n", jnp.zeros, ())
    n.value = n.value + 1.0
    return x


@pytest.mark.parametrize("how", ["dropped", "no groups"])
def test_custom_lift_dropping_a_written_variable_from_groups_out(how):
    def drops(region, groups, rng_groups, *args):
        out, (g,) = region(groups, rng_groups, *args)
        if how == "dropped":
            return out, ({k: v for k, v in g.items() if k != ("state", ("n",))},)
        return out, ()

    @vj.functionalize
    def f(x):
        return vj.lift(drops, _counter_body, name="lossy")(x)  # LINE:dropped

    with pytest.raises(TransformError) as info:
        f.init(jax.random.key(0), XS)
    err = info.value
    assert (err.collection, err.path) == ("state", ("n",))
    assert "vj.lossy dropped variable n" in str(err) and _at("dropped") in str(err)
    assert "groups_out" in err.fix


@pytest.mark.parametrize("bad", ["variables", "rngs"])
def test_region_called_with_the_wrong_number_of_groups(bad):
    def wrong(region, groups, rng_groups, *args):
        if bad == "variables":
            return region(groups + ({},), rng_groups, *args)
        return region(groups, (), *args)

    @vj.functionalize
    def f(x):
        return vj.lift(wrong, _counter_body, variables=("params", True), name="wrong")(x)

    with pytest.raises(TransformError) as info:
        f.init(jax.random.key(0), XS)
    text = str(info.value)
    want = "3 variable groups and 1 RNG groups" if bad == "variables" else \
        "2 variable groups and 0 RNG groups"
    assert f"the region of vj.wrong was called with {want}; it has 2 and 1" in text
    assert "in the same order" in info.value.fix


def test_lift_without_a_body_is_a_type_error():
    with pytest.raises(TypeError, match="at least one body"):
        vj.lift(_identity_transform)


def test_lifted_function_called_outside_a_functionalized_function():
    lifted = vj.lift(_identity_transform, _counter_body, name="mine")
    with pytest.raises(ScopeError, match="vj.mine was called outside a functionalized"):
        lifted(XS)
    # Outside any trace a transform is in object mode, which has no variable_axes.
    with pytest.raises(vj.errors.TransformError, match="vj.vmap was called in object mode "
                       r"\(outside any functionalized function"):
        vj.vmap(_counter_body, variable_axes={"state": 0})(XS)


# --- vmap / shard_map / pmap options ---------------------------------------------------------


def test_vmap_split_rngs_without_any_way_to_know_the_axis_size():
    @vj.functionalize
    def f():
        return vj.vmap(lambda: vj.param("w", INIT, ()), variable_axes={"params": 0},  # LINE:no-size
                       split_rngs={"params": True})()

    with pytest.raises(TransformError) as info:
        f.init(jax.random.key(0))
    err = info.value
    assert "vj.vmap: split_rngs needs the mapped axis size" in str(err)
    assert _at("no-size") in str(err)
    assert err.fix == "pass axis_size="


@pytest.mark.parametrize("option", ["variable_axes", "in_axes", "out_axes"])
def test_pmap_axis_other_than_0_or_none_is_rejected(option):
    kwargs = {"variable_axes": {"params": 0}, option: {"params": 1} if option == "variable_axes"
              else 1}
    with pytest.raises(TransformError) as info:
        vj.pmap(_counter_body, **kwargs)  # LINE:pmap
    err = info.value
    what = {"variable_axes": "variable axis", "in_axes": "in_axes", "out_axes": "out_axes"}[option]
    assert f"vj.pmap: {what} 1 is not supported." in str(err)
    assert _at("pmap") in str(err)
    assert err.fix == "use 0 or None"


def test_vmap_variable_axes_must_be_a_mapping():
    with pytest.raises(TypeError, match="variable_axes must be a dict"):
        vj.vmap(_counter_body, variable_axes=["params"])


def test_vmap_per_member_write_to_a_shared_variable():
    @vj.functionalize
    def f(xs):
        def body(x):
            total = vj.variable("state", "total", jnp.zeros, ())
            total.value = total.value + jnp.sum(x)
            return x
        return vj.vmap(body, variable_axes={"state": None})(xs)  # LINE:shared-write

    with pytest.raises(TransformError) as info:
        f.init(jax.random.key(0), XS)
    err = info.value
    assert (err.collection, err.path) == ("state", ("total",))
    assert "variable_axes entry is None" in str(err) and _at("shared-write") in str(err)
    assert "{'state': 0}" in err.fix


def test_vmap_shared_variable_may_be_written_with_a_member_independent_value():
    @vj.functionalize
    def f(xs):
        def body(x):
            calls = vj.variable("state", "calls", jnp.zeros, ())
            calls.value = calls.value + 1.0
            return x
        return vj.vmap(body, variable_axes={"state": None})(xs)

    v = f.init(jax.random.key(0), XS)
    assert float(v["state"]["calls"]) == 1.0
    _, upd = f.apply(v, XS, mutable=["state"])
    assert float(upd["state"]["calls"]) == 2.0


class _ClosesOverOuterCounter(nn.Module):
    @nn.compact
    def __call__(self, xs):
        total = self.variable("state", "total", jnp.zeros, ())     # no member axis

        def body(x):
            total.value = total.value + jnp.sum(x)  # LINE:aside-write
            return x
        return nn.vmap(body, variable_axes={"state": 0})(xs)


class _ClosesOverOuterDense(nn.Module):
    @nn.compact
    def __call__(self, xs):
        dense = nn.Dense(2)
        h = dense(xs)                                  # params (4, 2): no member axis of 3
        return h + nn.vmap(lambda x: dense(x), variable_axes={"params": 0})(xs)  # LINE:aside-read


def test_vmap_body_writing_a_closed_over_variable_without_the_member_axis():
    with pytest.raises(TransformError) as info:
        _ClosesOverOuterCounter().init(jax.random.key(0), XS)
    err = info.value
    assert (err.collection, err.path) == ("state", ("total",))
    assert "used inside vj.vmap, which did not hand it to the body" in str(err)
    assert _at("aside-write") in str(err)
    assert "'state'" in err.fix and "None" in err.fix


@pytest.mark.parametrize("phase", ["init", "apply"])
def test_vmap_body_reading_closed_over_params_without_the_member_axis(phase):
    model = _ClosesOverOuterDense()
    if phase == "init":
        call = lambda: model.init(jax.random.key(0), XS)  # noqa: E731
    else:
        v = {"params": {"Dense_0": {"kernel": jnp.ones((4, 2)), "bias": jnp.ones((2,))}}}
        call = lambda: model.apply(v, XS)  # noqa: E731
    with pytest.raises(TransformError) as info:
        call()
    err = info.value
    assert err.collection == "params" and err.path[0] == "Dense_0"
    assert "used inside vj.vmap, which did not hand it to the body" in str(err)
    assert _at("aside-read") in str(err)


def test_shard_map_array_keyword_argument_is_rejected():
    mesh = jax.sharding.Mesh(jax.devices(), ("d",))

    @vj.functionalize
    def f(x):
        return vj.shard_map(lambda x, *, scale: x * scale, mesh=mesh, in_specs=P("d"),  # LINE:kwarg
                            out_specs=P("d"))(x, scale=jnp.ones(()))

    with pytest.raises(TransformError) as info:
        f.apply({}, jnp.ones((2, 3)))
    assert "vj.shard_map: an array keyword argument has no in_specs entry." in str(info.value)
    assert _at("kwarg") in str(info.value)
    assert "positionally" in info.value.fix


def test_pmap_body_touching_a_variable_without_one_entry_per_device():
    @vj.functionalize
    def f(x):
        vj.param("w", INIT, (5,))                    # created outside: no device axis

        def body(x):
            return x * jnp.sum(vj.param("w", INIT, (5,)))  # LINE:aside-pmap
        return vj.pmap(body, variable_axes={"params": 0})(x)

    with pytest.raises(TransformError) as info:
        f.init(jax.random.key(0), jnp.ones((2, 3)))
    err = info.value
    assert (err.collection, err.path) == ("params", ("w",))
    assert "used inside vj.pmap, which did not hand it to the body" in str(err)
    assert _at("aside-pmap") in str(err)
