"""``varjax.nnx.bridge`` against ``flax.nnx.bridge``: every example of Flax's guide "Use Flax
NNX and Linen together" (docs_nnx/guides/bridge_guide.md), written once and run with
``varjax.nn``/``varjax.nnx`` and with ``flax.linen``/``flax.nnx``, gives the same parameters
and RNG state bitwise, the same outputs, paths, collections and Variable types.  Each
example runs once per library (a cached fixture) and the tests read its results."""
from __future__ import annotations

import functools
import types
from typing import Any, Callable

import flax.linen as flinen
import jax
import jax.numpy as jnp
import pytest
from flax import nnx as fnnx

import varjax.nn as vlinen
from varjax import errors
from varjax import nnx as vnnx
from varjax.nnx import bridge as vbridge
from varjax.nnx.lora import LoRA

# LoRA is imported from its module until varjax.nnx exports it.
FLAX = types.SimpleNamespace(nn=flinen, nnx=fnnx, bridge=fnnx.bridge, LoRA=fnnx.LoRA)
VARJAX = types.SimpleNamespace(nn=vlinen, nnx=vnnx, bridge=vbridge, LoRA=LoRA)


def _raw(x: Any) -> Any:
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def assert_same(a: Any, b: Any) -> None:
    """Same tree structure (dicts compared as dicts) and bitwise-equal leaves."""
    plain = functools.partial(jax.tree.map, lambda x: x, is_leaf=lambda x: x is None)
    a, b = plain(_dicts(a)), plain(_dicts(b))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert jnp.array_equal(_raw(jnp.asarray(x)), _raw(jnp.asarray(y))), (x, y)


def _dicts(tree: Any) -> Any:
    if hasattr(tree, "items"):
        return {k: _dicts(v) for k, v in tree.items()}
    return tree


def pure(lib: Any, model: Any) -> dict:
    return lib.nnx.to_pure_dict(lib.nnx.state(model))


def both(example: Callable[[Any], Any]) -> Callable[[], tuple[Any, Any]]:
    """``example(lib)`` for varjax and for flax, run once."""
    return functools.cache(lambda: (example(VARJAX), example(FLAX)))


# -- Linen -> NNX --------------------------------------------------------------------------

def linen_dot(nn: Any) -> type:
    class LinenDot(nn.Module):
        out_dim: int
        w_init: Callable[..., Any] = nn.initializers.lecun_normal()

        @nn.compact
        def __call__(self, x):
            w = self.param("w", self.w_init, (x.shape[-1], self.out_dim))
            return x @ w
    return LinenDot


X = jax.random.normal(jax.random.key(42), (4, 6))


@both
def to_nnx_basics(lib):
    model = lib.bridge.ToNNX(linen_dot(lib.nn)(5), rngs=lib.nnx.Rngs(0))
    lib.bridge.lazy_init(model, X)
    y = model(X)
    made = pure(lib, model)
    model.w[...] = jax.random.normal(jax.random.key(1), (6, 5))
    return dict(y=y, state=made, swapped=model(X), w_type=type(model.w).__name__)


def test_to_nnx_lazy_init_makes_flax_params_and_rng_state():
    (ours, theirs) = to_nnx_basics()
    assert_same(ours["state"], theirs["state"])
    assert sorted(ours["state"]) == ["to_nnx__rngs", "w"]
    assert ours["w_type"] == theirs["w_type"] == "Param"


def test_to_nnx_call_is_linen_apply_over_its_variables():
    (ours, theirs) = to_nnx_basics()
    assert_same(ours["y"], theirs["y"])
    assert_same(ours["swapped"], theirs["swapped"])          # the swapped weight is used
    assert not jnp.allclose(ours["y"], ours["swapped"])


