"""Boxed partitioning metadata in ``varjax.nn`` against Flax Linen: the same models, with
``with_partitioning`` / ``with_logical_partitioning`` initializers, give the same boxed
``init`` tree (paths, box classes, names, bitwise values), the same ``PartitionSpec`` s and
the same outputs, from boxed and from unboxed parameters."""
from __future__ import annotations

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import varjax.nn as nn
from varjax import errors

RULES = (("batch", "data"), ("embed", "model"), ("mlp", "model"), ("heads", "model"), ("vocab", None))


def _boxed(lib, init, names, logical):
    return (lib.with_logical_partitioning if logical else lib.with_partitioning)(init, names)


def _dense(lib, logical):
    class MLP(lib.Module):
        @lib.compact
        def __call__(self, x):
            init = lib.initializers.lecun_normal()
            h = lib.Dense(6, kernel_init=_boxed(lib, init, ("embed", "mlp"), logical),
                          bias_init=_boxed(lib, lib.initializers.normal(), ("mlp",), logical))(x)
            return lib.Dense(4, kernel_init=_boxed(lib, init, ("mlp", "embed"), logical))(lib.relu(h))
    return MLP(), jnp.ones((2, 4))


def _dense_general(lib, logical):
    return lib.DenseGeneral((2, 3), axis=(-2, -1), kernel_init=_boxed(
        lib, lib.initializers.lecun_normal(), ("heads", "kv", "mlp", "embed"), logical),
        bias_init=_boxed(lib, lib.initializers.normal(), ("mlp", "embed"), logical)), jnp.ones((2, 2, 5))


def _embed(lib, logical):
    class Tied(lib.Module):
        @lib.compact
        def __call__(self, ids):
            embed = lib.Embed(7, 4, embedding_init=_boxed(
                lib, lib.initializers.normal(1.0), ("vocab", "embed"), logical))
            return embed.attend(embed(ids))
    return Tied(), jnp.array([[1, 5, 6]])


def _attention(lib, logical):
    init = lib.initializers.xavier_uniform()
    return lib.MultiHeadDotProductAttention(
        num_heads=2, qkv_features=4, kernel_init=_boxed(lib, init, ("embed", "heads", "kv"), logical),
        out_kernel_init=_boxed(lib, init, ("heads", "kv", "embed"), logical)), jnp.ones((2, 3, 4))


def _stats(lib, logical):
    class Stats(lib.Module):
        @lib.compact
        def __call__(self, x):
            total = self.variable("stats", "total", _boxed(lib, jnp.zeros, ("embed",), logical), x.shape[-1:])
            total.value = total.value + x.sum(0)
            count = self.variable("stats", "count", lambda: jnp.zeros((), jnp.int32))
            count.value = count.value + 1
            return x * total.value[None]
    return Stats(), jnp.arange(8.0).reshape(2, 4)


MODELS = {"dense": _dense, "dense_general": _dense_general, "embed": _embed,
          "attention": _attention, "stats": _stats}
CASES = [(name, logical) for name in MODELS for logical in (False, True)]


def _flat(tree):
    return dict(jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, (nn.meta.AxisMetadata, linen.meta.AxisMetadata)))[0])


def _same_boxes(ours, theirs):
    a, b = _flat(ours), _flat(theirs)
    assert [jax.tree_util.keystr(k) for k in a] == [jax.tree_util.keystr(k) for k in b]
    for x, y in zip(a.values(), b.values()):
        assert type(x).__name__ == type(y).__name__
        if hasattr(y, "names"):
            fields = ("names", "mesh", "rules")
            assert [getattr(x, f, None) for f in fields] == [getattr(y, f, None) for f in fields]
        np.testing.assert_array_equal(nn.unbox(x), linen.unbox(y))
        assert jnp.asarray(nn.unbox(x)).dtype == jnp.asarray(linen.unbox(y)).dtype


