"""Linen's Module methods and module-level functions in varjax.nn.module (issue 18, item 2),
checked against flax.linen: copy, lazy_init, module_paths, share_scope, intercept_methods,
compact_name_scope, the named-call switches and merge_param."""
import re
import types

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax.nn as vnn
import varjax.nn.module as vm
from tests.nn.parity import assert_close, layout, perturb
from varjax import _jax, errors
from varjax.nn import dtypes

X = jnp.linspace(-1.0, 1.0, 10, dtype=jnp.float32).reshape(2, 5)
KEY = jax.random.key(0)
LIBS = [(fnn, fnn), (vnn, vm)]


def test_every_public_linen_module_attribute_exists():
    linen = {n for n in dir(fnn.Module) if not n.startswith("_")}
    assert sorted(linen - set(dir(vnn.Module))) == []


def test_merge_param_is_the_dtypes_one():
    assert vm.merge_param is dtypes.merge_param
    assert vm.merge_param("x", None, 3) == 3


def test_capture_call_intermediates_is_linens_default_filter():
    model = logged(vnn)
    variables = model.init(KEY, X)
    by_filter = model.apply(variables, X, capture_intermediates=vm.capture_call_intermediates,
                            mutable=["intermediates"])
    assert_close(by_filter, model.apply(variables, X, capture_intermediates=True,
                                        mutable=["intermediates"]), 0)
    assert set(by_filter[1]["intermediates"]) == {"__call__", "sub", "out"}
    assert fnn.module.capture_call_intermediates(None, "__call__")


def test_module_all_lists_what_it_exports():
    assert sorted(vm.__all__) == sorted(n for n in vars(vm) if not n.startswith("_")
                                        and not isinstance(getattr(vm, n), types.ModuleType))
    for name in vm.__all__:
        assert getattr(vm, name) is not None


def lora(nn, mod, form):
    class LoRA(nn.Module):
        base: nn.Module
        rank: int = 2

        def setup(self):
            mod.share_scope(self, self.base)

        @nn.compact
        def __call__(self, x):
            a = self.param("A", nn.initializers.lecun_normal(), (x.shape[-1], self.rank))
            b = self.param("B", nn.initializers.lecun_normal(), (self.rank, self.base.features))
            return self.base(x) + x @ a @ b

    class Owner(nn.Module):            # the wrapped module is the wrapper's own child
        def setup(self):
            self.child = nn.Dense(3)
            mod.share_scope(self, self.child)

        @nn.compact
        def __call__(self, x):
            return self.child(x) * self.param("s", nn.initializers.ones, (1, 3))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            if form == "wrapper":
                return LoRA(nn.Dense(3))(x)
            return Owner()(x)
    return Model()


@pytest.mark.parametrize("form", ["wrapper", "owner"])
def test_share_scope_puts_both_modules_variables_in_one_place(form):
    flax_model, vj_model = lora(fnn, fnn, form), lora(vnn, vm, form)
    flax_vars = flax_model.init(KEY, X)
    assert layout(vj_model.init(KEY, X)) == layout(flax_vars)
    variables = perturb(jax.tree.map(jnp.asarray, dict(flax_vars)))
    assert_close(vj_model.apply(variables, X), flax_model.apply(variables, X), 1e-5)


def test_share_scope_needs_bound_modules():
    with pytest.raises(errors.UnboundModuleError, match="share_scope"):
        vm.share_scope(vnn.Dense(2), vnn.Dense(3))


def name_scoped(nn, mod):
    class Foo(nn.Module):
        @mod.compact_name_scope
        def up(self, x):
            return nn.Dense(3)(x)

        @mod.compact_name_scope
        def down(self, x):
            return nn.Dense(3)(x) * 2.0

        def __call__(self, x):
            return self.up(x) + self.down(x)
    return Foo()


def test_compact_name_scope_methods_get_their_own_scope():
    flax_model, vj_model = name_scoped(fnn, fnn), name_scoped(vnn, vm)
    flax_vars = flax_model.init(KEY, X)
    assert layout(vj_model.init(KEY, X)) == layout(flax_vars)
    assert set(flax_vars["params"]) == {"up", "down"}
    variables = perturb(jax.tree.map(jnp.asarray, dict(flax_vars)))
    for run in (lambda m: m.apply(variables, X), lambda m: m.apply(variables, X, method="down"),
                lambda m: m.bind(variables).up(X)):
        assert_close(run(vj_model), run(flax_model), 1e-5)