def nnx_outer(lib: Any) -> type:
    class NNXOuter(lib.nnx.Module):
        def __init__(self, out_dim: int, rngs):
            self.dot = lib.bridge.ToNNX(linen_dot(lib.nn)(out_dim), rngs=rngs)
            self.b = lib.nnx.Param(jax.random.uniform(rngs.params(), (1, out_dim)))

        def __call__(self, x):
            return self.dot(x) + self.b
    return NNXOuter


@both
def lazy_init_outer(lib):
    partial = nnx_outer(lib)(5, rngs=lib.nnx.Rngs(0))
    before = pure(lib, partial)
    full = lib.bridge.lazy_init(partial, X)
    return dict(before=before, after=pure(lib, full), same=full is partial, y=full(X),
                param=isinstance(full.dot.w, lib.nnx.Param))


def test_lazy_init_through_an_nnx_model_fills_its_to_nnx_submodules():
    (ours, theirs) = lazy_init_outer()
    assert "w" not in ours["before"]["dot"]                  # nothing made before lazy_init
    assert_same(ours["before"], theirs["before"])
    assert_same(ours["after"], theirs["after"])
    assert_same(ours["y"], theirs["y"])
    assert ours["same"] and ours["param"]


def test_lazy_init_of_a_bound_method():
    model = nnx_outer(VARJAX)(5, rngs=vnnx.Rngs(0))
    method = model.__call__
    assert vbridge.lazy_init(method, X) is method
    assert model.dot.w.get_value().shape == (6, 5)


def test_to_nnx_call_before_lazy_init_says_to_lazy_init():
    model = vbridge.ToNNX(vlinen.Dense(3), rngs=vnnx.Rngs(0))
    with pytest.raises(errors.MissingVariableError, match="lazy_init") as e:
        model(X)
    assert e.value.collection == "params" and "test_nnx_bridge.py" in e.value.source


def test_lazy_init_refuses_what_is_not_an_nnx_module():
    with pytest.raises(errors.ConfigError, match="NNX module") as e:
        vbridge.lazy_init(lambda x: x, X)
    assert "test_nnx_bridge.py" in e.value.source


@both
def to_nnx_dropout(lib):
    model = lib.bridge.ToNNX(lib.nn.Dropout(rate=0.5, deterministic=False),
                             rngs=lib.nnx.Rngs(dropout=0))
    lib.bridge.lazy_init(model, X)
    y1, y2 = model(X), model(X)
    lib.nnx.reseed(model, dropout=0)
    y3 = model(X)
    lib.nnx.reseed(model, dropout=0)
    y4 = model(X)
    given = model(X, rngs=lib.nnx.Rngs(dropout=5))          # a call's own rngs win
    return dict(y1=y1, y2=y2, y3=y3, y4=y4, given=given, after=model(X))


def test_to_nnx_draws_flax_dropout_masks_and_reseeds():
    (ours, theirs) = to_nnx_dropout()
    assert_same(ours, theirs)
    assert not jnp.allclose(ours["y1"], ours["y2"])
    assert jnp.array_equal(ours["y3"], ours["y4"])


def test_to_nnx_call_rngs_replace_its_own_streams_for_that_call():
    (ours, theirs) = to_nnx_dropout()
    assert not jnp.array_equal(ours["given"], ours["after"])
    assert_same([ours["given"], ours["after"]], [theirs["given"], theirs["after"]])


@both
def sharded_in_jit(lib):
    nn, nnx, bridge = lib.nn, lib.nnx, lib.bridge

    class LinenDotWithPartitioning(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), ("in", "out"))
            return x @ self.param("w", init, (x.shape[-1], 5))

    @nnx.jit
    def create(x):
        model = bridge.lazy_init(bridge.ToNNX(LinenDotWithPartitioning(), rngs=nnx.Rngs(0)), x)
        spec = nnx.get_partition_spec(nnx.state(model))["w"].get_value()
        model.w.set_value(jax.lax.with_sharding_constraint(model.w.get_value(), spec))
        return model

    with jax.set_mesh(MESH):
        model = create(X)
    return dict(state=pure(lib, model), sharding=model.w.get_value().sharding.spec,
                names=model.w.get_metadata("out_sharding"))