@pytest.mark.parametrize("name, logical", CASES)
def test_boxed_model_equals_linen(name, logical):
    ours, x = MODELS[name](nn, logical)
    theirs, _ = MODELS[name](linen, logical)
    key = jax.random.key(0)
    # both under jit: bit-exact (an eager init runs op by op, and XLA may round a fused
    # multiply of the whole program differently; tests/nn/test_eager_init.py: eager = eager)
    variables, linen_variables = jax.jit(ours.init)(key, x), jax.jit(theirs.init)(key, x)
    _same_boxes(variables, linen_variables)
    assert nn.get_partition_spec(variables) == linen.get_partition_spec(linen_variables)
    with nn.logical_axis_rules(RULES), linen.logical_axis_rules(RULES):
        assert nn.logical_to_mesh(nn.get_partition_spec(variables)) == \
            linen.logical_to_mesh(linen.get_partition_spec(linen_variables))
    mutable = ["stats"] if "stats" in variables else False
    want = theirs.apply(linen_variables, x, mutable=mutable)
    for given in (variables, nn.unbox(variables)):         # boxed, and as Linen accepts: unboxed
        got = ours.apply(given, x, mutable=mutable)
        for a, b in zip(jax.tree.leaves(nn.unbox(got)), jax.tree.leaves(linen.unbox(want))):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    if mutable:     # a write through Module.variable keeps the boxes, as in Linen
        _, updates = ours.apply(variables, x, mutable=mutable)
        _same_boxes(updates, want[1])
        _, updates = ours.apply(nn.unbox(variables), x, mutable=mutable)
        assert not _flat(updates) or not any(isinstance(v, nn.Partitioned) for v in _flat(updates).values())


def _metadata_axis(lib, params):
    class Layer(lib.Module):
        @lib.compact
        def __call__(self, x):
            init = lib.with_partitioning(lib.initializers.lecun_normal(), ("in", "out"))
            return lib.Dense(3, kernel_init=init)(x)
    return lib.add_metadata_axis(Layer, variable_axes={"params": 0}, metadata_params=params)()


def test_add_metadata_axis_equals_linen():
    x, key = jnp.ones((2, 4)), jax.random.key(0)
    ours = _metadata_axis(nn, {nn.PARTITION_NAME: "layers"})
    theirs = _metadata_axis(linen, {linen.PARTITION_NAME: "layers"})
    variables, linen_variables = ours.init(key, x), jax.jit(theirs.init)(key, x)
    _same_boxes(variables, linen_variables)
    assert nn.get_partition_spec(variables)["params"]["Dense_0"]["kernel"] == P("layers", "in", "out")
    np.testing.assert_allclose(ours.apply(variables, x), theirs.apply(linen_variables, x), rtol=1e-6)


def test_add_metadata_axis_without_partition_name_is_an_error():
    with pytest.raises(errors.PartitioningError, match="'partition_name' is not specified in metadata_"):
        _metadata_axis(nn, {}).init(jax.random.key(0), jnp.ones((2, 4)))


TREES = [
    {"a": P("batch", "embed"), "b": P("embed", "mlp"), "c": None, "d": (P("vocab", "embed"),)},
    {"kernel": P("embed", "mlp"), "stack": P("layers", "embed", "mlp")},
]
RULE_SETS = [
    (("batch", "data"), ("embed", "model"), ("mlp", "model")),     # 'model' is used once only
    (("batch", "data"), ("mlp", "model")),                          # 'embed' unassigned
    (("batch", ("data", "model")), ("embed", None), ("mlp", "data"), ("layers", None)),
    (),
]


@pytest.mark.parametrize("rules", RULE_SETS)
@pytest.mark.parametrize("tree", TREES)
def test_logical_to_mesh_and_sharding_equal_linen(tree, rules):
    mesh = jax.make_mesh((2, 1), ("data", "model"))
    assert nn.logical_to_mesh(tree, rules) == linen.logical_to_mesh(tree, rules)
    assert nn.logical_to_mesh_sharding(tree, mesh, rules) == linen.logical_to_mesh_sharding(tree, mesh, rules)
    with nn.logical_axis_rules(rules), linen.logical_axis_rules(rules):
        assert nn.logical_to_mesh(tree) == linen.logical_to_mesh(tree)
        assert nn.get_logical_axis_rules() == linen.get_logical_axis_rules() == rules


def test_logical_to_mesh_errors():
    with pytest.raises(errors.PartitioningError, match="occur more than once"):
        nn.logical_to_mesh({"a": P("embed", "embed")}, RULE_SETS[0])
    with pytest.raises(errors.PartitioningError, match="tuple or list"):
        nn.logical_to_mesh_axes(("embed",), "embed")


AUTO = (jax.sharding.AxisType.Auto,) * 2
CONSTRAINTS = [
    (("batch", "embed"), nn.spmd.RulesFallback.AXIS_IS_UNSHARDED),
    (("batch", "heads"), nn.spmd.RulesFallback.AXIS_IS_UNSHARDED),     # 'heads': no rule
    (("batch", "heads"), nn.spmd.RulesFallback.NO_CONSTRAINT),
    (("embed", None), nn.spmd.RulesFallback.RAISE_ERROR),
    (None, nn.spmd.RulesFallback.AXIS_IS_UNSHARDED),
]


