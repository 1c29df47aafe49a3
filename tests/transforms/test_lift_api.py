"""``vj.lift`` used directly: a user's own transform over a stateful body.

Checks the contract of ``varjax/lifting/region.py`` (and ``notes/lifting.md``): how variables and
streams are grouped, what ``region`` and ``region.traffic`` return, that the body's writes
are stored, the IR ``lift`` emits around the transform, and that nesting traces each body
once per level.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transform_checks import close as _close

import varjax as vj
import varjax.nn as nn
from varjax.lifting.region import BodyTraffic

X = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3)), jnp.float32)
INIT = jax.nn.initializers.normal(1.0)


def _eqns(closed):
    return closed.jaxpr.eqns


def _var_key(eqn):
    return (eqn.params["collection"], tuple(eqn.params["path"]))


def lift_double(fn):
    """A user's transform: the body sees every param doubled; what it writes is stored as is."""
    def transform(region, groups, rng_groups, *args):
        params, rest = groups
        doubled = {key: jax.tree.map(lambda v: 2.0 * v, value) for key, value in params.items()}
        out, (params_out, rest_out) = region((doubled, rest), rng_groups, *args)
        # Written variables are stored from groups_out; the doubled reads are not writes.
        return out, (params_out, rest_out)
    return vj.lift(transform, fn, variables=("params", True), name="double")


def dense(x):
    w = vj.param("w", INIT, (3, 2))
    return x @ w


def test_custom_lift_doubles_every_param_before_the_body_uses_it():
    @vj.functionalize
    def model(x):
        return lift_double(dense)(x)

    v = model.init(jax.random.key(0), X)
    w = v["params"]["w"]
    assert w.shape == (3, 2)
    _close(model.apply(v, X), X @ (2.0 * w))
    # Init stores what the body created, not the doubled view of it.
    out, created = model.init_with_output(jax.random.key(0), X)
    _close(created["params"]["w"], w)
    _close(out, X @ w)


def test_groups_are_split_by_filters_first_match_wins():
    seen = {}

    def spy(region, groups, rng_groups, *args):
        seen["groups"] = [sorted(g) for g in groups]
        seen["rngs"] = [sorted(g) for g in rng_groups]
        return region(groups, rng_groups, *args)

    def body(x):
        vj.variable("state", "n", jnp.zeros, ()).value += 1.0
        vj.variable("stats", "m", jnp.zeros, ())
        return x * vj.param("w", INIT, ())

    @vj.functionalize
    def model(x):
        # 'params' matches both the first and the last filter: the first wins. The second
        # filter (True) takes everything else, so the third group is empty.
        return vj.lift(spy, body, variables=(["params"], True, ["params", "state"]),
                       rngs=(["dropout"], True), name="spy")(x)

    v = model.init(jax.random.key(0), X)
    rngs = {"dropout": jax.random.key(1), "noise": jax.random.key(2)}
    model.apply(v, X, rngs=rngs, mutable=["state"])
    assert seen["groups"] == [[("params", ("w",))],
                              [("state", ("n",)), ("stats", ("m",))],
                              []]
    assert seen["rngs"] == [["dropout"], ["noise"]]