def test_to_nnx_lazy_init_inside_nnx_jit_returns_a_sharded_model():
    (ours, theirs) = sharded_in_jit()
    assert ours["names"] == theirs["names"] == ("in", "out")
    assert ours["sharding"] == theirs["sharding"]
    assert_same(ours["state"], theirs["state"])


def linen_multi(nn: Any) -> type:
    class LinenMultiCollections(nn.Module):
        out_dim: int

        def setup(self):
            self.w = self.param("w", nn.initializers.lecun_normal(), (4, self.out_dim))
            self.b = self.param("b", nn.zeros_init(), (self.out_dim,))
            self.count = self.variable("counter", "count", lambda: jnp.zeros((), jnp.int32))

        def __call__(self, x):
            if not self.is_initializing():
                self.count.value += 1
            y = x @ self.w + self.b[None]
            self.sow("intermediates", "dot_sum", jnp.sum(y))
            return y

        def doubled(self, x):
            return 2 * (x @ self.w)
    return LinenMultiCollections


X4 = jax.random.normal(jax.random.key(42), (2, 4))


@both
def to_nnx_collections(lib):
    model = lib.bridge.lazy_init(
        lib.bridge.ToNNX(linen_multi(lib.nn)(3), rngs=lib.nnx.Rngs(0)), X4)
    kinds = {k: type(getattr(model, k)) for k in ("w", "b", "count")}
    y = model(X4, mutable=True)
    count_type = type(model.count)
    static, params, counter, rest = lib.nnx.split(model, lib.nnx.Param, count_type, ...)
    merged = lib.nnx.merge(static, params, counter, rest)
    y2 = merged(X4, mutable=True)
    return dict(kinds=kinds, y=y, y2=y2, keys=[list(params), list(counter), list(rest)],
                state=pure(lib, merged), dot_sum=type(merged.dot_sum).__name__,
                doubled=merged.doubled(X4))


def test_to_nnx_maps_each_collection_to_its_variable_type():
    (ours, theirs) = to_nnx_collections()
    assert ours["kinds"]["w"] is ours["kinds"]["b"] is vnnx.Param
    counter = ours["kinds"]["count"]
    assert counter.__name__ == theirs["kinds"]["count"].__name__ == "counter"
    assert issubclass(counter, vnnx.Variable)
    assert vnnx.variablelib.variable_name_from_type(counter) == "counter"
    assert ours["dot_sum"] == theirs["dot_sum"] == "Intermediate"


def test_to_nnx_mutable_call_writes_back_and_sows_as_flax():
    (ours, theirs) = to_nnx_collections()
    assert_same(ours["state"], theirs["state"])        # count 2, two sown sums, params, keys
    assert_same(ours["y2"], theirs["y2"])
    assert ours["keys"] == theirs["keys"] == [["b", "w"], ["count"], ["dot_sum", "to_nnx__rngs"]]


def test_to_nnx_runs_other_linen_methods():
    (ours, theirs) = to_nnx_collections()
    assert_same(ours["doubled"], theirs["doubled"])


def test_to_nnx_refuses_one_name_in_two_collections():
    class Clash(vlinen.Module):
        @vlinen.compact
        def __call__(self, x):
            self.variable("stats", "w", jnp.zeros, ())
            return x @ self.param("w", vlinen.initializers.lecun_normal(), (4, 3))
    with pytest.raises(errors.ConfigError, match="two collections") as e:
        vbridge.lazy_init(vbridge.ToNNX(Clash(), rngs=vnnx.Rngs(0)), X4)
    assert e.value.path == ("w",)


