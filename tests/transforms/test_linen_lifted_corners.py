"""Lifted-transform corners Linen supports (issue 18 item 4), each checked against
``flax.linen``: the same model source under both libraries, initialised to the same variable
layout, applied to Flax's variables with the same outputs and mutated collections."""
from __future__ import annotations

import functools

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax.nn as vj_nn

X = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3) / 6


def check_like_linen(make, *args, mutable=False):
    """``make(nn)`` under both libraries: the same variable layout from ``init``, and the same
    output (and mutated collections) from ``apply`` on Flax's variables."""
    ref_model, model = make(flax_nn), make(vj_nn)
    ref_vars = ref_model.init(jax.random.key(0), *args)
    ours_vars = model.init(jax.random.key(0), *args)
    assert jax.tree.map(jnp.shape, dict(ours_vars)) == jax.tree.map(jnp.shape, dict(ref_vars))
    expected = ref_model.apply(ref_vars, *args, mutable=mutable)
    got = model.apply(ref_vars, *args, mutable=mutable)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, expected))
    return got


def _scaled(nn):
    class Scaled(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            return nn.Dense(2)(x) * (2.0 if train else 1.0)
    return Scaled


@pytest.mark.parametrize("form", ["class", "decorator", "function"])
def test_remat_with_static_argnums(form):
    def make(nn):
        if form == "class":
            remat_scaled = nn.remat(_scaled(nn), static_argnums=(2,))

            class Top(nn.Module):
                @nn.compact
                def __call__(self, x):
                    return remat_scaled()(x, True) + remat_scaled()(x, False)
            return Top()
        if form == "decorator":
            class Inner(nn.Module):
                @functools.partial(nn.remat, static_argnums=(2,))
                @nn.compact
                def __call__(self, x, train: bool = True):
                    return nn.Dense(2)(x) * (2.0 if train else 1.0)

            class Top(nn.Module):
                @nn.compact
                def __call__(self, x):
                    return Inner()(x, True)
            return Top()

        class Top(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.remat(lambda mdl, x, s: mdl(x) * s, static_argnums=(2,))(nn.Dense(2), x, 3.0)
        return Top()
    check_like_linen(make, X)


@pytest.mark.parametrize("transform", ["vmap", "jit", "remat"])
def test_lifted_transform_over_a_module_adopted_from_outside(transform):
    def make(nn):
        lift = {"vmap": lambda f: nn.vmap(f, variable_axes={"params": None},
                                          split_rngs={"params": False}),
                "jit": nn.jit, "remat": nn.remat}[transform]

        class Wrap(nn.Module):
            inner: nn.Module

            @nn.compact
            def __call__(self, x):
                return lift(lambda mdl, x: mdl(x))(self.inner, x)
        return Wrap(nn.Dense(2))
    check_like_linen(make, X)


def _two_methods(nn):
    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="d")(x)

        def doubled(self, x):
            return self(x) * 2
    return Two


@pytest.mark.parametrize("transform", ["jit", "vmap"])
def test_class_transformed_with_several_methods(transform):
    def make(nn):
        if transform == "jit":
            lifted = nn.jit(_two_methods(nn), methods=["__call__", "doubled"])
        else:
            lifted = nn.vmap(_two_methods(nn), variable_axes={"params": 0},
                             split_rngs={"params": True}, methods=["__call__", "doubled"])

        class Top(nn.Module):
            @nn.compact
            def __call__(self, x):
                two = lifted()
                return two(x) + two.doubled(x)
        return Top()
    check_like_linen(make, X)


def test_map_variables_ties_a_decoder_to_the_encoder_kernel():
    def make(nn):
        class TiedAutoEncoder(nn.Module):
            def setup(self):
                self.encoder = nn.Dense(2, use_bias=False)

            def __call__(self, x):
                z = self.encoder(x)
                decode = nn.map_variables(
                    lambda mdl, z: z @ mdl.encoder.variables["params"]["kernel"], "params",
                    trans_in_fn=lambda v: jax.tree.map(jnp.transpose, v))
                return decode(self, z)
        return TiedAutoEncoder()
    out = check_like_linen(make, X)
    assert out.shape == X.shape


def test_map_variables_trans_out_fn_is_applied_to_created_variables():
    def make(nn):
        class Halved(nn.Module):
            @nn.compact
            def __call__(self, x):
                dense = nn.map_variables(
                    nn.Dense, "params", trans_in_fn=lambda v: jax.tree.map(lambda a: a * 2, v),
                    trans_out_fn=lambda v: jax.tree.map(lambda a: a / 2, v), init=True,
                    mutable=True)
                return dense(2, use_bias=False, name="enc")(x)
        return Halved()
    check_like_linen(make, X)


def test_alias_mutated_through_two_paths_in_one_transform():
    def make(nn):
        class Counter(nn.Module):
            @nn.compact
            def __call__(self):
                n = self.variable("state", "n", lambda: jnp.zeros((), jnp.int32))
                n.value += 1
                return n.value

        class Top(nn.Module):
            def setup(self):
                self.counter = Counter()
                self.alias = self.counter

            def __call__(self, x):
                return nn.jit(lambda mdl: (mdl.counter(), mdl.alias()))(self)
        return Top()
    (first, second), state = check_like_linen(make, X, mutable=["state"])
    # init counted to 2 through both paths; apply counts on from there, one variable
    assert (int(first), int(second)) == (3, 4)
    assert int(state["state"]["counter"]["n"]) == 4


@pytest.mark.parametrize("form", ["own method", "submodule method"])
def test_unbound_method_in_the_direct_form(form):
    def make(nn):
        if form == "own method":
            class Top(nn.Module):
                def setup(self):
                    self.dense = nn.Dense(2)

                def __call__(self, x):
                    return nn.vmap(Top.project, variable_axes={"params": None},
                                   split_rngs={"params": False})(self, x)

                def project(self, x):
                    return self.dense(x)
            return Top()
        two = _two_methods(nn)

        class Top(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.jit(two.doubled)(two(), x)
        return Top()
    check_like_linen(make, X)


def test_scan_carries_the_variables_of_a_list_of_submodules():
    """Linen needs carry variables to exist before the scan (its init fails when the body
    creates them); varjax creates them inside, with the layout Linen's apply expects."""
    def make(nn):
        class Counter(nn.Module):
            @nn.compact
            def __call__(self, x):
                n = self.variable("state", "n", lambda: jnp.zeros((), jnp.float32))
                n.value += x.sum()
                return n.value

        class Step(nn.Module):
            def setup(self):
                self.counters = [Counter(), Counter()]

            def __call__(self, carry, x):
                return carry + self.counters[0](x) - self.counters[1](2 * x), None

        class Top(nn.Module):
            @nn.compact
            def __call__(self, xs):
                scan = nn.scan(Step, variable_carry="state", split_rngs={"params": False})
                return scan()(jnp.zeros(()), xs)[0]
        return Top()
    zero = {"n": jnp.zeros((), jnp.float32)}
    start = {"state": {"ScanStep_0": {"counters_0": zero, "counters_1": zero}}}
    ours = make(vj_nn)
    assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), X)) == jax.tree.map(jnp.shape, start)
    expected = make(flax_nn).apply(start, X, mutable=["state"])
    got = ours.apply(start, X, mutable=["state"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, expected)
    np.testing.assert_allclose(got[1]["state"]["ScanStep_0"]["counters_0"]["n"], X.sum())


def test_while_loop_draws_with_a_deny_list_are_linens_bit_for_bit():
    """Keys split by ``split_rngs={DenyList('params'): True}`` in a ``while_loop`` body: the
    same parameters and the same noise as Linen from the same keys."""
    def make(nn):
        class Noisy(nn.Module):
            @nn.compact
            def __call__(self, x):
                dense = nn.Dense(3)
                dense(x)

                def body(mdl, carry):
                    i, x = carry
                    return i + 1, mdl(x) + jax.random.normal(mdl.make_rng("noise"), x.shape)
                return nn.while_loop(lambda mdl, c: c[0] < 3, body, dense, (0, x),
                                     split_rngs={nn.DenyList("params"): True})[1]
        return Noisy()
    keys = {"params": jax.random.key(0), "noise": jax.random.key(1)}
    ref_model, model = make(flax_nn), make(vj_nn)
    ref_vars, ours = ref_model.init(keys, X), model.init(keys, X)
    jax.tree.map(np.testing.assert_array_equal, dict(ours), dict(ref_vars))
    noise = {"noise": jax.random.key(2)}
    np.testing.assert_array_equal(model.apply(ref_vars, X, rngs=noise),
                                  ref_model.apply(ref_vars, X, rngs=noise))


@pytest.mark.parametrize("form", ["class", "decorator"])
@pytest.mark.parametrize("static", [(2,), ()])
def test_remat_traces_python_numbers_unless_static_argnums_marks_them(form, static):
    """Linen's ``remat`` hands a body Python numbers as tracers (positional and keyword);
    ``static_argnums`` is how a body gets a Python ``bool``."""
    def seen_under(nn):
        seen = []

        class Foo(nn.Module):
            @nn.compact
            def __call__(self, x, train, scale=1.0):
                seen.append((isinstance(train, bool), isinstance(scale, float)))
                return nn.Dense(2)(x)
        lifted = (nn.remat(Foo, static_argnums=static) if form == "class" else
                  type("Foo", (Foo,), {"__call__": functools.partial(
                      nn.remat, static_argnums=static)(Foo.__call__)}))

        class Top(nn.Module):
            @nn.compact
            def __call__(self, x):
                return lifted()(x, True, scale=2.0)
        Top().init(jax.random.key(0), X)
        return seen
    assert seen_under(vj_nn) == seen_under(flax_nn) == [(static == (2,), False)]


def test_while_loop_over_a_bound_module_outside_apply_with_a_denylist_in_split_rngs():
    """Linen's direct-form ``while_loop`` given a ``bind`` module outside ``init``/``apply``
    runs in the module's bound scope; ``split_rngs`` takes a ``DenyList`` filter."""
    def run(nn):
        class Foo(nn.Module):
            def setup(self):
                pass

        def body(module, carry):
            return carry + jax.random.uniform(module.make_rng("random"))
        bound = Foo().bind({}, rngs={"random": jax.random.key(0)})
        return nn.while_loop(lambda m, c: c < 3, body, bound, jnp.zeros(()),
                             split_rngs={"params": False, nn.DenyList(("params",)): True})
    got, expected = run(vj_nn), run(flax_nn)
    assert float(expected) >= 3.0
    np.testing.assert_array_equal(got, expected)


def test_a_direct_form_transform_given_an_unbound_module_outside_apply_names_it():
    from varjax import errors

    class Foo(vj_nn.Module):
        def setup(self):
            pass
    with pytest.raises(errors.UnboundModuleError, match="Foo.*not bound") as info:
        vj_nn.while_loop(lambda m, c: c < 3, lambda m, c: c + 1, Foo(), jnp.zeros(()))
    assert __file__ in info.value.source


def _bound_branches(nn):
    class CondModel(nn.Module):
        def setup(self):
            self.dense = nn.Dense(3)

        def double(self, x):
            return self.dense(x) * 2

        def keep(self, x):
            self.dense(x)
            return x

        def __call__(self, x):
            y = nn.cond(x.sum() > 0, self.double, self.keep, self, x)
            return nn.while_loop(lambda m, c: c[0] < 2, self.step, self, (0, y))[1]

        def step(self, c):
            return c[0] + 1, self.dense(c[1])
    return CondModel()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_direct_transforms_take_bound_setup_methods_as_functions_under_jitted_init(sign):
    """``nn.cond(p, self.f1, self.f2, self, x)``: a bound method is called with the module
    first, as Linen unwraps it; under ``jax.jit(init_with_output)`` too."""
    x = sign * jnp.ones(3)
    ref_out, ref_vars = jax.jit(_bound_branches(flax_nn).init_with_output)(jax.random.key(0), x)
    out, variables = jax.jit(_bound_branches(vj_nn).init_with_output)(jax.random.key(0), x)
    jax.tree.map(np.testing.assert_array_equal, dict(variables), dict(ref_vars))
    np.testing.assert_allclose(out, ref_out, rtol=1e-6)
    np.testing.assert_allclose(_bound_branches(vj_nn).apply(ref_vars, x),
                               _bound_branches(flax_nn).apply(ref_vars, x), rtol=1e-6)


def _two_scanned_methods(nn, transform):
    class Foo(nn.Module):
        def setup(self):
            self.dense0 = nn.Dense(2)
            self.dense1 = nn.Dense(2)

        def method_0(self, x):
            return self.dense0(x), x

        def method_1(self, x, y):
            return self.dense1(x) + y, None

    if transform == "scan":
        lifted = nn.scan(Foo, methods={
            "method_0": dict(variable_axes={"params": 0}, split_rngs={"params": True},
                             in_axes=nn.broadcast, length=3),
            "method_1": dict(variable_axes={"params": 0}, split_rngs={"params": True},
                             in_axes=0, length=3)})
    else:
        per = dict(variable_axes={"params": 0}, split_rngs={"params": True})
        lifted = nn.vmap(Foo, None, None, methods={
            "method_0": dict(per, in_axes=None, axis_size=3),
            "method_1": dict(per, in_axes=(0, 0))})

    class Bar(nn.Module):
        @nn.compact
        def __call__(self, x):
            foo = lifted()
            y, ys = foo.method_0(x)
            return foo.method_1(y, ys)[0]
    return Bar()


@pytest.mark.parametrize("transform", ["scan", "vmap"])
def test_class_transform_with_per_method_options(transform):
    """``methods={name: {option: value}}`` lifts each method with its own options."""
    check_like_linen(lambda nn: _two_scanned_methods(nn, transform), X[:, :2])


def test_per_method_options_need_a_module_class():
    with pytest.raises(TypeError, match="needs a Module class"):
        vj_nn.scan(lambda mdl, c, x: (c, x), methods={"__call__": {}})


def test_a_transformed_method_sees_the_submodule_names_its_caller_reserved():
    """A jitted method creating a submodule under a name its (jitted) caller already used
    raises, as in Linen; under a fresh name it works."""
    def make(nn, name):
        class Foo(nn.Module):
            @nn.jit
            def helper(self, x, m):
                nn.Dense(2, name=name)
                return m(x)

            @nn.jit
            @nn.compact
            def __call__(self, x):
                return self.helper(x, nn.Dense(2, name="a"))
        return Foo()
    from varjax import errors
    with pytest.raises(errors.NameInUseError, match="'a'"):
        make(vj_nn, "a").init(jax.random.key(0), X)
    with pytest.raises(Exception):
        make(flax_nn, "a").init(jax.random.key(0), X)
    assert jax.tree.map(jnp.shape, make(vj_nn, "b").init(jax.random.key(0), X)) == \
        jax.tree.map(jnp.shape, make(flax_nn, "b").init(jax.random.key(0), X))


@pytest.mark.parametrize("transform", ["jit", "remat"])
def test_a_variable_handle_passed_to_a_transformed_method_is_written_in_its_owner(transform):
    """``self.variable(...)``'s handle given to a jitted (or rematted) method: its writes
    reach the variable, as in Linen (it was flattened to a copy of its value before, and
    the write was silently lost)."""
    def make(nn):
        lift = getattr(nn, transform)

        class Test(nn.Module):
            @lift
            @nn.compact
            def __call__(self, x):
                baz = self.variable("test", "baz", jnp.zeros, x.shape)
                return self.add(x, baz)

            @lift
            def add(self, x, baz):
                baz.value += x
                return baz.value
        return Test()
    x = jnp.ones((1,))
    for nn in (flax_nn, vj_nn):
        variables = make(nn).init(jax.random.key(0), x)
        np.testing.assert_array_equal(variables["test"]["baz"], [1.0])
        y, variables = make(nn).apply(variables, x, mutable=["test"])
        np.testing.assert_array_equal(variables["test"]["baz"], [2.0])
        np.testing.assert_array_equal(y, [2.0])


def test_linen_autodiff_direct_forms_take_bound_methods():
    """``nn.jvp``/``nn.vjp``/``nn.value_and_grad`` given ``self.method`` call it with the
    module first, as Linen unwraps it."""
    def make(nn):
        class Model(nn.Module):
            def setup(self):
                self.dense = nn.Dense(2)

            def loss(self, x):
                return jnp.sum(self.dense(x) ** 2)

            def __call__(self, x):
                value, _ = nn.value_and_grad(self.loss, self, x)
                out, vjp_fn = nn.vjp(self.loss, self, x)
                primal, tangent = nn.jvp(self.loss, self, (x,), (jnp.ones_like(x),), {})
                return value + out + primal + tangent + vjp_fn(jnp.ones(()))[1].sum()
        return Model()
    check_like_linen(make, X)


def test_per_method_options_must_be_a_dict_per_method():
    with pytest.raises(TypeError, match=r"methods\['method_0'\] must be a dict"):
        vj_nn.scan(_two_methods(vj_nn), methods={"method_0": 3})