def test_compact_name_scope_errors():
    with pytest.raises(errors.UnboundModuleError, match="compact_name_scope method up"):
        name_scoped(vnn, vm).up(X)

    class Early(vnn.Module):
        def setup(self):
            self.early(X)

        @vm.compact_name_scope
        def early(self, x):
            return x

        def __call__(self, x):
            return x
    with pytest.raises(errors.ModuleError, match="from setup"):
        Early().init(KEY, X)


def logged(nn):
    class Sub(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x)

    class Model(nn.Module):
        def setup(self):
            self.sub = Sub()
            self.out = nn.Dense(2)

        def __call__(self, x):
            return self.out(self.sub(x))
    return Model()


def test_intercept_methods_sees_the_calls_linen_sees():
    logs = []
    for nn, mod in LIBS:
        log = []

        def record(next_fun, args, kwargs, context):
            log.append((type(context.module).__name__, context.module.path, context.method_name))
            return next_fun(*args, **kwargs)
        with mod.intercept_methods(record):
            logged(nn).init(KEY, X)
        logs.append(log)
    assert logs[0] == logs[1]
    assert logs[1][:2] == [("Model", (), "setup"), ("Model", (), "__call__")]


def test_interceptors_nest_and_can_change_results():
    model = logged(vnn)
    variables = model.init(KEY, X)
    plain = model.apply(variables, X)        # cached first, without interceptors

    def double_dense(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        return out * 2.0 if type(context.module).__name__ == "Dense" else out

    def add_one_to_root(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        return out + 1.0 if context.module.path == () and context.method_name == "__call__" else out
    with vm.intercept_methods(double_dense):
        with vm.intercept_methods(add_one_to_root):
            out = model.apply(variables, X)
        doubled = model.bind(variables)(X)
    sub = variables["params"]["sub"]["Dense_0"]
    head = variables["params"]["out"]
    h = 2.0 * (X @ sub["kernel"] + sub["bias"][None])
    np.testing.assert_allclose(out, 2.0 * (h @ head["kernel"] + head["bias"][None]) + 1.0, rtol=1e-5)
    np.testing.assert_allclose(doubled, out - 1.0, rtol=1e-5)
    np.testing.assert_allclose(model.apply(variables, X), plain)    # no interceptor any more


def test_named_call_switches():
    model = logged(vnn)
    variables = model.init(KEY, X)

    def scopes():
        jaxpr = model.functionalize().jaxpr(X, variables=variables)
        return {name for eqn in jaxpr.jaxpr.eqns
                for name in _jax.scope_names(eqn.source_info.name_stack)}
    assert {"Model", "sub", "out"} <= scopes()
    with vm.override_named_call(False):
        assert scopes() == set()
    vm.disable_named_call()
    try:
        assert scopes() == set()
    finally:
        vm.enable_named_call()
    assert {"Model", "sub", "out"} <= scopes()
    with fnn.override_named_call(False):      # Linen has the same three functions
        pass


def copies(nn):
    class Copier(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = nn.Dense(3)
            wider = dense.copy(features=4)            # a new auto-named child
            named = dense.copy(name="named")
            return dense(x), wider(x), named(x)
    return Copier()


def test_copy():
    flax_vars = copies(fnn).init(KEY, X)
    assert layout(copies(vnn).init(KEY, X)) == layout(flax_vars)
    assert set(flax_vars["params"]) == {"Dense_0", "Dense_1", "named"}
    shared = vnn.Dense(2)
    holder = vnn.Sequential([shared, shared])
    copied = holder.copy()
    assert copied.layers[0] is copied.layers[1] and copied.layers[0] is not shared
    assert copied.parent is None and copied.layers[0].parent is None
    assert copied == holder


def test_lazy_init_equals_init_without_running_the_forward_pass():
    for nn in (fnn, vnn):
        class Model(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))
        sds = jax.ShapeDtypeStruct(X.shape, X.dtype)
        lazy = Model().lazy_init(KEY, sds)
        assert layout(lazy) == layout(Model().init(KEY, X))
        if nn is vnn:
            assert_close(lazy, Model().init(KEY, X), 0)


def test_lazy_init_of_a_variable_that_needs_the_input_raises():
    class Cache(vnn.Module):
        @vnn.compact
        def __call__(self, x):
            return self.variable("cache", "x", lambda: x).value
    with pytest.raises(errors.VariableCreationError, match="ShapeDtypeStruct") as info:
        Cache().lazy_init(KEY, jax.ShapeDtypeStruct(X.shape, X.dtype))
    assert info.value.collection == "cache" and info.value.path == ("x",)
    np.testing.assert_array_equal(Cache().lazy_init(KEY, X)["cache"]["x"], X)


def tabulated(nn):
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, scale=1.0):
            return nn.Dense(4)(x) * scale, {"h": x}

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = True):
            y, _ = Block()(x, scale=2.0)
            y, _ = Block(name="again")(y)
            return nn.Dense(2)(y)
    return Model()