@both
def to_nnx_passed_alongside(lib):
    class Uses(lib.nnx.Module):
        def __init__(self, rngs):
            self.dot = lib.bridge.ToNNX(linen_dot(lib.nn)(5), rngs=rngs)

        def __call__(self, x, other):
            return self.dot(x) + other(x)

    trained = lib.bridge.lazy_init(
        lib.bridge.ToNNX(linen_dot(lib.nn)(5), rngs=lib.nnx.Rngs(1)), X)
    trained.w[...] = jnp.ones((6, 5))
    model = lib.bridge.lazy_init(Uses(lib.nnx.Rngs(0)), X, trained)
    return dict(trained=pure(lib, trained), model=pure(lib, model), y=model(X, trained))


def test_lazy_init_initializes_only_the_to_nnx_modules_of_its_models_graph():
    (ours, theirs) = to_nnx_passed_alongside()
    assert jnp.array_equal(ours["trained"]["w"], jnp.ones((6, 5)))   # kept its weights
    assert_same(ours, theirs)


def test_to_nnx_rngs_and_module_are_flaxs_deprecated_names():
    for lib in (VARJAX, FLAX):
        model = lib.bridge.ToNNX(lib.nn.Dense(2), rngs=lib.nnx.Rngs(0))
        with pytest.warns(DeprecationWarning, match="`ToNNX.rngs` is deprecated.*to_nnx__rngs"):
            assert model.rngs is model.to_nnx__rngs
        with pytest.warns(DeprecationWarning, match="`ToNNX.module` is deprecated.*to_nnx__mod"):
            assert model.module is model.to_nnx__module


@both
def to_nnx_mutable_from_linen(lib):
    x = jnp.arange(8.0).reshape(2, 4)      # BatchNorm's output exact in both libraries

    class NNXInner(lib.nnx.Module):
        def __init__(self, rngs):
            self.bn = lib.bridge.ToNNX(lib.nn.BatchNorm(use_running_average=False), rngs=rngs)
            lib.bridge.lazy_init(self.bn, x)

        def __call__(self, x):
            return self.bn(x)                  # mutable=None: the enclosing Linen call's

    model = lib.bridge.ToLinen(NNXInner)
    variables = model.init(jax.random.key(0), x)
    y, changed = model.apply(variables, 2 * x, mutable=["batch_stats"])
    alone = lib.bridge.lazy_init(
        lib.bridge.ToNNX(lib.nn.Dense(2), rngs=lib.nnx.Rngs(0)), X4)
    return dict(variables=variables, y=y, changed=changed,
                none=alone(X4, mutable=None), default=alone(X4))


def test_to_nnx_mutable_none_is_the_enclosing_linen_calls_as_flax():
    (ours, theirs) = to_nnx_mutable_from_linen()
    assert sorted(ours["changed"]) == ["batch_stats"]
    assert not jnp.array_equal(ours["changed"]["batch_stats"]["bn"]["mean"],
                               ours["variables"]["batch_stats"]["bn"]["mean"])
    assert_same(ours["none"], ours["default"])        # outside Linen: False, one output
    assert_same(ours, theirs)


def test_to_nnx_takes_a_key_for_params():
    key = jax.random.key(3)
    ours = vbridge.ToNNX(vlinen.Dense(2), rngs=key).lazy_init(X4)
    theirs = fnnx.bridge.ToNNX(flinen.Dense(2), rngs=key).lazy_init(X4)
    assert_same(pure(VARJAX, ours), pure(FLAX, theirs))


@both
def to_nnx_batch_norm_jit(lib):
    x = jnp.arange(6.0).reshape(3, 2)
    model = lib.bridge.lazy_init(
        lib.bridge.ToNNX(lib.nn.BatchNorm(use_running_average=False), rngs=lib.nnx.Rngs(0)), x)
    stats = model.mean
    step = lib.nnx.jit(lambda m, x: m(x, mutable=["batch_stats"])[0])
    y = step(model, x)
    step(model, 2 * x)
    return dict(y=y, state=pure(lib, model), kept=model.mean is stats)


def test_to_nnx_batch_stats_update_inside_nnx_jit():
    (ours, theirs) = to_nnx_batch_norm_jit()
    assert ours["kept"]                                 # the Variable takes the new value
    assert_same(ours["y"], theirs["y"])
    assert_same(ours["state"], theirs["state"])