def test_region_traffic_reports_reads_writes_creates_and_streams():
    seen = []

    def inspect(region, groups, rng_groups, *args):
        seen.append(region.traffic(groups, rng_groups, *args))
        return region(groups, rng_groups, *args)

    def body(x):
        w = vj.param("w", INIT, ())
        count = vj.variable("state", "count", jnp.zeros, ())
        count.value += 1.0
        vj.variable("state", "fresh", jnp.ones, ()).value = jnp.sum(x)
        vj.variable("state", "unused", jnp.zeros, ())
        noise = jax.random.normal(vj.make_rng("noise"), x.shape)
        return x * w + noise

    @vj.functionalize
    def model(x):
        return vj.lift(inspect, body, name="inspect")(x)

    rngs = {"params": jax.random.key(0), "noise": jax.random.key(1)}
    v = model.init(rngs, X)
    init_t = seen[-1]
    assert isinstance(init_t, BodyTraffic)
    created = {("params", ("w",)), ("state", ("count",)), ("state", ("fresh",)),
               ("state", ("unused",))}
    assert init_t.creates == created and init_t.writes == created
    assert init_t.reads == frozenset()
    assert init_t.streams == {"params", "noise"}

    v = {"params": v["params"], "state": {"count": v["state"]["count"],
                                          "unused": v["state"]["unused"]}}
    model.apply(v, X, rngs={"noise": jax.random.key(1)}, mutable=["state"])
    t = seen[-1]
    assert t.reads == {("params", ("w",)), ("state", ("count",))}    # 'unused' is not read
    assert t.writes == {("state", ("count",)), ("state", ("fresh",))}
    assert t.creates == {("state", ("fresh",))}
    assert t.streams == {"noise"}


def test_body_writes_are_written_back_through_groups_out():
    def tenfold(region, groups, rng_groups, *args):
        out, (g,) = region(groups, rng_groups, *args)
        # The transform may change what is stored: here every written value times ten.
        return out, ({k: 10.0 * v if k[0] == "state" else v for k, v in g.items()},)

    def body(x):
        n = vj.variable("state", "n", jnp.zeros, ())
        n.value = n.value + 1.0
        return x + n.value

    @vj.functionalize
    def model(x, scale):
        if scale:
            return vj.lift(tenfold, body, name="tenfold")(x)
        return vj.lift(lambda region, *a: region(*a), body, name="plain")(x)

    v = model.init(jax.random.key(0), X, False)
    assert float(v["state"]["n"]) == 1.0
    out, upd = model.apply(v, X, False, mutable=["state"])
    assert float(upd["state"]["n"]) == 2.0
    _close(out, X + 2.0)
    out, upd = model.apply(v, X, True, mutable=["state"])
    assert float(upd["state"]["n"]) == 20.0
    _close(out, X + 2.0)        # the body saw its own value; only the stored one is scaled


def test_ir_reads_before_one_named_jit_equation_and_writes_after():
    def body(x):
        n = vj.variable("state", "n", jnp.zeros, ())
        n.value = n.value + 1.0
        return x @ vj.param("w", INIT, (3, 2)) + n.value

    @vj.functionalize
    def model(x):
        return vj.lift(lambda region, *a: region(*a), body, name="mine")(x)

    v = model.init(jax.random.key(0), X)
    v = {"params": {**v["params"], "unused": jnp.ones(())}, "state": v["state"]}
    eqns = _eqns(model.jaxpr(X, variables=v, mutable=["state"]))
    names = [e.primitive.name for e in eqns]
    jits = [i for i, e in enumerate(eqns) if e.primitive.name in ("jit", "pjit")]
    assert len(jits) == 1, names
    (j,) = jits
    assert eqns[j].params["name"].startswith("mine"), eqns[j].params["name"]
    gets = [i for i, e in enumerate(eqns) if e.primitive.name == "var_get"]
    sets = [i for i, e in enumerate(eqns) if e.primitive.name == "var_set"]
    assert {_var_key(eqns[i]) for i in gets} == {("params", ("w",)), ("state", ("n",))}
    assert [_var_key(eqns[i]) for i in sets] == [("state", ("n",))]
    assert all(i < j for i in gets) and all(i > j for i in sets)


def test_variables_the_body_does_not_use_are_not_read():
    @vj.functionalize
    def model(x):
        return lift_double(dense)(x)

    v = model.init(jax.random.key(0), X)
    v = {"params": {**v["params"], "other": jnp.ones((5,))}, "stats": {"m": jnp.ones(())}}
    eqns = _eqns(model.jaxpr(X, variables=v))
    reads = [_var_key(e) for e in eqns if e.primitive.name == "var_get"]
    assert reads == [("params", ("w",))]
    _close(model.apply(v, X), X @ (2.0 * v["params"]["w"]))