def linen_text(table: str) -> list[str]:
    """Linen's table without rich's colour codes and trailing spaces."""
    return [line.rstrip() for line in re.sub(r"\x1b\[[0-9;]*m", "", table).split("\n")]


@pytest.mark.parametrize("depth", [None, 1])
def test_tabulate_draws_linens_table(depth):
    wide = {"console_kwargs": {"width": 400}}     # so rich cuts no cell
    expected = linen_text(fnn.tabulate(tabulated(fnn), KEY, depth=depth, **wide)(X, train=False))
    got = vm.tabulate(tabulated(vnn), KEY, depth=depth)(X, train=False)
    assert got.split("\n") == expected
    assert tabulated(vnn).tabulate(KEY, X, depth=depth, train=False) == got
    assert "Total Parameters: 54 (216 B)" in got


def test_tabulate_columns_per_collection_and_repeated_calls():
    class Norm(vnn.Module):
        @vnn.compact
        def __call__(self, x):
            norm = vnn.BatchNorm(use_running_average=False)
            return norm(norm(x))
    lines = Norm().tabulate(KEY, X, show_repeated=True).split("\n")
    assert lines[3].split("┃")[1:-1] == [" path        ", " module    ", " inputs       ",
                                         " outputs      ", " params            ",
                                         " batch_stats      "]
    assert sum("BatchNorm_0" in line for line in lines) == 2        # shown twice
    assert Norm().tabulate(KEY, X).count("BatchNorm_0") == 1


def test_tabulate_keeps_no_trace_on_the_module():
    model = tabulated(vnn)
    model.tabulate(KEY, X)
    model.tabulate(KEY, X)
    assert "_varjax_functionalized" not in vars(model)


def test_tabulate_options_varjax_does_not_take_raise():
    with pytest.raises(errors.ModuleError, match="compute_flops"):
        tabulated(vnn).tabulate(KEY, X, compute_flops=True)


def test_module_paths():
    flax_paths = tabulated(fnn).module_paths(KEY, X)
    vj_paths = tabulated(vnn).module_paths(KEY, X)
    assert list(vj_paths) == list(flax_paths) == ["", "Block_0", "Block_0/Dense_0", "again",
                                                  "again/Dense_0", "Dense_0"]
    for path, module in vj_paths.items():
        assert type(module).__name__ == type(flax_paths[path]).__name__
        assert module.scope is None and module.name is None
    assert vj_paths["again/Dense_0"].features == 4


def test_variable_methods_take_linens_keywords():
    """``col=`` names the collection, and ``**init_kwargs`` go to the initializer, as in Linen."""
    def build(nn):
        class Keywords(nn.Module):
            @nn.compact
            def __call__(self, x):
                w = self.param("w", nn.initializers.constant(0.0), (1, 5), dtype=jnp.float32,
                               unbox=True)
                c = self.variable(col="stats", name="count", init_fn=jnp.full, shape=(),
                                  fill_value=2.0)
                self.sow(col="intermediates", name="h", value=x)
                self.put_variable(col="stats", name="seen", value=x.sum())
                assert self.has_variable(col="stats", name="count")
                assert self.is_mutable_collection(col="stats")
                return x * w + c.value + self.get_variable(col="stats", name="count")
        return Keywords()
    outs = []
    for nn, _ in LIBS:
        variables = build(nn).init(KEY, X)
        outs.append(build(nn).apply(variables, X, mutable=["stats", "intermediates"]))
    jax.tree.map(np.testing.assert_array_equal, outs[1], outs[0])