@both
def to_nnx_in_vmap(lib):
    class NNXVmapped(lib.nnx.Module):
        def __init__(self, out_dim: int, size: int, rngs):
            self.linen_dot = lib.bridge.ToNNX(lib.nn.Dense(out_dim, use_bias=False), rngs=rngs)
            self.size = size

        def __call__(self, x):
            @lib.nnx.split_rngs(splits=self.size)
            @lib.nnx.vmap(in_axes=(0, 0), axis_size=self.size)
            def vmap_fn(submodule, x):
                return submodule(x)
            return vmap_fn(self.linen_dot, x)

    x = jax.random.normal(jax.random.key(0), (4, 6))
    model = lib.bridge.lazy_init(NNXVmapped(5, 4, rngs=lib.nnx.Rngs(0)), x)
    return dict(state=pure(lib, model), y=model(x))


def test_to_nnx_under_nnx_vmap_initializes_stacked_params():
    (ours, theirs) = to_nnx_in_vmap()
    assert ours["state"]["linen_dot"]["kernel"].shape == (4, 6, 5)
    assert_same(ours, theirs)


# -- NNX -> Linen --------------------------------------------------------------------------

def nnx_dot(nnx: Any) -> type:
    class NNXDot(nnx.Module):
        def __init__(self, in_dim: int, out_dim: int, rngs):
            self.w = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (in_dim, out_dim)))

        def __call__(self, x):
            return x @ self.w

        def twice(self, x):
            return 2 * (x @ self.w)
    return NNXDot


@both
def to_linen_basics(lib):
    model = lib.bridge.to_linen(nnx_dot(lib.nnx), 6, out_dim=5)
    variables = model.init(jax.random.key(0), X)
    twice = model.apply(variables, X, nnx_method="twice")

    class LinenOuter(lib.nn.Module):
        out_dim: int

        @lib.nn.compact
        def __call__(self, x):
            dot = lib.bridge.to_linen(nnx_dot(lib.nnx), x.shape[-1], self.out_dim)
            b = self.param("b", lib.nn.initializers.lecun_normal(), (1, self.out_dim))
            return dot(x) + b

    y2, outer = LinenOuter(out_dim=5).init_with_output(jax.random.key(0), X)
    return dict(variables=variables, y=model.apply(variables, X), twice=twice, y2=y2,
                outer=outer, applied=LinenOuter(out_dim=5).apply(outer, X))


def test_to_linen_init_and_apply_match_flax():
    (ours, theirs) = to_linen_basics()
    assert list(ours["variables"]) == ["params"]
    assert_same(ours, theirs)


def test_to_linen_as_a_linen_submodule_is_named_like_flax():
    (ours, theirs) = to_linen_basics()
    assert sorted(ours["outer"]["params"]) == ["ToLinen_0", "b"]
    assert_same(ours["applied"], ours["y2"])


def test_to_linen_takes_flaxs_abstract_init_without_passing_it_on():
    variables = vbridge.to_linen(nnx_dot(vnnx), 6, 5, abstract_init=False).init(
        jax.random.key(0), X)
    assert_same(variables, to_linen_basics()[0]["variables"])


def nnx_dot_with_constant(nnx: Any) -> type:
    class NNXDotWithConstant(nnx_dot(nnx)):
        scale = 2.0
    return NNXDotWithConstant


@pytest.mark.parametrize("method,flax_error,ours", [
    ("nope", AttributeError, errors.UnknownMethodError),
    ("scale", TypeError, errors.NotCallableError),
    (3, TypeError, errors.NotCallableError)])