def test_nested_lifted_transforms_trace_each_body_once_per_level():
    runs = {"body": 0, "middle": 0, "outer": 0}

    def body(x):
        runs["body"] += 1
        return x * vj.param("w", INIT, ())

    def middle(x):
        runs["middle"] += 1
        return vj.vmap(body, variable_axes={"params": 0}, split_rngs={"params": True})(x)

    def outer(x):
        runs["outer"] += 1
        return vj.vmap(middle, variable_axes={"params": 0}, split_rngs={"params": True})(x)

    @vj.functionalize
    def model(x):
        return vj.vmap(outer, variable_axes={"params": 0}, split_rngs={"params": True})(x)

    x = jnp.ones((2, 2, 2))
    v = model.init(jax.random.key(0), x)
    assert v["params"]["w"].shape == (2, 2, 2)
    assert runs == {"body": 1, "middle": 1, "outer": 1}
    _close(model.apply(v, x), v["params"]["w"])
    assert runs == {"body": 2, "middle": 2, "outer": 2}      # not 2 ** depth
    model.apply(v, x)                                         # cached: no trace at all
    assert runs == {"body": 2, "middle": 2, "outer": 2}


def test_nested_lifts_in_a_direct_body_run_their_transform_inline(monkeypatch):
    """Inside a body that runs directly, a nested lift hands every variable and key in and
    runs its transform in the enclosing trace: only the outermost lift stages a jaxpr of
    its own, whatever the depth; unused inputs leave nothing in the result."""
    from varjax import _jax
    staged = []
    trace = _jax.trace_to_jaxpr
    monkeypatch.setattr(_jax, "trace_to_jaxpr",
                        lambda fun, avals, name="varjax": staged.append(name) or
                        trace(fun, avals, name=name))

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.variable("stats", "unused", jnp.zeros, ())
            return nn.Dense(2)(x)

    model = Block
    for _ in range(3):
        model = nn.vmap(model, variable_axes={"params": 0, "stats": 0},
                        split_rngs={"params": True})
    x = jnp.ones((2, 2, 2, 3))
    v = model().init(jax.random.key(0), x)
    assert staged.count("vmap") == 1
    staged.clear()
    out = model().apply(v, x)
    assert staged.count("vmap") == 1
    kernel, bias = v["params"]["Dense_0"]["kernel"], v["params"]["Dense_0"]["bias"]
    _close(out, jnp.einsum("abcd,abcde->abce", x, kernel) + bias)
    (eqn,) = jax.make_jaxpr(model().apply)(v, x).jaxpr.eqns   # one jit equation
    assert [a.aval.shape for a in eqn.invars] == [(2, 2, 2, 2), (2, 2, 2, 3, 2), (2, 2, 2, 3)]


def test_region_path_and_group_to_variables_round_trip_relative_to_the_module():
    seen = {}

    def spy(region, groups, rng_groups, *args):
        out, groups_out = region(groups, rng_groups, *args)
        group = groups_out[0]
        tree = vj.group_to_variables(group, region.path)
        back = vj.variables_to_group(tree, region.path)
        seen["path"] = region.path
        seen["round_trip"] = sorted(back) == sorted(group) and all(
            back[k] is group[k] for k in group)
        return (out, tree), groups_out      # the tree leaves the transform as an output

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            n = self.variable("state", "n", jnp.zeros, ())
            n.value += 1.0
            return nn.Dense(2)(x)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return vj.lift(spy, lambda mdl, x: mdl(x), name="spy")(Block(name="block"), x)

    (_, tree), v = Outer().init_with_output(jax.random.key(0), X)
    assert seen["path"] == ("block",) and seen["round_trip"]
    # Relative to the module: exactly the dicts init stored under its name.
    assert jax.tree.map(jnp.shape, tree) == {
        "params": {"Dense_0": {"kernel": (3, 2), "bias": (2,)}}, "state": {"n": ()}}
    jax.tree.map(np.testing.assert_array_equal, tree["params"], v["params"]["block"])
    jax.tree.map(np.testing.assert_array_equal, tree["state"], v["state"]["block"])
    # Concretely, and for variables outside the path (they keep their full path).
    group = {("params", ("block", "Dense_0", "kernel")): jnp.ones((3, 2)),
             ("state", ("block", "n")): jnp.zeros(())}
    tree = vj.group_to_variables(group, ("block",))
    assert jax.tree.map(jnp.shape, tree) == {"params": {"Dense_0": {"kernel": (3, 2)}},
                                             "state": {"n": ()}}
    back = vj.variables_to_group(tree, ("block",))
    assert sorted(back) == sorted(group) and all(back[k] is group[k] for k in group)
    assert vj.group_to_variables({("params", ("other", "w")): 1.0}, ("block",)) == {
        "params": {"other": {"w": 1.0}}}