@pytest.mark.parametrize("names, fallback", CONSTRAINTS)
def test_with_logical_constraint_shards_as_linen(names, fallback):
    mesh = jax.make_mesh((2, 1), ("data", "model"), axis_types=AUTO)
    rules = (("batch", "data"), ("embed", "data"))
    linen_fallback = linen.spmd.RulesFallback(fallback.value)

    def sharding(lib, fb, **kw):
        return jax.jit(lambda x: lib.with_logical_constraint(x * 2, names, fallback=fb, **kw))(
            jnp.ones((4, 2))).sharding

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules), linen.logical_axis_rules(rules):
        assert sharding(nn, fallback) == sharding(linen, linen_fallback)
    given = {"mesh": mesh, "rules": rules}
    assert sharding(nn, fallback, **given) == sharding(linen, linen_fallback, **given)
    np.testing.assert_array_equal(nn.with_logical_constraint(jnp.ones(2), names), 1.0)   # no rules, no mesh


def test_with_logical_constraint_raises_for_an_unplaced_axis():
    with pytest.raises(errors.PartitioningError, match=r"\['heads'\] have no mesh axis"):
        nn.with_logical_constraint(jnp.ones((4, 2)), ("batch", "heads"), rules=(("batch", "data"),),
                                   fallback=nn.spmd.RulesFallback.RAISE_ERROR)


def test_with_logical_constraint_in_a_module_equals_linen():
    mesh = jax.make_mesh((2, 1), ("data", "model"), axis_types=AUTO)

    def make(lib):
        class Block(lib.Module):
            @lib.compact
            def __call__(self, x):
                h = lib.Dense(4, kernel_init=lib.with_logical_partitioning(
                    lib.initializers.lecun_normal(), ("embed", "mlp")))(x)
                return lib.with_logical_constraint(h, ("batch", "mlp"))
        return Block()

    x = jnp.ones((4, 3))
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES), linen.logical_axis_rules(RULES):
        variables = make(nn).init(jax.random.key(0), x)
        ours = jax.jit(make(nn).apply)(variables, x)
        theirs = jax.jit(make(linen).apply)(jax.jit(make(linen).init)(jax.random.key(0), x), x)
    assert ours.sharding == theirs.sharding and ours.sharding.spec == P("data")
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_boxed_params_given_for_a_plain_initializer_and_shape_errors():
    """The type check ignores boxes both ways, and nothing else: a wrong shape still fails."""
    x = jnp.ones((2, 4))
    plain = nn.Dense(3)
    boxed = nn.Dense(3, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), ("a", "b")))
    variables = boxed.init(jax.random.key(0), x)
    np.testing.assert_allclose(plain.apply(variables, x), boxed.apply(variables, x))
    wrong = jax.tree.map(lambda v: jnp.ones((5, 3)) if v.shape == (4, 3) else v, variables)
    assert isinstance(wrong["params"]["kernel"], nn.Partitioned)
    with pytest.raises(errors.VariableShapeError, match="kernel has type Partitioned"):
        boxed.apply(wrong, x)
    with pytest.raises(errors.VariableShapeError, match="its shape differs"):
        plain.apply(nn.unbox(wrong), x)


def test_bound_module_reads_unboxed_values():
    model, x = _stats(nn, True)
    variables = model.init(jax.random.key(0), x)
    bound = model.bind(variables)
    assert not isinstance(bound.variable("stats", "total").value, nn.Partitioned)
    assert isinstance(bound.variable("stats", "total", unbox=False).value, nn.LogicallyPartitioned)
    dense = nn.Dense(3, kernel_init=nn.with_partitioning(nn.initializers.ones, ("a", "b")))
    bound = dense.bind(dense.init(jax.random.key(0), jnp.ones((1, 2))))
    assert bound.param("kernel", dense.kernel_init, (2, 3)).shape == (2, 3)
    assert isinstance(bound.param("kernel", dense.kernel_init, (2, 3), unbox=False), nn.Partitioned)


def test_param_unbox_false_returns_the_box():
    class Raw(nn.Module):
        @nn.compact
        def __call__(self, x):
            box = self.param("w", nn.with_partitioning(nn.initializers.ones, ("a",)), (2,), unbox=False)
            assert isinstance(box, nn.Partitioned) and box.names == ("a",)
            return x * box.value
    np.testing.assert_array_equal(Raw().apply(Raw().init(jax.random.key(0), jnp.ones(2)), jnp.ones(2)), 1.0)