def test_to_linen_refuses_an_nnx_method_that_is_not_one_with_flaxs_exception_type(
        method, flax_error, ours):
    variables = to_linen_basics()[0]["variables"]
    with pytest.raises(flax_error):
        fnnx.bridge.to_linen(nnx_dot_with_constant(fnnx), 6, 5).apply(
            variables, X, nnx_method=method)
    with pytest.raises(ours, match=f"nnx_method {method!r}") as e:
        vbridge.to_linen(nnx_dot_with_constant(vnnx), 6, 5).apply(
            variables, X, nnx_method=method)
    assert isinstance(e.value, flax_error) and "test_nnx_bridge.py" in e.value.source


@both
def to_linen_attributes(lib):
    class LinenTwice(lib.nn.Module):
        @lib.nn.compact
        def __call__(self, x):
            dot = lib.bridge.to_linen(nnx_dot(lib.nnx), x.shape[-1], out_dim=5)
            return dot.twice(x), dot.out_dim

    (y, out_dim), variables = LinenTwice().init_with_output(jax.random.key(0), X)
    unbound = lib.bridge.to_linen(nnx_dot(lib.nnx), 6, out_dim=5)
    return dict(y=y, out_dim=out_dim, variables=variables,
                applied=LinenTwice().apply(variables, X)[0], unbound=unbound.out_dim,
                missing=hasattr(unbound, "nope"))


def test_to_linen_forwards_kwargs_and_nnx_methods_as_flax():
    (ours, theirs) = to_linen_attributes()
    assert ours["out_dim"] == ours["unbound"] == 5 and not ours["missing"]
    assert_same(ours, theirs)
    w = ours["variables"]["params"]["ToLinen_0"]["w"]
    assert_same(ours["y"], 2 * (X @ w))                     # NNXDot.twice ran


@both
def to_linen_skip_rng(lib):
    class NNXAddConstant(lib.nnx.Module):
        def __init__(self):
            self.constant = lib.nnx.Variable(jnp.array(1))

        def __call__(self, x):
            return x + self.constant

    model = lib.bridge.ToLinen(NNXAddConstant, skip_rng=True)
    y, variables = model.init_with_output(jax.random.key(0), X)
    return dict(y=y, variables=variables)


def test_to_linen_skip_rng_builds_without_rngs():
    (ours, theirs) = to_linen_skip_rng()
    assert list(ours["variables"]) == ["Variable"]
    assert_same(ours, theirs)


@both
def to_linen_dropout(lib):
    model = lib.bridge.to_linen(lib.nnx.Dropout, rate=0.5)
    variables = model.init({"dropout": jax.random.key(0)}, X)
    ys = [model.apply(variables, X, rngs={"dropout": jax.random.key(k)}) for k in (1, 2, 1)]
    return dict(variables=variables, ys=ys)


def test_to_linen_draws_flax_masks_from_each_apply_rngs():
    (ours, theirs) = to_linen_dropout()
    assert_same(ours, theirs)
    y1, y2, y3 = ours["ys"]
    assert not jnp.allclose(y1, y2) and jnp.array_equal(y1, y3)


@both
def to_linen_collections(lib):
    @lib.nnx.register_variable_name("counts", overwrite=True)
    class Count(lib.nnx.Variable):
        pass

    class NNXMultiCollections(lib.nnx.Module):
        def __init__(self, din, dout, rngs):
            self.w = lib.nnx.Param(lib.nnx.initializers.lecun_normal()(rngs.params(), (din, dout)))
            self.lora = lib.LoRA(din, 3, dout, rngs=rngs)
            self.count = Count(jnp.array(0))

        def __call__(self, x):
            self.count[...] += 1
            return (x @ self.w[...]) + self.lora(x)

    xkey, pkey, dkey = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(xkey, (2, 4))
    model = lib.bridge.to_linen(NNXMultiCollections, 4, 3)
    variables = model.init({"params": pkey, "dropout": dkey}, x)
    y, changed = model.apply(variables, x, mutable=["counts"])
    return dict(variables=variables, y=y, changed=changed)