@pytest.mark.parametrize("retired", ["to_tree", "from_tree"])
def test_to_tree_and_from_tree_are_retired_as_nnx_means_other_things_by_them(retired):
    with pytest.raises(AttributeError):
        getattr(vj, retired)


@pytest.mark.parametrize("transform", ["lift", "vmap", "jit"])
def test_body_may_close_over_an_array_of_the_enclosing_function(transform):
    @vj.functionalize
    def model(xs, y):
        def body(x):
            return x * jnp.sum(y) * vj.param("w", jax.nn.initializers.ones, ())   # y: closed over
        if transform == "lift":
            return vj.lift(lambda region, *a: region(*a), body, name="mine")(xs)
        if transform == "vmap":
            return vj.vmap(body, variable_axes={"params": None})(xs)
        return vj.jit(lambda: body(xs))()          # a body without arguments

    y = jnp.array([1.0, 2.0])
    v = model.init(jax.random.key(0), X, y)
    v = {"params": {"w": jnp.float32(2.0)}}
    _close(model.apply(v, X, y), X * 6.0)


def _vmapped_counter(use_raw_scan: bool):
    """A vmapped body that creates a per-member param and counts calls in 'state'; with
    ``use_raw_scan`` the count is updated inside a raw lax.scan (a variable used in an
    inner JAX trace), which the direct run cannot resolve."""
    runs = []

    def body(x):
        runs.append(1)
        w = vj.param("w", INIT, (x.shape[-1],))
        n = vj.variable("state", "n", lambda: jnp.zeros((), jnp.float32))
        if use_raw_scan:
            def step(c, _):
                n.value = n.value + 1.0
                return c, None
            jax.lax.scan(step, 0.0, None, length=2)
        else:
            n.value = n.value + 2.0
        return x * w

    @vj.functionalize
    def f(xs):
        return vj.vmap(body, variable_axes={"params": 0, "state": None},
                       split_rngs={"params": True})(xs)
    return f, runs


def test_direct_and_ir_paths_initialize_bitwise_identically():
    direct, direct_runs = _vmapped_counter(use_raw_scan=False)
    via_ir, ir_runs = _vmapped_counter(use_raw_scan=True)
    v_direct = direct.init(jax.random.key(3), X)
    v_ir = via_ir.init(jax.random.key(3), X)
    np.testing.assert_array_equal(np.asarray(v_direct["params"]["w"]), np.asarray(v_ir["params"]["w"]))
    assert float(v_direct["state"]["n"]) == float(v_ir["state"]["n"]) == 2.0
    # The direct body ran once; the one with a raw scan stopped and ran again through the IR.
    assert len(direct_runs) == 1 and len(ir_runs) == 2


def test_body_using_a_variable_in_a_raw_scan_falls_back_to_the_ir_and_still_writes():
    f, _ = _vmapped_counter(use_raw_scan=True)
    variables = f.init(jax.random.key(0), X)
    out, updated = f.apply(variables, X, mutable=["state"])
    _close(out, X * variables["params"]["w"])
    assert float(updated["state"]["n"]) == 4.0
