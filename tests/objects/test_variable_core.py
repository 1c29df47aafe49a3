"""The Variable-centric object core: one ``Variable`` class hierarchy whose subclasses are
pytrees and nodes of their own class, mapped to collections by one registry."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn
from varjax.objects.nodes import is_node
from varjax.trace.variable import collection_of, variable_type


class Weight(vj.Variable, collection="weights"):
    pass


class Tally(vj.Variable):        # no collection given: its class name
    pass


# --- (a) one class hierarchy, one registry -----------------------------------------------

def test_subclass_registry_maps_class_to_collection_and_back():
    assert collection_of(Weight) == "weights" and variable_type("weights") is Weight
    assert collection_of(Tally) == "Tally" and variable_type("Tally") is Tally
    assert collection_of(vj.Variable) is None and variable_type("no-such") is vj.Variable
    assert Weight(jnp.ones(2)).collection == "weights"


def test_two_classes_claiming_one_collection_raise():
    with pytest.raises(vj.errors.InvalidVariablesError, match="already the collection of"):
        class Other(vj.Variable, collection="weights"):
            pass
    assert variable_type("weights") is Weight


def test_a_subclass_instance_given_another_collection_raises():
    with pytest.raises(vj.errors.InvalidVariablesError, match="its collection is 'weights'"):
        Weight(jnp.ones(2), collection="params")


def test_subclass_is_a_node_and_unflattens_as_its_class():
    w = Weight(jnp.ones(2), out_sharding=("a",))
    assert is_node(w)
    leaves, tree = jax.tree_util.tree_flatten(w)
    back = jax.tree_util.tree_unflatten(tree, [x * 2 for x in leaves])
    assert type(back) is Weight and back.get_metadata() == {"out_sharding": ("a",)}
    np.testing.assert_array_equal(back.value, [2.0, 2.0])


def test_subclass_round_trips_through_split_and_merge():
    graphdef, state = vj.split({"w": Weight(jnp.ones(2)), "t": Tally(jnp.zeros(()))})
    assert sorted(state) == ["Tally", "weights"]
    back = vj.merge(graphdef, state)
    assert type(back["w"]) is Weight and type(back["t"]) is Tally


def test_subclass_is_its_own_class_inside_and_after_jit():
    w, seen = Weight(jnp.ones(2)), []

    @vj.jit
    def step(w):
        seen.append(type(w))
        w.value = w.value + 1
        return w
    out = step(w)
    assert seen == [Weight] and type(out) is Weight
    np.testing.assert_array_equal(w.value, [2.0, 2.0])


def test_grad_of_a_subclass_is_the_subclass():
    g = vj.grad(lambda w: jnp.sum(w.value ** 2))(Weight(jnp.array([1.0, 2.0])))
    assert type(g) is Weight
    np.testing.assert_allclose(g.value, [2.0, 4.0])


# --- (b) one key per distinct variable ----------------------------------------------------

class _Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False, momentum=0.5)(nn.Dense(2)(x))


class _Model(nn.Module):
    def setup(self):
        self.encoder = _Encoder()
        self.head = nn.Dense(1)

    def __call__(self, x):
        return self.head(self.encoder(x))


_X = jnp.arange(4.0, dtype=jnp.float32).reshape(2, 2)


def _model():
    variables = _Model().init(jax.random.key(0), _X)
    return _Model().bind(variables, mutable=["batch_stats"])


def _both(model, encoder):
    return jnp.sum(model(_X)) + jnp.sum(encoder(_X * 2))


def test_model_and_its_submodule_in_jit_share_variables_and_update_them_once():
    eager, traced = _model(), _model()
    expected = _both(eager, eager.encoder)
    np.testing.assert_allclose(vj.jit(_both)(traced, traced.encoder), expected, rtol=1e-6)
    stats = lambda m: m.variables["batch_stats"]["encoder"]["BatchNorm_0"]["mean"]  # noqa: E731
    np.testing.assert_allclose(stats(traced), stats(eager), rtol=1e-6)   # both updates, in order
    np.testing.assert_allclose(vj.jit(_both)(traced.encoder, traced),
                               _both(eager.encoder, eager), rtol=1e-6)   # either order


def test_grad_of_a_variable_shared_by_two_arguments_totals_both_uses():
    model = _model()
    variables = {"params": model.variables["params"],
                 "batch_stats": model.variables["batch_stats"]}

    def pure(params):
        whole = _Model().apply({**variables, "params": params}, _X, mutable=["batch_stats"])[0]
        part = _Encoder().apply({"params": params["encoder"],
                                 "batch_stats": variables["batch_stats"]["encoder"]},
                                _X * 2, mutable=["batch_stats"])[0]
        return jnp.sum(whole) + jnp.sum(part)
    want = jax.grad(pure)(variables["params"])["encoder"]
    g_model, g_enc = vj.grad(_both, argnums=(0, 1))(model, model.encoder)
    got = vj.state(g_model, "params")["params"]["encoder"]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
    zero = vj.state(g_enc, "params")["params"]              # the whole gradient is the model's
    assert all(not np.any(x) for x in jax.tree.leaves(zero))
    only = vj.grad(_both, argnums=1)(model, model.encoder)   # or the one differentiated
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 vj.state(only, "params")["params"], want)


class _Drop(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(x)


def _draws(a, b, rngs):
    return a(jnp.ones(8)), b(jnp.ones(8)), jax.random.key_data(rngs.default())


def test_one_rngs_shared_by_two_modules_and_passed_itself_is_one_state():
    eager_rngs, traced_rngs = vj.Rngs(0), vj.Rngs(0)
    eager = _draws(_Drop().bind({}, rngs=eager_rngs), _Drop().bind({}, rngs=eager_rngs), eager_rngs)
    traced = vj.jit(_draws)(_Drop().bind({}, rngs=traced_rngs), _Drop().bind({}, rngs=traced_rngs),
                            traced_rngs)
    for e, t in zip(eager, traced):
        np.testing.assert_array_equal(e, t)
    assert int(traced_rngs.default.count) == int(eager_rngs.default.count) == 3


def test_a_variable_shared_at_two_vmap_axes_raises_naming_it():
    model = _model()
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), model)
    with pytest.raises(vj.errors.InconsistentAliasError,
                       match="variable encoder/BatchNorm_0/mean of collection 'batch_stats'"):
        vj.vmap(lambda m, e: jnp.sum(m(_X)), in_axes=(0, None))(stacked, stacked.encoder)


# --- (c) a Variable made inside a transform ------------------------------------------------

def test_a_variable_made_inside_jit_comes_back_as_a_new_variable_of_its_class():
    def make():
        w = Weight(jnp.ones(2), tag=1)
        vj.jit(lambda w: setattr(w, "value", w.value + 1))(w)     # updated by a nested call
        return {"w": w, "t": Tally(jnp.zeros(()))}
    out = vj.jit(make)()
    assert type(out["w"]) is Weight and out["w"].get_metadata() == {"tag": 1}
    assert type(out["t"]) is Tally
    np.testing.assert_array_equal(out["w"].value, [2.0, 2.0])


def test_a_variable_made_inside_jit_is_of_its_trace_and_cannot_be_used_after_it():
    kept = []

    def make():
        kept.append(Weight(jnp.ones(2)))
        return kept[-1]
    vj.jit(make)()
    with pytest.raises(vj.errors.InvalidScopeError, match="used after the object-mode transform"):
        kept[0].value


def test_shape_only_evaluation_is_jax_eval_shape_of_the_transform():
    shapes = jax.eval_shape(vj.jit(lambda: Weight(jnp.ones((2, 3)), out_sharding=("x", None))))
    assert type(shapes) is Weight and shapes.value.shape == (2, 3)
    assert shapes.get_metadata() == {"out_sharding": ("x", None)}


# --- (d) metadata in the IR: shard-variables places out_sharding ---------------------------

def _mesh():
    return jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


def test_shard_variables_constrains_a_variable_by_its_out_sharding():
    v = vj.Variable(jnp.ones((4, 2)), out_sharding=("x", None))

    def step(v):
        v.value = v.value * 2
    with jax.set_mesh(_mesh()), vj.tracing_only():   # make_jaxpr's copy of v is not an update
        text = str(jax.make_jaxpr(vj.jit(step))(v))
    with jax.set_mesh(_mesh()):
        vj.jit(step)(v)
    assert "sharding_constraint" in text and "P('x', None)" in text
    assert v.value.sharding.shard_shape((4, 2)) == (2, 2)    # split over x
    assert v.get_metadata() == {"out_sharding": ("x", None)}    # unboxed again outside
    np.testing.assert_array_equal(v.value, np.full((4, 2), 2.0))


def test_a_variable_made_inside_jit_under_a_mesh_is_placed_by_its_out_sharding():
    with jax.set_mesh(_mesh()):
        w = vj.jit(lambda: Weight(jnp.ones((4, 2)), out_sharding=("x", None)))()
    assert type(w) is Weight
    assert w.value.sharding.shard_shape((4, 2)) == (2, 2)


# --- (e) one class: a bound module's variable outside a trace is a Variable -----------------

class _Counts(nn.Module):
    @nn.compact
    def __call__(self, x):
        c = self.variable("counts", "n", jnp.zeros, ())
        c.value = c.value + 1
        return x


def test_module_variable_of_a_bound_module_is_a_read_only_view_that_is_a_variable():
    model = _Counts().bind(_Counts().init(jax.random.key(0), 1.0), mutable=["counts"])
    n = model.variable("counts", "n")
    assert isinstance(n, vj.Variable) and n.collection == "counts" and float(n.value) == 1.0
    model(1.0)
    assert float(n.value) == 2.0                     # a view: it reads the module's variable
    with pytest.raises(AttributeError, match="read-only outside its calls"):
        n.value = 5.0