def test_to_linen_puts_each_variable_type_in_its_registered_collection():
    (ours, theirs) = to_linen_collections()
    assert sorted(ours["variables"]) == sorted(theirs["variables"]) == ["LoRAParam", "counts",
                                                                          "params"]
    assert_same(ours, theirs)                   # counts 0 after init, 1 after a mutable apply


@both
def to_linen_in_linen_vmap(lib):
    class LinenVmapped(lib.nn.Module):
        dout: int

        @lib.nn.compact
        def __call__(self, x):
            inner = lib.nn.vmap(lib.bridge.ToLinen, variable_axes={"params": 0},
                                split_rngs={"params": True})(lib.nnx.Linear,
                                                             args=(x.shape[-1], self.dout))
            return inner(x)

    variables = LinenVmapped(5).init(jax.random.key(0), X)
    return dict(variables=variables, y=LinenVmapped(5).apply(variables, X))


def test_to_linen_under_linen_vmap_stacks_params():
    (ours, theirs) = to_linen_in_linen_vmap()
    assert ours["variables"]["params"]["VmapToLinen_0"]["kernel"].shape == (4, 6, 5)
    assert_same(ours, theirs)


def test_to_linen_warns_of_variables_the_module_does_not_have():
    model = vbridge.to_linen(nnx_dot(vnnx), 6, 5)
    variables = {"params": {**to_linen_basics()[0]["variables"]["params"], "extra": jnp.ones(2)}}
    with pytest.warns(UserWarning, match="(?s)unknown module paths.*extra"):
        model.apply(variables, X)


# -- partition metadata --------------------------------------------------------------------

