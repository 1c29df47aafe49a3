"""Every user-triggerable ``varjax.errors`` raise site names what it can: collection, variable
path, module, the user's ``file:line`` and a one-sentence fix (layout: ``varjax/ir/errors.py``).

Each case is a small trigger function; the test asserts the exception's attributes.  The
``module`` is ``Module._label()`` for errors raised while tracing (``Net/inner (Inner)``) and
the equation's name stack for errors raised by passes (``Net/inner``); None in plain
functions.  Shapes are tiny: almost every error is raised before anything compiles.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax
import jax.extend.core
import jax.numpy as jnp
import pytest

import varjax as vj
from varjax import errors, nn
from varjax.passes import REGISTRY, CheckMutability, Pass, PassContext, Pipeline
from varjax.passes.framework.verify import verify

X = jnp.ones((2,), jnp.float32)
KEY = jax.random.key(0)
HERE = "test_error_messages.py:"
ones = nn.initializers.ones


@dataclasses.dataclass
class Case:
    trigger: Callable[[], Any]
    error: type
    collection: str | None = None
    path: tuple | None = None
    module: str | None = None


def _check(exc: errors.VarjaxError, case: Case) -> None:
    assert type(exc) is case.error, exc
    assert (exc.collection, exc.path, exc.module) == (case.collection, case.path, case.module), exc
    assert exc.source is not None and HERE in exc.source, exc
    assert exc.fix and exc.fix[0].isalpha() and len(exc.fix.split()) >= 3, exc.fix
    # The message shows a line for each field given, and no line for a missing one.
    text = str(exc)
    for label, value in (("collection:", exc.collection), ("variable:", exc.path),
                         ("module:", exc.module), ("at:", exc.source), ("fix:", exc.fix)):
        assert (f"  {label}" in text) == (value is not None), (label, text)


def _run(case: Case) -> None:
    with pytest.raises(errors.VarjaxError) as info:
        case.trigger()
    _check(info.value, case)


# --- modules used by the triggers --------------------------------------------------------

class Counter(nn.Module):
    """Counts its calls in 'counters' (a write: immutable unless mutable=['counters'])."""

    @nn.compact
    def __call__(self, x):
        n = self.variable("counters", "n", jnp.zeros, (), jnp.float32)
        n.value = n.value + 1.0
        return x


class Net(nn.Module):
    """A root holding a submodule, so module scopes have two levels."""

    inner: nn.Module

    @nn.compact
    def __call__(self, x):
        return self.inner(x)


class Lambda(nn.Module):
    """Runs ``fn(self, x)`` as its compact method: a module around any trigger body."""

    fn: Callable

    @nn.compact
    def __call__(self, x):
        return self.fn(self, x)


def _in_net(fn: Callable) -> Net:
    return Net(Lambda(fn))


# --- variables: trace time (varjax.trace.variable_api) ---------------------------------------------------

def scope_outside_functionalize():
    vj.param("w", ones, (2,))


def scope_inside_init_fn():
    vj.functionalize(lambda x: vj.variable("s", "v", lambda: vj.make_rng())).init(KEY, X)


def scope_inside_init_fn_of_a_module():
    _in_net(lambda m, x: m.variable("s", "v", lambda: vj.make_rng())).init(KEY, X)


def scope_reserved_collection():
    vj.functionalize(lambda x: vj.variable("__mine", "v", jnp.zeros, ()).value).init(KEY, X)


def scope_effectful_jaxpr_run_eagerly():
    f = vj.functionalize(lambda x: x * vj.param("w", ones, (2,)))
    jaxpr = f.jaxpr(X, variables=f.init(KEY, X))
    jax.extend.core.jaxpr_as_fun(jaxpr)(X)


def missing_param_in_function():
    vj.functionalize(lambda x: x * vj.param("w", ones, (2,))).apply({}, X)


def missing_param_in_user_module():
    _in_net(lambda m, x: x * m.param("w", ones, (2,))).apply({}, X)


def missing_param_in_dense():
    nn.Dense(2).apply({}, X)


def missing_variable_without_init_fn():
    vj.functionalize(lambda x: vj.variable("stats", "mean").value).apply({}, X, mutable=True)


def variable_created_in_an_immutable_collection():
    vj.functionalize(lambda x: vj.variable("stats", "n", jnp.zeros, ()).value).apply({}, X)


def variable_without_init_fn_in_a_module():
    _in_net(lambda m, x: m.variable("stats", "mean").value).apply({}, X, mutable=True)


def immutable_put_variable_in_module():
    _in_net(lambda m, x: m.put_variable("stats", "x", x)).apply({}, X)


def missing_rng_stream_in_function():
    vj.functionalize(lambda x: vj.make_rng("dropout")).apply({}, X)


def missing_rng_stream_in_dropout():
    Net(nn.Dropout(0.5, deterministic=False)).apply({}, X)


def unknown_stream_of_rngs():
    vj.Rngs(params=0).dropout()


def reseed_unknown_stream():
    vj.reseed({"rngs": {"dropout": {"key": KEY, "count": jnp.uint32(0)}}}, noise=1)


def rngs_bad_seed():
    vj.Rngs(dropout=1.5)


def rngs_advanced_from_a_closure_under_jit():
    rngs = vj.Rngs(0)
    f = vj.functionalize(lambda x: jax.random.normal(vj.make_rng("noise"), x.shape))
    jax.jit(lambda x: f.apply({}, x, rngs=rngs))(X)


def missing_params_stream_in_function():
    vj.functionalize(lambda x: vj.param("w", ones, (2,))).apply({}, X, mutable=True)


def missing_params_stream_in_dense():
    Net(nn.Dense(2)).apply({}, X, mutable=True)


def wrong_shape_in_function():
    f = vj.functionalize(lambda x: x * vj.param("w", ones, (2,)))
    f.apply({"params": {"w": jnp.ones((3,))}}, X)


def wrong_shape_in_dense():
    Net(nn.Dense(2)).apply({"params": {"inner": {"kernel": jnp.ones((2, 3)),
                                                 "bias": jnp.ones((2,))}}}, X)


def wrong_shape_in_bound_module():
    bound = nn.Dense(2).bind({"params": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones((2,))}})
    bound.param("kernel", ones, (2, 2))


def _batch_norm(train: bool):
    return Net(nn.BatchNorm(use_running_average=not train))


def _batch_stats(mean, var=None):
    return {"params": {"inner": {"scale": jnp.ones(2), "bias": jnp.zeros(2)}},
            "batch_stats": {"inner": {"mean": mean, "var": jnp.ones(2) if var is None else var}}}


def wrong_shape_batch_stats_in_eval():
    _batch_norm(False).apply(_batch_stats(jnp.zeros(1), jnp.ones(1)), jnp.ones((3, 2)))


def wrong_shape_batch_stats_in_train():
    _batch_norm(True).apply(_batch_stats(jnp.zeros(1)), jnp.ones((3, 2)), mutable=["batch_stats"])


def wrong_shape_of_a_mutable_variable_never_written():
    _batch_norm(False).apply(_batch_stats(jnp.zeros(1)), jnp.ones((3, 2)), mutable=True)


def int_given_for_a_float_param():
    Net(nn.Dense(2)).apply({"params": {"inner": {"kernel": jnp.ones((2, 2), jnp.int32),
                                                 "bias": jnp.ones((2,))}}}, X)


def variables_given_as_a_list():
    Net(nn.Dense(2)).apply([{"inner": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}}], X)


def collection_given_as_an_array():
    Net(nn.Dense(2)).apply({"params": jnp.ones(2)}, X)


def variable_given_as_none():
    Net(nn.Dense(2)).apply({"params": {"inner": {"kernel": None, "bias": jnp.ones(2)}}}, X)


def variable_given_as_a_string():
    Net(nn.Dense(2)).apply({"params": {"inner": {"kernel": "w", "bias": jnp.ones(2)}}}, X)


def variable_given_as_a_string_under_jit():
    jax.jit(lambda: Net(nn.Dense(2)).apply(
        {"params": {"inner": {"kernel": jnp.ones((2, 2)), "bias": "b"}}}, X))()


def batched_write_under_vmap_in_function():
    @vj.functionalize
    def f(xs):
        s = vj.variable("state", "s", jnp.zeros, ())

        def per_row(x):
            s.value = x.sum()
            return x
        return jax.vmap(per_row)(xs)
    f.init(KEY, jnp.ones((2, 2)))


def batched_write_under_vmap_in_module():
    def body(m, xs):
        s = m.variable("state", "s", jnp.zeros, ())

        def per_row(x):
            s.value = x.sum()
            return x
        return jax.vmap(per_row)(xs)
    _in_net(body).init(KEY, jnp.ones((2, 2)))


TRACE_TIME = {
    "scope/outside functionalize": Case(scope_outside_functionalize, errors.ScopeError),
    "scope/variable api inside an init function": Case(scope_inside_init_fn, errors.ScopeError),
    "scope/init function of a module": Case(scope_inside_init_fn_of_a_module, errors.ScopeError,
                                            module="Net/inner (Lambda)"),
    "scope/reserved collection": Case(scope_reserved_collection, errors.ScopeError,
                                      "__mine", ("v",)),
    "scope/effectful jaxpr run eagerly": Case(scope_effectful_jaxpr_run_eagerly, errors.ScopeError,
                                              "params", ("w",)),
    "missing/param in a function": Case(missing_param_in_function, errors.MissingVariableError,
                                        "params", ("w",)),
    "missing/param in a user module": Case(missing_param_in_user_module, errors.MissingVariableError,
                                           "params", ("inner", "w"), "Net/inner (Lambda)"),
    "missing/param of nn.Dense applied directly": Case(
        missing_param_in_dense, errors.MissingVariableError, "params", ("kernel",), "Dense"),
    "missing/variable without init_fn": Case(missing_variable_without_init_fn,
                                             errors.MissingVariableError, "stats", ("mean",)),
    "missing/variable in an immutable collection": Case(
        variable_created_in_an_immutable_collection, errors.MissingVariableError, "stats", ("n",)),
    "missing/variable without init_fn in a module": Case(
        variable_without_init_fn_in_a_module, errors.MissingVariableError, "stats",
        ("inner", "mean"), "Net/inner (Lambda)"),
    "immutable/put_variable in a module": Case(immutable_put_variable_in_module,
                                               errors.ImmutableCollectionError, "stats",
                                               ("inner", "x"), "Net/inner (Lambda)"),
    "rng/stream in a function": Case(missing_rng_stream_in_function, errors.MissingRngError,
                                     "dropout"),
    "rng/stream in nn.Dropout": Case(missing_rng_stream_in_dropout, errors.MissingRngError,
                                     "dropout", ("inner",), "Net/inner (Dropout)"),
    "rng/Rngs without the stream or a default": Case(unknown_stream_of_rngs,
                                                     errors.UnknownStreamError, "dropout"),
    "rng/reseed of a stream not in the state": Case(reseed_unknown_stream,
                                                    errors.UnknownStreamError, "rngs", ("noise",)),
    "rng/Rngs seed neither int nor key": Case(rngs_bad_seed, errors.ConfigError, "dropout"),
    "rng/Rngs advanced by a closure under jax.jit": Case(rngs_advanced_from_a_closure_under_jit,
                                                         errors.TransformError, "default"),
    "rng/params stream in a function": Case(missing_params_stream_in_function,
                                            errors.MissingRngError, "params", ("w",)),
    "rng/params stream in nn.Dense": Case(missing_params_stream_in_dense, errors.MissingRngError,
                                          "params", ("inner", "kernel"), "Net/inner (Dense)"),
    "shape/in a function": Case(wrong_shape_in_function, errors.VariableShapeError,
                                "params", ("w",)),
    "shape/in nn.Dense": Case(wrong_shape_in_dense, errors.VariableShapeError,
                              "params", ("inner", "kernel"), "Net/inner (Dense)"),
    "shape/bound module read eagerly": Case(wrong_shape_in_bound_module, errors.VariableShapeError,
                                            "params", ("kernel",), "Dense"),
    "shape/batch_stats read in eval": Case(wrong_shape_batch_stats_in_eval,
                                           errors.VariableShapeError, "batch_stats",
                                           ("inner", "mean"), "Net/inner (BatchNorm)"),
    "shape/batch_stats updated in train": Case(wrong_shape_batch_stats_in_train,
                                               errors.VariableShapeError, "batch_stats",
                                               ("inner", "mean"), "Net/inner (BatchNorm)"),
    "shape/mutable variable never written": Case(wrong_shape_of_a_mutable_variable_never_written,
                                                 errors.VariableShapeError, "batch_stats",
                                                 ("inner", "mean"), "Net/inner (BatchNorm)"),
    "shape/int given for a float param": Case(int_given_for_a_float_param, errors.VariableShapeError,
                                              "params", ("inner", "kernel"), "Net/inner (Dense)"),
    "variables/given as a list": Case(variables_given_as_a_list, errors.InvalidVariablesError),
    "variables/collection given as an array": Case(collection_given_as_an_array,
                                                   errors.InvalidVariablesError, "params"),
    "variables/None leaf": Case(variable_given_as_none, errors.InvalidVariablesError, "params",
                                ("inner", "kernel")),
    "variables/string leaf": Case(variable_given_as_a_string, errors.InvalidVariablesError,
                                  "params", ("inner", "kernel")),
    "variables/string leaf under jit": Case(variable_given_as_a_string_under_jit,
                                            errors.InvalidVariablesError, "params", ("inner", "bias")),
    "transform/batched write in a function": Case(batched_write_under_vmap_in_function,
                                                  errors.TransformError, "state", ("s",)),
    "transform/batched write in a module": Case(batched_write_under_vmap_in_module,
                                                errors.TransformError, "state", ("inner", "s"),
                                                "Net/inner (Lambda)"),
}


@pytest.mark.parametrize("case", list(TRACE_TIME.values()), ids=list(TRACE_TIME))
def test_trace_time_errors(case):
    _run(case)


# --- variables: raised by passes after tracing ------------------------------------------------

def immutable_write_in_function():
    @vj.functionalize
    def f(x):
        n = vj.variable("counters", "n", jnp.zeros, ())
        n.value = n.value + 1.0
        return x
    f.apply(f.init(KEY, X), X)


def immutable_write_in_module():
    net = Net(Counter())
    net.apply(net.init(KEY, X), X)


def immutable_write_in_a_scan_body_of_a_module():
    def body(m, x):
        n = m.variable("counters", "n", jnp.zeros, ())

        def step(c, _):
            n.value = n.value + 1.0
            return c, None
        return jax.lax.scan(step, x, None, length=2)[0]
    net = _in_net(body)
    net.apply(net.init(KEY, X), X)


def creation_in_scan_in_function():
    @vj.functionalize
    def f(xs):
        def step(c, x):
            s = vj.variable("state", "s", jnp.zeros, ())
            s.value = s.value + x
            return c, None
        return jax.lax.scan(step, 0.0, xs)[0]
    f.init(KEY, X)


def creation_in_scan_in_module():
    def body(m, xs):
        def step(c, x):
            s = m.variable("state", "s", jnp.zeros, ())
            s.value = s.value + x
            return c, None
        return jax.lax.scan(step, 0.0, xs)[0]
    _in_net(body).init(KEY, X)


def creation_in_one_branch():
    @vj.functionalize
    def f(p, x):
        def yes(x):
            vj.variable("state", "s", jnp.zeros, ()).value = x.sum()
            return x
        return jax.lax.cond(p, yes, lambda x: x, x)
    f.init(KEY, jnp.bool_(True), X)


def structure_change_in_loop_in_function():
    @vj.functionalize
    def f(xs):
        vj.sow("intermediates", "h", xs[0])

        def step(c, x):
            vj.sow("intermediates", "h", x)   # appends: the tuple grows every step
            return c, None
        return jax.lax.scan(step, 0.0, xs)[0]
    f.apply({}, X, mutable=["intermediates"])


def structure_change_in_loop_in_module():
    def body(m, xs):
        m.sow("intermediates", "h", xs[0])

        def step(c, x):
            m.sow("intermediates", "h", x)
            return c, None
        return jax.lax.scan(step, 0.0, xs)[0]
    _in_net(body).apply({}, X, mutable=["intermediates"])


def branches_leave_different_structures():
    @vj.functionalize
    def f(p, x):
        s = vj.variable("state", "s", jnp.zeros, ())

        def yes(x):
            s.value = jnp.zeros((2,))
            return x
        return jax.lax.cond(p, yes, lambda x: x, x)
    f.init(KEY, jnp.bool_(True), X)


def branches_differ_in_a_cond_inside_a_scan_in_a_module():
    def body(m, xs):
        s = m.variable("state", "s", jnp.zeros, ())

        def step(c, x):
            def wider(x):
                s.value = jnp.zeros((2,))
                return x
            return jax.lax.cond(x > 0, wider, lambda x: x, x), None
        return jax.lax.scan(step, 0.0, xs)[0]
    _in_net(body).init(KEY, X)


def while_cond_writes():
    def body(m, x):
        s = m.variable("state", "s", jnp.zeros, ())

        def cond(i):
            s.value = s.value + 1.0
            return i < 3
        return jax.lax.while_loop(cond, lambda i: i + 1, 0)
    _in_net(body).init(KEY, X)


def rng_draw_in_while_cond():
    @vj.functionalize
    def f(x):
        def cond(i):
            return jax.random.uniform(vj.make_rng("noise")) < 0.5
        return jax.lax.while_loop(cond, lambda i: i + 1, 0)
    f.apply({}, X, rngs={"noise": KEY})


def custom_vmap_over_a_variable():
    from jax.custom_batching import custom_vmap

    def body(m, x):
        w = m.variable("state", "w", jnp.ones, ())

        @custom_vmap
        def g(x):
            return x * w.value

        @g.def_vmap
        def rule(axis_size, in_batched, x):
            return x, True
        return g(x)
    _in_net(body).init(KEY, X)


def shard_map_write_that_differs_per_shard():
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(m, x):
        s = m.variable("state", "s", jnp.zeros, ())

        def per_shard(x):
            s.value = jnp.sum(x)
            return x
        return jax.shard_map(per_shard, mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P("d"))(x)
    _in_net(body).init(KEY, X)


def gradient_wrt_variable_read_in_custom_jvp():
    @vj.functionalize
    def f(x):
        @jax.custom_jvp
        def g(x):
            return x * vj.param("w", ones, ())
        g.defjvp(lambda p, t: (g(p[0]), t[0]))
        return g(x)
    x = jnp.float32(2.0)
    v = f.init(KEY, x)
    jax.grad(lambda v: f.apply(v, x))(v)


def custom_rule_touching_other_variables():
    @vj.functionalize
    def f(x):
        @jax.custom_jvp
        def g(x):
            return jnp.sin(x)
        g.defjvp(lambda p, t: (g(p[0]), vj.variable("state", "v").value * t[0]))
        vj.variable("state", "v", jnp.ones, ())
        return g(x)
    x = jnp.float32(0.3)
    v = f.init(KEY, x)
    jax.grad(lambda x: f.apply(v, x))(x)


def lower_rng_without_the_stream():
    f = vj.functionalize(lambda x: jax.random.normal(vj.make_rng("noise"), x.shape))
    jaxpr = f.jaxpr(X, rngs={"noise": KEY})
    Pipeline(["lower-rng"]).run(jaxpr, PassContext(rng_streams={}))


def implicit_stream_in_immutable_rngs_in_function():
    f = vj.functionalize(lambda x: vj.make_rng("dropout"))
    f.apply(f.init(vj.Rngs(dropout=1), X), X)


def implicit_stream_in_immutable_rngs_in_dropout():
    net = Net(nn.Dropout(0.5, deterministic=False))
    net.apply(net.init(vj.Rngs(0), X), X)


def verify_effects_after_discharge():
    f = vj.functionalize(lambda x: x * vj.param("w", ones, (2,)))
    verify(f.jaxpr(X, variables=f.init(KEY, X)), discharged=True)


def verify_effects_after_discharge_in_module():
    net = _in_net(lambda m, x: x * m.param("w", ones, (2,)))
    verify(net.functionalize().jaxpr(X, variables=net.init(KEY, X)), discharged=True)


PASS_TIME = {
    "immutable/write in a function": Case(immutable_write_in_function,
                                          errors.ImmutableCollectionError, "counters", ("n",)),
    "immutable/write in a module": Case(immutable_write_in_module, errors.ImmutableCollectionError,
                                        "counters", ("inner", "n"), "Net/inner"),
    "immutable/write in a scan body of a module": Case(
        immutable_write_in_a_scan_body_of_a_module, errors.ImmutableCollectionError,
        "counters", ("inner", "n"), "Net/inner"),
    "creation/in a raw scan in a function": Case(creation_in_scan_in_function,
                                                 errors.VariableCreationError, "state", ("s",)),
    "creation/in a raw scan in a module": Case(creation_in_scan_in_module,
                                               errors.VariableCreationError, "state",
                                               ("inner", "s"), "Net/inner"),
    "creation/in one branch": Case(creation_in_one_branch, errors.VariableCreationError,
                                   "state", ("s",)),
    "structure/loop in a function": Case(structure_change_in_loop_in_function,
                                         errors.VariableStructureError, "intermediates", ("h",)),
    "structure/loop in a module": Case(structure_change_in_loop_in_module,
                                       errors.VariableStructureError, "intermediates",
                                       ("inner", "h"), "Net/inner"),
    "structure/branches differ": Case(branches_leave_different_structures,
                                      errors.VariableStructureError, "state", ("s",)),
    "structure/cond inside a scan in a module": Case(
        branches_differ_in_a_cond_inside_a_scan_in_a_module, errors.VariableStructureError,
        "state", ("inner", "s"), "Net/inner"),
    "unsupported/while cond writes": Case(while_cond_writes, errors.UnsupportedPrimitiveError,
                                          "state", ("inner", "s"), "Net/inner"),
    "unsupported/rng draw in while cond": Case(rng_draw_in_while_cond,
                                               errors.UnsupportedPrimitiveError, "noise"),
    "unsupported/custom_vmap": Case(custom_vmap_over_a_variable, errors.UnsupportedPrimitiveError,
                                    "state", ("inner", "w"), "Net/inner"),
    "transform/raw shard_map write differs per shard": Case(
        shard_map_write_that_differs_per_shard, errors.TransformError, "state", ("inner", "s"),
        "Net/inner"),
    "transform/gradient through custom_jvp": Case(gradient_wrt_variable_read_in_custom_jvp,
                                                  errors.TransformError, "params", ("w",)),
    "transform/custom rule touches variables": Case(custom_rule_touching_other_variables,
                                                    errors.TransformError, "state", ("v",)),
    "rng/lower-rng without the stream": Case(lower_rng_without_the_stream,
                                             errors.MissingRngError, "noise"),
    "rng/implicit stream, rngs immutable": Case(implicit_stream_in_immutable_rngs_in_function,
                                                errors.ImmutableCollectionError, "rngs",
                                                ("dropout", "count")),
    "rng/implicit default stream in nn.Dropout": Case(
        implicit_stream_in_immutable_rngs_in_dropout, errors.ImmutableCollectionError, "rngs",
        ("default", "count"), "Net/inner"),
    "verify/var_get after discharge": Case(verify_effects_after_discharge,
                                           errors.VerificationError, "params", ("w",)),
    "verify/var_get after discharge in a module": Case(
        verify_effects_after_discharge_in_module, errors.VerificationError,
        "params", ("inner", "w"), "Net/inner"),
}


@pytest.mark.parametrize("case", list(PASS_TIME.values()), ids=list(PASS_TIME))
def test_pass_time_errors(case):
    _run(case)


# --- pipelines --------------------------------------------------------------------------------

class Broken(CheckMutability):
    """A pass with a bug (keeps its parent's name, so it is not registered)."""

    def run(self, jaxpr, ctx):
        raise RuntimeError("boom")


@contextlib.contextmanager
def _restored_registry():
    saved = dict(REGISTRY)
    try:
        yield
    finally:
        REGISTRY.clear()
        REGISTRY.update(saved)


def pass_class_without_name():
    with _restored_registry():
        class Nameless(Pass):  # noqa: F841
            name = ""


def pass_name_taken():
    with _restored_registry():
        class Impostor(Pass):  # noqa: F841
            name = "lower-rng"


def _with_sized(text: str):
    with _restored_registry():
        @dataclasses.dataclass(frozen=True)
        class Sized(Pass):
            name = "tem-sized"
            size: int

            def __post_init__(self):
                if self.size < 0:
                    raise ValueError("size must be >= 0")
        Pipeline.parse(text)


def ordering_cycle():
    with _restored_registry():
        class First(Pass):
            name, before = "tem-first", ("tem-second",)

        class Second(Pass):
            name, before = "tem-second", ("tem-first",)
        Pipeline([First(), Second()])


def broken_pass():
    jaxpr = vj.functionalize(lambda x: x * 2.0).jaxpr(X)
    Pipeline([Broken()]).run(jaxpr, PassContext())


PIPELINE = {
    "unknown pass": Case(lambda: Pipeline.parse("no-such-pass"), errors.PipelineError),
    "unparsable spec": Case(lambda: Pipeline.parse("cast-params{dtype=bfloat16}x"),
                            errors.PipelineError),
    "unclosed brace": Case(lambda: Pipeline.parse("cast-params{dtype=bfloat16"),
                           errors.PipelineError),
    "nested braces": Case(lambda: Pipeline.parse("cast-params{{dtype=bfloat16}}"),
                          errors.PipelineError),
    "option not key=value": Case(lambda: Pipeline.parse("cast-params{bfloat16}"),
                                 errors.PipelineError),
    "option given twice": Case(lambda: Pipeline.parse("cast-params{dtype=bfloat16,dtype=float16}"),
                               errors.PipelineError),
    "unknown option": Case(lambda: Pipeline.parse("lower-rng{bogus=1}"), errors.PipelineError),
    "pass class without a name": Case(pass_class_without_name, errors.PipelineError),
    "pass name taken": Case(pass_name_taken, errors.PipelineError),
    "required option missing": Case(lambda: _with_sized("tem-sized"), errors.PipelineError),
    "option value of the wrong type": Case(lambda: _with_sized("tem-sized{size=big}"),
                                           errors.PipelineError),
    "option value rejected by the pass": Case(lambda: _with_sized("tem-sized{size=-1}"),
                                              errors.PipelineError),
    "ordering cycle": Case(ordering_cycle, errors.PipelineError),
    "bad entry": Case(lambda: Pipeline([42]), errors.PipelineError),
    "pass with a bug": Case(broken_pass, errors.PassError),
}


@pytest.mark.parametrize("case", list(PIPELINE.values()), ids=list(PIPELINE))
def test_pipeline_errors(case):
    _run(case)


# --- modules: lifecycle, layers -----------------------------------------------------------------

def unknown_method_name():
    nn.Dense(2).apply({}, X, method="nope")


def method_not_callable():
    nn.Dense(2).apply({}, X, method=3)


def two_submodules_with_one_name():
    _in_net(lambda m, x: nn.Dense(2, name="a")(x) + nn.Dense(2, name="a")(x)).init(KEY, X)


def param_named_like_a_submodule():
    _in_net(lambda m, x: nn.Dense(2, name="w")(x) * m.param("w", ones, (2,))).init(KEY, X)


class NotCompact(nn.Module):
    def __call__(self, x):
        return nn.Dense(2)(x)


def submodule_outside_compact():
    Net(NotCompact()).init(KEY, X)


def compact_method_on_unbound_module():
    nn.Dense(2)(X)


def param_of_unbound_module():
    nn.Dense(2).param("w", ones, (2,))


def path_of_unbound_module():
    return nn.Dense(2).path


def unbind_of_a_submodule():
    _in_net(lambda m, x: m.unbind()).init(KEY, X)


def bound_module_used_after_apply():
    kept = []

    def keep(m, x):
        kept.append(m)
        return m(x)
    net = Net(nn.Dense(2))
    nn.apply(keep, net)(net.init(KEY, X), X)
    kept[0](X)


def frozen_template():
    nn.Dense(2).features = 3


def frozen_inside_a_module():
    def body(m, x):
        m.fn = None
        return x
    _in_net(body).init(KEY, X)


def dropout_deterministic_twice():
    _in_net(lambda m, x: nn.Dropout(0.5, deterministic=True)(x, deterministic=True)).init(KEY, X)


class DropoutCall(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic=None):
        return nn.Dropout(0.5, name="drop")(x, deterministic=deterministic)


def dropout_deterministic_neither():
    DropoutCall().apply({}, X)


ATTN = dict(num_heads=1, qkv_features=2, decode=True)
SEQ = jnp.ones((1, 2, 2), jnp.float32)


def decode_without_cache():
    layer = nn.MultiHeadDotProductAttention(**ATTN)
    layer.apply({"params": layer.init(KEY, SEQ)["params"]}, SEQ[:, :1])


def decode_with_immutable_cache():
    layer = nn.MultiHeadDotProductAttention(**ATTN)
    layer.apply(layer.init(KEY, SEQ), SEQ[:, :1])


def decode_two_tokens():
    net = Net(nn.MultiHeadDotProductAttention(**ATTN))
    net.apply(net.init(KEY, SEQ), SEQ, mutable=["cache"])


MODULES = {
    "unknown method name": Case(unknown_method_name, errors.UnknownMethodError,
                                module="Dense (unbound)"),
    "method not callable": Case(method_not_callable, errors.ModuleError, module="Dense (unbound)"),
    "two submodules, one name": Case(two_submodules_with_one_name, errors.NameInUseError,
                                     path=("inner", "a"), module="Net/inner (Lambda)"),
    "param named like a submodule": Case(param_named_like_a_submodule, errors.NameInUseError,
                                         "params", ("inner", "w"), "Net/inner (Lambda)"),
    "submodule outside setup/compact": Case(submodule_outside_compact, errors.AssignSubModuleError,
                                            module="Net/inner (NotCompact)"),
    "compact method of an unbound module": Case(compact_method_on_unbound_module,
                                                errors.UnboundModuleError, module="Dense (unbound)"),
    "param of an unbound module": Case(param_of_unbound_module, errors.UnboundModuleError,
                                       module="Dense (unbound)"),
    "path of an unbound module": Case(path_of_unbound_module, errors.UnboundModuleError,
                                      module="Dense (unbound)"),
    "unbind of a submodule": Case(unbind_of_a_submodule, errors.UnboundModuleError,
                                  module="Net/inner (Lambda)"),
    "bound module used after apply": Case(bound_module_used_after_apply, errors.InvalidScopeError,
                                          module="Net"),
    "attribute set on a template": Case(frozen_template, errors.FrozenModuleError,
                                        module="Dense (unbound)"),
    "attribute set in a method": Case(frozen_inside_a_module, errors.FrozenModuleError,
                                      module="Net/inner (Lambda)"),
    "merge_param given twice": Case(dropout_deterministic_twice, errors.ConfigError,
                                    module="Net/inner/Dropout_0 (Dropout)"),
    "merge_param given neither": Case(dropout_deterministic_neither, errors.ConfigError,
                                      module="DropoutCall/drop (Dropout)"),
    "attention decode without cache": Case(decode_without_cache, errors.MissingVariableError,
                                           "cache", ("cached_key",), "MultiHeadDotProductAttention"),
    "attention decode, immutable cache": Case(decode_with_immutable_cache,
                                              errors.ImmutableCollectionError, "cache",
                                              ("cached_key",), "MultiHeadDotProductAttention"),
    "attention decode, two tokens": Case(decode_two_tokens, errors.VariableShapeError, "cache",
                                         ("inner", "cached_key"),
                                         "Net/inner (MultiHeadDotProductAttention)"),
}


@pytest.mark.parametrize("case", list(MODULES.values()), ids=list(MODULES))
def test_module_errors(case):
    _run(case)


def _alias_with_two_axes():
    c = vj.Variable(jnp.zeros(3), collection="counts")
    vj.vmap(lambda a, b: a.value, in_axes=(0, None))(c, c)


def _nnx_layers_in_a_plain_list():
    from varjax import nnx

    class Stack(nnx.Module):
        def __init__(self):
            self.layers = [nnx.Param(jnp.ones(1))]
    Stack()


def _nnx_method_not_callable():
    from varjax import nnx
    from varjax.nnx import bridge

    class Scaled(nnx.Module):
        scale = 2.0

        def __call__(self, x):
            return self.scale * x
    bridge.ToLinen(Scaled, skip_rng=True).init(KEY, X, nnx_method="scale")


OTHERS = {
    "ToLinen nnx_method not callable": Case(_nnx_method_not_callable, errors.NotCallableError,
                                            module="ToLinen"),
    "object passed at two vmap axes": Case(_alias_with_two_axes, errors.InconsistentAliasError,
                                           path=("a",)),
    "nnx data in a static attribute": Case(_nnx_layers_in_a_plain_list, errors.StaticDataError,
                                           path=("layers",)),
    "a Linen name varjax does not provide": Case(
        lambda: nn.partitioning.param_with_axes("w", nn.initializers.ones, (3,)),
        errors.NotProvidedError),
}


@pytest.mark.parametrize("case", list(OTHERS.values()), ids=list(OTHERS))
def test_other_errors(case):
    _run(case)


def test_every_error_class_has_a_case():
    raised = {c.error for table in (TRACE_TIME, PASS_TIME, PIPELINE, MODULES, OTHERS)
              for c in table.values()}
    defined = {getattr(errors, n) for n in errors.__all__
               if isinstance(getattr(errors, n), type) and getattr(errors, n) is not errors.VarjaxError}
    assert defined <= raised, defined - raised


def test_a_named_scope_in_a_plain_function_is_not_a_module():
    @vj.functionalize
    def f(x):
        with jax.named_scope("block"):
            n = vj.variable("counters", "n", jnp.zeros, ())
            n.value = n.value + 1.0
        return x

    with pytest.raises(errors.ImmutableCollectionError) as info:
        f.apply(f.init(KEY, X), X)
    assert info.value.module is None and HERE in info.value.source


def test_method_scopes_show_in_pass_time_errors():
    class Model(nn.Module):
        def setup(self):
            self.counter = Counter()

        def __call__(self, x):
            return self.counter(x)

        def encode(self, x):
            return self.counter(x)

    model = Model()
    with pytest.raises(errors.ImmutableCollectionError) as info:
        model.apply(model.init(KEY, X), X, method="encode")
    assert info.value.module == "Model.encode/counter" and info.value.path == ("counter", "n")