def test_legacy_partitioning_module():
    assert nn.partitioning.with_sharding_constraint is nn.with_logical_constraint
    assert nn.partitioning.remat is nn.remat
    with nn.partitioning.axis_rules((("a", "x"),)):
        assert nn.partitioning.get_axis_rules() == (("a", "x"),)
        assert nn.partitioning.logical_to_mesh_axes(("a", "b")) == P("x", None)
    for use in (lambda: nn.partitioning.param_with_axes("w", nn.initializers.ones, (2,), axes=("a",)),
                lambda: nn.partitioning.variable_with_axes("stats", "w", jnp.zeros, (2,), axes=("a",)),
                lambda: nn.partitioning.get_axis_names({}),
                lambda: nn.partitioning.scan_with_axes(nn.Dense),
                lambda: nn.partitioning.vmap_with_axes(nn.Dense, {"params": 0}),
                lambda: nn.partitioning.AxisMetadata(("a",)),
                lambda: nn.partitioning.PartitionedVariable(None, "params", "w"),
                lambda: nn.partitioning.core_remat_static(None)):
        with pytest.raises(errors.NotProvidedError, match="is not provided by varjax.nn"):
            use()


def _tagged(lib):
    """A user's own box, as Linen's docs describe: an AxisMetadata subclass registered as a
    pytree whose one child is the value."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Tagged(lib.meta.AxisMetadata):
        value: object
        tags: tuple

        def unbox(self):
            return self.value

        def replace_boxed(self, val):
            return dataclasses.replace(self, value=val)

        def add_axis(self, index, params):
            return dataclasses.replace(self, tags=self.tags[:index] + ("new",) + self.tags[index:])

        def remove_axis(self, index, params):
            return dataclasses.replace(self, tags=self.tags[:index] + self.tags[index + 1:])

    jax.tree_util.register_dataclass(Tagged, data_fields=["value"], meta_fields=["tags"])

    class Model(lib.Module):
        @lib.compact
        def __call__(self, x):
            w = self.param("w", lambda k, s: Tagged(lib.initializers.normal(1.0)(k, s), ("in",)), (3,))
            return x * w[None]
    return Model()


def test_a_user_box_works_as_in_linen():
    x, key = jnp.ones((2, 3)), jax.random.key(0)
    ours, theirs = _tagged(nn), _tagged(linen)
    variables, linen_variables = ours.init(key, x), jax.jit(theirs.init)(key, x)
    box = variables["params"]["w"]
    assert type(box).__name__ == "Tagged" and box.tags == ("in",)
    np.testing.assert_array_equal(box.value, linen_variables["params"]["w"].value)
    assert nn.meta.add_axis(variables, 0, {})["params"]["w"].tags == ("new", "in")
    for given in (variables, nn.unbox(variables)):
        np.testing.assert_allclose(ours.apply(given, x), theirs.apply(linen_variables, x), rtol=1e-6)


def test_weight_norm_of_a_boxed_kernel_equals_linen():
    """Linen's WeightNorm names the scale of a boxed kernel after the box's value
    (``Dense_0/kernel/value/scale``).  (Linen's SpectralNorm fails on boxes; varjax's
    names its state the same way.)"""
    def make(lib):
        class Model(lib.Module):
            @lib.compact
            def __call__(self, x):
                init = lib.with_partitioning(lib.initializers.lecun_normal(), ("a", "b"))
                return lib.WeightNorm(lib.Dense(3, kernel_init=init))(x)
        return Model()
    x, key = jnp.ones((2, 4)), jax.random.key(0)
    variables, linen_variables = make(nn).init(key, x), jax.jit(make(linen).init)(key, x)
    _same_boxes(variables, linen_variables)
    assert "Dense_0/kernel/value/scale" in variables["params"]["WeightNorm_0"]
    np.testing.assert_allclose(make(nn).apply(variables, x), make(linen).apply(linen_variables, x), rtol=1e-6)


def test_flax_boxes_given_to_varjax_are_named_as_flax_boxes_in_the_error():
    def make(lib):
        return lib.Dense(2, kernel_init=lib.with_partitioning(lib.initializers.lecun_normal(), ("a", "b")))
    x = jnp.ones((1, 3))
    flax_variables = make(linen).init(jax.random.key(0), x)
    with pytest.raises(errors.VariableShapeError, match="flax.core.meta.Partitioned, not the expected "
                                                       "varjax.ir.axis_metadata.Partitioned"):
        make(nn).apply(flax_variables, x)
    np.testing.assert_array_equal(make(nn).apply(linen.unbox(flax_variables), x),
                                  make(linen).apply(flax_variables, x))