MESH = jax.make_mesh((1, 1), ("in", "out"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@both
def partition_metadata(lib):
    nn, nnx, bridge = lib.nn, lib.nnx, lib.bridge

    class LinenDotWithPartitioning(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.lecun_normal(), ("in", "out"))
            return x @ self.param("w", init, (x.shape[-1], 5))

    class NNXDotWithPartitioning(nnx.Module):
        def __init__(self, in_dim, out_dim, rngs, init=nnx.with_partitioning):
            self.w = nnx.Param(init(nnx.initializers.lecun_normal(), ("in", "out"))(
                rngs.params(), (in_dim, out_dim)))

        def __call__(self, x):
            return x @ self.w

    with jax.set_mesh(MESH):
        to_nnx = bridge.lazy_init(bridge.ToNNX(LinenDotWithPartitioning(), rngs=nnx.Rngs(0)), X)
        to_linen = bridge.to_linen(NNXDotWithPartitioning, 6, 5)
        variables = to_linen.init(jax.random.key(0), X)
        linen_boxed = bridge.to_linen(NNXDotWithPartitioning, 6, 5,
                                      init=bridge.with_partitioning)
        boxed = linen_boxed.init(jax.random.key(0), X)
        back = bridge.lazy_init(bridge.ToNNX(linen_boxed, rngs=nnx.Rngs(0)), X)
        return dict(
            to_nnx=(type(to_nnx.w).__name__, to_nnx.w.get_metadata("out_sharding"),
                    nnx.get_partition_spec(nnx.state(to_nnx))["w"].get_value(), to_nnx(X)),
            meta=(type(variables["params"]["w"]).__name__, variables["params"]["w"].var_type,
                  variables["params"]["w"].metadata["out_sharding"]),
            specs=nn.get_partition_spec(variables), unboxed=nn.unbox(variables),
            applied=to_linen.apply(variables, X),
            boxed=(type(boxed["params"]["w"]).__name__, boxed["params"]["w"].names),
            back=(back.w.get_metadata("out_sharding"), back.w.get_metadata("linen_meta_type")))


def test_linen_partitioning_becomes_the_nnx_variables_out_sharding():
    (ours, theirs) = partition_metadata()
    name, sharding, spec, y = ours["to_nnx"]
    assert (name, sharding, spec) == ("Param", ("in", "out"), jax.sharding.PartitionSpec("in", "out"))
    assert theirs["to_nnx"][:3] == (name, sharding, spec)
    assert_same(y, theirs["to_nnx"][3])


def test_nnx_sharding_crosses_into_linen_as_an_nnxmeta_box():
    (ours, theirs) = partition_metadata()
    assert ours["meta"] == ("NNXMeta", vnnx.Param, ("in", "out"))
    assert theirs["meta"][0] == "NNXMeta" and theirs["meta"][2] == ("in", "out")
    assert ours["specs"]["params"]["w"] == jax.sharding.PartitionSpec("in", "out")
    assert_same(ours["unboxed"], theirs["unboxed"])
    assert_same(ours["applied"], theirs["applied"])


@both
def logical_partitioning(lib):
    rules = (("in", None), ("out", None))

    class LinenLogical(lib.nn.Module):
        @lib.nn.compact
        def __call__(self, x):
            init = lib.nn.with_logical_partitioning(lib.nn.initializers.lecun_normal(),
                                                    ("in", "out"), rules=rules)
            return x @ self.param("w", init, (x.shape[-1], 5))

    with jax.set_mesh(MESH):
        model = lib.bridge.lazy_init(lib.bridge.ToNNX(LinenLogical(), rngs=lib.nnx.Rngs(0)), X)
        meta = model.w.get_metadata()
        back = lib.bridge.variables.to_linen_var(model.w)
    return dict(metadata=(meta["out_sharding"], meta["sharding_rules"]),
                back=(type(back).__name__, back.names, back.rules), w=model.w.get_value())


def test_linen_logical_rules_are_the_nnx_variables_sharding_rules_and_back():
    (ours, theirs) = logical_partitioning()
    rules = (("in", None), ("out", None))
    assert ours["metadata"] == theirs["metadata"] == (("in", "out"), rules)
    assert ours["back"] == theirs["back"] == ("LogicallyPartitioned", ("in", "out"), rules)
    assert_same(ours["w"], theirs["w"])


def test_bridge_with_partitioning_gives_linen_a_partitioned_box_and_back():
    (ours, theirs) = partition_metadata()
    assert ours["boxed"] == theirs["boxed"] == ("Partitioned", ("in", "out"))
    assert ours["back"] == (("in", "out"), vlinen.Partitioned)


# -- Functional and the names not built ---------------------------------------------------

def test_functional_inits_and_applies_an_nnx_class():
    outs = []
    for lib in (VARJAX, FLAX):
        f = lib.bridge.functional(lib.nnx.Linear)(6, 2)
        state = f.init(rngs=lib.nnx.Rngs(0))
        outs.append((lib.nnx.to_pure_dict(state), f.apply(state)(X)[0]))
    assert_same(outs[0], outs[1])


def test_functional_apply_before_init_is_refused():
    with pytest.raises(errors.ConfigError, match="before init"):
        vbridge.functional(vnnx.Linear)(6, 2).apply({})


@pytest.mark.parametrize("fn", [vbridge.lazy_init, vbridge.ToNNX.__call__,
                                vbridge.ToLinen.__call__, vbridge.ToLinen])
def test_bridge_signatures_name_what_they_take_not_bare_any(fn):
    variadic = {"args", "kwargs"} if fn is not vbridge.ToLinen else set()
    hints = {k: v for k, v in fn.__annotations__.items() if k not in variadic}
    assert hints and not [k for k, v in hints.items() if "Any" in str(v)], hints


def test_bridge_names_are_flax_nnx_bridges():
    assert set(dir(vbridge)) == {n for n in dir(fnnx.bridge) if not n.startswith("_")}


@pytest.mark.parametrize("name", ["Module", "compact", "current_module", "nnx_in_bridge_mdl",
                                  "linen_in_bridge_mdl", "wrappers"])
def test_bridge_module_and_its_helpers_are_not_provided(name):
    with pytest.raises(errors.NotProvidedError, match=f"nnx.bridge.{name}"):
        getattr(vbridge, name)


def test_bridge_initializers_are_nnxs():
    assert vbridge.initializers is vnnx.initializers

