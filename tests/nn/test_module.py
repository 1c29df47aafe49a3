"""The Module lifecycle and API, following Flax's "Module lifecycle" note example by example."""
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

import varjax as vj
import varjax.nn as nn
from varjax import _jax, errors


class Dense(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        return x @ kernel + jnp.broadcast_to(bias, x.shape[:-1] + bias.shape)


class MLP(nn.Module):
    hidden_size: int
    out_size: int

    def setup(self):
        self.hidden = Dense(self.hidden_size)
        self.out = Dense(self.out_size)

    def __call__(self, x):
        return self.out(nn.relu(self.hidden(x)))


class CompactMLP(nn.Module):
    hidden_size: int
    out_size: int

    @nn.compact
    def __call__(self, x):
        a = Dense(self.hidden_size)(x)
        h = nn.relu(a)
        return Dense(self.out_size)(h)


def shapes(tree):
    return jax.tree.map(jnp.shape, tree)


def bitwise_equal(a, b):
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


X = jnp.ones((1, 2))


# --- the lifecycle note, example by example ----------------------------------------------

def test_setup_style_mlp_names_submodules_by_attribute():
    mlp = MLP(hidden_size=5, out_size=3)
    variables = mlp.init(random.key(0), X)
    assert shapes(variables) == {"params": {"hidden": {"kernel": (2, 5), "bias": (5,)},
                                            "out": {"kernel": (5, 3), "bias": (3,)}}}
    assert mlp.apply(variables, X).shape == (1, 3)


def test_init_is_bitwise_apply_with_params_stream_and_everything_mutable():
    mlp = MLP(hidden_size=5, out_size=3)
    variables = mlp.init(random.key(0), X)
    _, same = mlp.apply({}, X, rngs={"params": random.key(0)}, mutable=True)
    assert bitwise_equal(variables, same)


def test_compact_mlp_names_submodules_by_construction_order():
    variables = CompactMLP(hidden_size=4, out_size=5).init(random.key(0), X)
    assert shapes(variables["params"]) == {"Dense_0": {"kernel": (2, 4), "bias": (4,)},
                                           "Dense_1": {"kernel": (4, 5), "bias": (5,)}}


def test_compact_param_shape_from_input():
    class CompactScaledMLP(nn.Module):
        hidden_size: int
        out_size: int

        @nn.compact
        def __call__(self, x):
            scale = self.param("scale", nn.initializers.ones_init(), x.shape[-1:])
            x *= scale[None]
            a = Dense(self.hidden_size)(x)
            h = nn.relu(a)
            return Dense(self.out_size)(h)

    variables = CompactScaledMLP(hidden_size=4, out_size=5).init(random.key(0), jnp.ones((3, 2)))
    assert variables["params"]["scale"].shape == (2,)


class WrongModule(nn.Module):
    @nn.compact
    def __call__(self, x, mode):
        if mode == "encode":
            return Dense(features=8)(x)
        elif mode == "decode":
            return Dense(features=4)(x)


class CorrectModule(nn.Module):
    @nn.compact
    def __call__(self, x, mode):
        encoder = Dense(8)
        decoder = Dense(4)
        if mode == "encode":
            return encoder(x)
        elif mode == "decode":
            return decoder(x)


def _encode_decode(mdl):
    z = mdl(jnp.ones((3, 2)), "encode")
    return mdl(z, "decode")


def test_wrong_module_reuses_dense_0_and_the_other_branch_raises_a_shape_error():
    with pytest.raises(errors.VariableShapeError) as info:
        nn.init(_encode_decode, WrongModule())(random.key(0))
    assert info.value.collection == "params"
    assert info.value.path == ("Dense_0", "kernel")
    assert "float32[2,8]" in str(info.value) and "float32[8,4]" in str(info.value)
    assert "test_module.py" in info.value.source


def test_correct_module_fixes_construction_order():
    variables = nn.init(_encode_decode, CorrectModule())(random.key(0))
    assert variables["params"]["Dense_0"]["kernel"].shape == (2, 8)
    assert variables["params"]["Dense_1"]["kernel"].shape == (8, 4)


def test_top_level_module_stays_unbound_and_setup_does_not_run():
    class TopLevelAccess(nn.Module):
        def setup(self):
            self.foo = Dense(2)

    mdl = TopLevelAccess()
    assert not hasattr(mdl, "foo")
    assert mdl.scope is None


def test_init_and_apply_do_not_bind_the_template():
    mlp = MLP(hidden_size=5, out_size=3)
    variables = mlp.init(random.key(0), X)
    mlp.apply(variables, X)
    assert mlp.scope is None and not hasattr(mlp, "hidden")


def test_bind_gives_a_long_lived_bound_clone():
    mlp = MLP(hidden_size=5, out_size=3)
    variables = mlp.init(random.key(0), X)
    bound = mlp.bind(variables)
    np.testing.assert_array_equal(bound(X), mlp.apply(variables, X))
    assert bitwise_equal(bound.hidden.variables, {"params": variables["params"]["hidden"]})
    np.testing.assert_array_equal(bound.hidden(X), X @ variables["params"]["hidden"]["kernel"]
                                  + variables["params"]["hidden"]["bias"][None])
    assert bound.variables["params"]["out"]["kernel"].shape == (5, 3)


class Counter(nn.Module):
    @nn.compact
    def __call__(self, x):
        count = self.variable("counter", "count", lambda: jnp.zeros((), jnp.int32))
        count.value += 1
        return x * count.value.astype(x.dtype)


def test_bind_with_mutable_collections_updates_the_bound_state():
    variables = Counter().init(random.key(0), X)
    bound = Counter().bind(variables, mutable=["counter"])
    bound(X)
    bound(X)
    assert int(bound.variables["counter"]["count"]) == 3
    assert int(bound.unbind()[1]["counter"]["count"]) == 3
    assert int(variables["counter"]["count"]) == 1          # the input dict is untouched


def test_bind_calls_draw_fresh_rng_keys_each_call():
    class Noise(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x + random.normal(self.make_rng("noise"), x.shape)

    bound = Noise().bind({}, rngs={"noise": random.key(0)})
    first, second = bound(X), bound(X)
    assert not np.array_equal(first, second)
    np.testing.assert_array_equal(first, Noise().apply({}, X, rngs={"noise": random.key(0)}))


# --- naming ---------------------------------------------------------------------------

def test_explicit_names_lists_and_dicts_in_setup():
    class Net(nn.Module):
        def setup(self):
            self.layers = [Dense(3), Dense(4)]
            self.heads = {"a": Dense(2)}
            self.proj = Dense(5, name="projection")

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.proj(x) + self.heads["a"](x).sum()

    params = Net().init(random.key(0), X)["params"]
    assert sorted(params) == ["heads_a", "layers_0", "layers_1", "projection"]


def test_submodule_fields_are_adopted_under_the_field_name():
    class Wrapper(nn.Module):
        inner: nn.Module
        layers: Sequence[nn.Module]

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.inner(x)

    params = Wrapper(Dense(2), [Dense(3), Dense(3)]).init(random.key(0), X)["params"]
    assert sorted(params) == ["inner", "layers_0", "layers_1"]


def test_module_created_in_compact_and_passed_to_another_is_shared_not_copied():
    class UsesGiven(nn.Module):
        layer: nn.Module

        def __call__(self, x):
            return self.layer(x)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            shared = Dense(2)
            return UsesGiven(shared)(x) + shared(x)

    params = Outer().init(random.key(0), X)["params"]
    assert sorted(params) == ["Dense_0"]           # UsesGiven_0 owns no variables


def test_calling_a_compact_method_twice_reuses_its_submodules():
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Dense(2)(x)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            block = Twice()
            return block(x) + block(x)

    params = Outer().init(random.key(0), X)["params"]
    assert shapes(params) == {"Twice_0": {"Dense_0": {"kernel": (2, 2), "bias": (2,)}}}


def test_parent_none_gives_a_detached_module():
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            detached = Dense(2, parent=None)
            assert detached.scope is None
            return x

    Outer().init(random.key(0), X)


# --- the Module API --------------------------------------------------------------------

class Stateful(nn.Module):
    @nn.compact
    def __call__(self, x):
        if self.is_initializing():
            self.put_variable("stats", "seen", jnp.zeros((), jnp.int32))
        if self.is_mutable_collection("stats"):
            self.put_variable("stats", "seen", self.get_variable("stats", "seen") + 1)
        assert self.get_variable("stats", "missing", "default") == "default"
        assert self.has_variable("stats", "seen") and not self.has_variable("stats", "missing")
        self.sow("intermediates", "x", x)
        self.sow("intermediates", "total", x.sum(), reduce_fn=lambda a, b: a + b,
                 init_fn=lambda: jnp.zeros((), jnp.float32))
        return x * 2

    def double(self, x):
        return x * 4


def test_put_get_has_variable_and_is_initializing():
    variables = Stateful().init(random.key(0), X)
    assert int(variables["stats"]["seen"]) == 1
    _, updated = Stateful().apply(variables, X, mutable=["stats"])
    assert int(updated["stats"]["seen"]) == 2


def test_init_leaves_out_intermediates_but_apply_can_collect_them():
    assert "intermediates" not in Stateful().init(random.key(0), X)
    _, state = Stateful().apply({"stats": {"seen": jnp.zeros((), jnp.int32)}}, X,
                                mutable=["intermediates"])
    assert len(state["intermediates"]["x"]) == 1
    assert float(state["intermediates"]["total"]) == 2.0


def test_method_by_name_and_by_callable():
    assert float(Stateful().apply({}, X, method="double")[0, 0]) == 4.0
    assert float(Stateful().apply({}, X, method=Stateful.double)[0, 0]) == 4.0
    assert float(Stateful().apply({}, X, method=lambda m, x: m.double(x) + 1)[0, 0]) == 5.0
    assert float(nn.apply(lambda m, x: m.double(x), Stateful())({}, X)[0, 0]) == 4.0


def test_capture_intermediates_sows_every_call_output():
    mlp = CompactMLP(hidden_size=4, out_size=5)
    variables = mlp.init(random.key(0), X)
    y, state = mlp.apply(variables, X, capture_intermediates=True, mutable=["intermediates"])
    inter = state["intermediates"]
    np.testing.assert_array_equal(inter["__call__"][0], y)
    assert inter["Dense_0"]["__call__"][0].shape == (1, 4)


def test_perturb_gives_gradients_of_intermediate_values():
    class Perturbed(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = self.perturb("h", Dense(3)(x))
            return (h ** 2).sum()

    model = Perturbed()
    variables = model.init(random.key(0), X)
    assert variables["perturbations"]["h"].shape == (1, 3)

    def loss(perturbations):
        return model.apply({**variables, "perturbations": perturbations}, X)
    grads = jax.grad(loss)(variables["perturbations"])
    h = Dense(3).apply({"params": variables["params"]["Dense_0"]}, X)
    np.testing.assert_allclose(grads["h"], 2 * h, rtol=1e-6)
    # without the collection, perturb is the identity
    np.testing.assert_allclose(model.apply({"params": variables["params"]}, X), (h ** 2).sum(), rtol=1e-6)


def test_make_rng_gives_different_keys_per_call_and_same_for_same_inputs():
    class TwoKeys(nn.Module):
        @nn.compact
        def __call__(self):
            return random.key_data(self.make_rng("dropout")), random.key_data(self.make_rng("dropout"))

    a, b = TwoKeys().apply({}, rngs={"dropout": random.key(0)})
    a2, _ = TwoKeys().apply({}, rngs={"dropout": random.key(0)})
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, a2)


def test_clone_copies_fields_with_updates():
    dense = Dense(3)
    assert dense.clone(features=4).features == 4 and dense.clone().features == 3
    assert dense.clone() == dense


def test_variables_property_inside_apply_sees_this_module_only():
    class Inspect(nn.Module):
        @nn.compact
        def __call__(self, x):
            inner = Dense(2)
            y = inner(x)
            return y, jax.tree.map(jnp.shape, inner.variables)

    model = Inspect()
    variables = model.init(random.key(0), X)
    _, seen = model.apply(variables, X)
    assert seen == {"params": {"kernel": (2, 2), "bias": (2,)}}


def test_repeated_apply_does_not_retrace():
    mlp = MLP(hidden_size=5, out_size=3)
    variables = mlp.init(random.key(0), X)
    mlp.apply(variables, X)
    fn = mlp.functionalize()
    count = fn.trace_count
    for _ in range(3):
        mlp.apply(variables, X)
    assert fn.trace_count == count


def test_module_calls_show_in_the_ir_as_named_scopes():
    mlp = MLP(hidden_size=5, out_size=3)
    variables = mlp.init(random.key(0), X)
    jaxpr = mlp.functionalize().jaxpr(X, variables=variables)
    reads = {eqn.params["path"]: str(eqn.source_info.name_stack)
             for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "var_get"}
    assert reads[("hidden", "kernel")] == "MLP/hidden"
    assert reads[("out", "bias")] == "MLP/out"
    assert "var_get[params:hidden/kernel]" in _jax.pretty_print(jaxpr, name_stack=True)


def test_module_works_under_jax_jit_and_grad():
    mlp = MLP(hidden_size=5, out_size=3)
    variables = mlp.init(random.key(0), X)

    @jax.jit
    def loss(params):
        return (mlp.apply({"params": params}, X) ** 2).sum()
    grads = jax.grad(loss)(variables["params"])
    assert shapes(grads) == shapes(variables["params"])


# --- errors ----------------------------------------------------------------------------

def test_two_submodules_with_one_name_raise_name_in_use():
    class Clash(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Dense(2, name="a")(x) + Dense(2, name="a")(x)

    with pytest.raises(errors.NameInUseError) as info:
        Clash().init(random.key(0), X)
    assert info.value.path == ("a",) and "test_module.py" in info.value.source


def test_param_named_like_a_submodule_raises_name_in_use():
    class Clash(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = Dense(2, name="w")(x)
            return y * self.param("w", nn.initializers.ones, (2,))

    with pytest.raises(errors.NameInUseError) as info:
        Clash().init(random.key(0), X)
    assert info.value.collection == "params" and info.value.path == ("w",)


def test_submodule_constructed_outside_setup_or_compact_raises():
    class NotCompact(nn.Module):
        def __call__(self, x):
            return Dense(2)(x)

    with pytest.raises(errors.AssignSubModuleError) as info:
        NotCompact().init(random.key(0), X)
    assert "@compact" in str(info.value) and "test_module.py" in info.value.source


def test_using_a_bound_module_after_apply_raises_invalid_scope():
    kept = []

    def keep(mdl, x):
        kept.append(mdl)
        return mdl(x)
    mlp = MLP(hidden_size=5, out_size=3)
    variables = mlp.init(random.key(0), X)
    nn.apply(keep, mlp)(variables, X)
    with pytest.raises(errors.InvalidScopeError) as info:
        kept[0](X)
    assert "after the init/apply" in str(info.value) and "test_module.py" in info.value.source


def test_setting_attributes_outside_setup_raises_frozen():
    with pytest.raises(errors.FrozenModuleError):
        Dense(3).features = 4


def test_calling_a_compact_method_on_an_unbound_module_raises():
    with pytest.raises(errors.UnboundModuleError) as info:
        Dense(3)(X)
    assert "module.init / module.apply" in info.value.fix


def test_unknown_method_name_raises():
    with pytest.raises(errors.ModuleError, match="no method or submodule field 'nope'"):
        Dense(3).apply({}, X, method="nope")


def test_missing_param_in_apply_names_module_and_variable():
    with pytest.raises(errors.MissingVariableError) as info:
        MLP(5, 3).apply({"params": {}}, X)
    assert info.value.path == ("hidden", "kernel")
    assert info.value.module == "MLP/hidden (Dense)"


def test_init_function_cannot_use_variables():
    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            return self.param("w", lambda key, shape: vj.param("inner", jnp.zeros, shape), (2,))

    with pytest.raises(errors.ScopeError, match="inside an init function"):
        Bad().init(random.key(0), X)


def test_modules_are_hashable_dataclasses():
    assert hash(Dense(3)) == hash(Dense(3)) and Dense(3) == Dense(3) and Dense(3) != Dense(4)
    assert repr(Dense(3, name="d")) == "Dense(features=3, name='d')"


def test_fields_with_defaults_and_inheritance():
    class Base(nn.Module):
        features: int
        use_bias: bool = True

    class Child(Base):
        scale: float = 1.0

        @nn.compact
        def __call__(self, x: Any):
            return Dense(self.features)(x) * self.scale

    child = Child(4, scale=2.0, name="c")
    assert (child.features, child.use_bias, child.scale, child.name) == (4, True, 2.0, "c")
    assert Child(4).init(random.key(0), X)["params"]["Dense_0"]["kernel"].shape == (2, 4)


# --- caching and error locations -------------------------------------------------------------

def test_equal_modules_share_traces_and_different_ones_do_not():
    variables = MLP(5, 3).init(random.key(0), X)
    MLP(5, 3).apply(variables, X)
    fn = MLP(5, 3).functionalize()
    count = fn.trace_count
    MLP(5, 3).apply(variables, X)                 # a new but equal object: a cache hit
    assert fn.trace_count == count
    assert MLP(5, 4).functionalize() is not fn


def test_error_in_a_library_layer_applied_directly_names_the_callers_line():
    with pytest.raises(errors.MissingRngError) as info:
        nn.Dropout(0.5).apply({}, X, deterministic=False)
    assert "test_module.py" in info.value.source and info.value.collection == "dropout"


def test_pass_error_in_a_library_layer_names_the_callers_line():
    bn = nn.BatchNorm(use_running_average=False)
    variables = bn.init(random.key(0), X)
    with pytest.raises(errors.ImmutableCollectionError) as info:
        bn.apply(variables, X)                    # batch_stats written but not mutable
    assert "test_module.py" in info.value.source and info.value.collection == "batch_stats"


def test_nowrap_methods_are_plain_python():
    class WithHelper(nn.Module):
        width: int

        @nn.nowrap
        def make_layer(self, features):       # not wrapped: no setup, usable unbound
            return Dense(features * self.width)

        def setup(self):
            self.layer = self.make_layer(2)

        def __call__(self, x):
            return self.layer(x)

    mdl = WithHelper(3)
    assert mdl.make_layer(1).features == 3 and not hasattr(mdl, "layer")
    assert not getattr(WithHelper.make_layer, "varjax_wrapped", False)
    assert WithHelper(3).init(random.key(0), X)["params"]["layer"]["kernel"].shape == (2, 6)
