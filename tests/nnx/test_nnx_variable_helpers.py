"""NNX's Variable helpers (``var_defaults``, ``with_metadata``/``VariableMetadata``,
``get_metadata``/``set_metadata``, ``register_variable_name``) and the registry of
Variable types, against flax.nnx 0.12.8."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as fnnx

import varjax as vj
from varjax import errors, nnx
from varjax.nnx.variablelib import (
    VariableMetadata,
    register_variable_name,
    var_defaults,
    with_metadata,
)
from varjax.trace.variable import collection_of

_REQUIRED = ("hijax", "ref", "eager_sharding")   # flax.nnx's metadata every Variable has


def _flax_metadata(v):
    return {k: w for k, w in v.get_metadata().items() if k not in _REQUIRED}


def _classes(source, *modules):
    """The class ``source`` defines, once per module name: same-named classes of two
    modules, as two test files or two packages define them."""
    made = []
    for module in modules:
        ns = {"__name__": module, "nnx": nnx, "fnnx": fnnx}
        exec(source, ns)
        made.append(ns)
    return made


# --- var_defaults ----------------------------------------------------------------------

def test_var_defaults_are_flax_nnx_defaults():
    assert dict(var_defaults()) == dict(fnnx.var_defaults())
    assert var_defaults().hijax is False and var_defaults()["ref"] is False


def test_var_defaults_false_is_a_with_block_and_a_decorator():
    with var_defaults(hijax=False, ref=False):
        v = nnx.Param(jnp.ones(2))

    @var_defaults(ref=False)
    def make():
        return nnx.Param(jnp.zeros(2))
    assert type(v) is nnx.Param and type(make()) is nnx.Param
    assert dict(var_defaults()) == dict(fnnx.var_defaults())


@pytest.mark.parametrize("mode", ["hijax", "ref"])
def test_var_defaults_or_a_variable_asking_for_hijax_or_ref_raises_not_provided(mode):
    with pytest.raises(errors.NotProvidedError, match=f"{mode}=True") as e:
        var_defaults(**{mode: True})
    assert "test_nnx_variable_helpers.py" in str(e.value)
    with pytest.raises(errors.NotProvidedError, match=f"nnx.Param\\({mode}=True\\)"):
        nnx.Param(jnp.ones(2), **{mode: True})
    assert nnx.Param(jnp.ones(2), **{mode: False}).get_metadata() == {}


# --- with_metadata / VariableMetadata ---------------------------------------------------

def test_with_metadata_carries_its_metadata_into_a_layers_param_as_flax_nnx():
    ours = nnx.Linear(2, 3, kernel_init=with_metadata(nnx.initializers.lecun_normal(), tag="k",
                                                      frozen=True), rngs=nnx.Rngs(0))
    theirs = fnnx.Linear(2, 3, kernel_init=fnnx.with_metadata(
        fnnx.initializers.lecun_normal(), tag="k", frozen=True), rngs=fnnx.Rngs(0))
    assert ours.kernel.get_metadata() == _flax_metadata(theirs.kernel) == {"tag": "k",
                                                                            "frozen": True}
    assert ours.kernel.tag == "k" and ours.bias.get_metadata() == {}
    np.testing.assert_array_equal(ours.kernel[...], theirs.kernel[...])


def test_a_variable_made_from_variable_metadata_takes_its_value_and_metadata_first():
    ours = nnx.Param(VariableMetadata(jnp.ones(2), metadata={"a": 1, "b": 2}), b=3, c=4)
    theirs = fnnx.Param(fnnx.VariableMetadata(jnp.ones(2), metadata={"a": 1, "b": 2}), b=3, c=4)
    assert ours.get_metadata() == _flax_metadata(theirs) == {"a": 1, "b": 2, "c": 4}
    np.testing.assert_array_equal(ours[...], theirs[...])


def test_with_metadata_hooks_raise_not_provided():
    with pytest.raises(errors.NotProvidedError, match="on_get_value"):
        with_metadata(nnx.initializers.zeros, on_get_value=lambda v, x: x)
    with pytest.raises(errors.NotProvidedError, match="on_set_value"):
        nnx.Param(VariableMetadata(jnp.ones(2), on_set_value=(lambda v, x: x,)))


# --- get_metadata / set_metadata ----------------------------------------------------------

def test_get_metadata_by_name_and_set_metadata_three_forms_as_flax_nnx():
    ours, theirs = nnx.Param(jnp.ones(2), a=1), fnnx.Param(jnp.ones(2), a=1)
    for v in (ours, theirs):
        v.set_metadata("b", 2)
        v.set_metadata(c=3)
    assert ours.get_metadata() == _flax_metadata(theirs) == {"a": 1, "b": 2, "c": 3}
    assert ours.get_metadata("b") == theirs.get_metadata("b") == 2
    assert ours.get_metadata("zz", 7) == theirs.get_metadata("zz", 7) == 7
    with pytest.raises(KeyError):
        ours.get_metadata("zz")
    ours.set_metadata({"only": 1})
    theirs.set_metadata({"only": 1})
    assert ours.get_metadata() == _flax_metadata(theirs) == {"only": 1}
    with pytest.raises(TypeError, match="set_metadata"):
        ours.set_metadata("a", 1, b=2)


# --- register_variable_name -------------------------------------------------------------

def test_register_variable_name_makes_the_name_the_types_collection_as_flax_nnx():
    @register_variable_name("h4_counts")
    class Counts(nnx.Variable):
        pass

    @fnnx.register_variable_name("h4_counts")
    class FCounts(fnnx.Variable):
        pass
    assert nnx.variable_name_from_type(Counts) == fnnx.variable_name_from_type(FCounts) == "h4_counts"
    assert nnx.variable_type_from_name("h4_counts") is Counts
    assert fnnx.variable_type_from_name("h4_counts") is FCounts
    assert Counts(jnp.zeros(())).collection == "h4_counts"
    with pytest.raises(errors.InvalidVariablesError):     # its class name is free again
        nnx.variable_type_from_name("Counts")
    assert register_variable_name("h4_counts", Counts) is Counts       # again: no change


def test_register_variable_name_refuses_a_taken_name_unless_overwrite():
    class Older(nnx.Variable):
        pass

    class Newer(nnx.Variable):
        pass
    register_variable_name("h4_taken", Older)
    with pytest.raises(errors.InvalidVariablesError, match="'h4_taken' is already the "
                       "collection of .*Older") as e:
        register_variable_name("h4_taken", Newer)
    assert e.value.collection == "h4_taken" and "test_nnx_variable_helpers.py" in str(e.value)
    with pytest.raises(ValueError, match="already mapped"):    # flax.nnx refuses too
        fnnx.register_variable_name("params", fnnx.Variable)
    register_variable_name("h4_taken", Newer, overwrite=True)
    assert collection_of(Newer) == "h4_taken" and Newer(1.0).collection == "h4_taken"
    assert collection_of(Older) == f"{Older.__qualname__}@{__name__}"    # its qualified name
    assert nnx.variable_type_from_name(collection_of(Older)) is Older


def test_register_variable_name_of_a_non_variable_raises():
    with pytest.raises(errors.InvalidVariablesError, match="is not a Variable subclass"):
        register_variable_name("h4_bad", int)


# --- the registry: same-named Variable classes ------------------------------------------

_COUNT = """
class Count(nnx.Variable):
    pass

class FCount(fnnx.Variable):
    pass
"""


def test_two_same_named_variable_classes_of_two_modules_are_two_types():
    one, two = _classes(_COUNT, "h4_pkg.one", "h4_pkg.two")
    A, B = one["Count"], two["Count"]
    assert collection_of(A) in ("Count", "Count@h4_pkg.one")    # the first keeps 'Count'
    assert collection_of(B) == "Count@h4_pkg.two" != collection_of(A)
    assert nnx.variable_type_from_name("Count@h4_pkg.two") is B

    def model(lib, a, b):
        class Model(lib.Module):
            def __init__(self):
                self.a, self.b = a(jnp.zeros(())), b(jnp.ones(()))
        return Model()
    ours, theirs = model(nnx, A, B), model(fnnx, one["FCount"], two["FCount"])
    assert nnx.to_pure_dict(nnx.state(ours, A)) == {"a": 0.0}
    assert nnx.to_pure_dict(nnx.state(ours, B)) == {"b": 1.0}
    assert fnnx.to_pure_dict(fnnx.state(theirs, one["FCount"])) == {"a": 0.0}
    g, sa, sb = nnx.split(ours, A, B)
    back = nnx.merge(g, sa, sb)
    assert type(back.a) is A and type(back.b) is B


def test_same_named_variable_classes_update_apart_under_a_transform():
    one, two = _classes(_COUNT, "h4_jit.one", "h4_jit.two")
    A, B = one["Count"], two["Count"]

    class Model(nnx.Module):
        def __init__(self):
            self.a, self.b = A(jnp.zeros(())), B(jnp.zeros(()))
    m = Model()

    @vj.jit
    def step(m):
        m.a[...] += 1
        m.b[...] += 2
    step(m)
    assert float(m.a[...]) == 1.0 and float(m.b[...]) == 2.0
    assert type(m.a) is A and type(m.b) is B
    assert sorted(vj.state(m)) == sorted({collection_of(A), collection_of(B)})


def test_a_user_class_named_like_a_builtin_variable_type_does_not_collide():
    (ns,) = _classes("class OptState(nnx.Variable):\n    pass\n", "h4_user")
    assert collection_of(ns["OptState"]) == "OptState@h4_user"
    assert collection_of(nnx.OptState) == "OptState"
    assert nnx.variable_type_from_name("OptState") is nnx.OptState


def test_a_same_named_class_defined_again_in_its_module_takes_its_place():
    first, again = _classes(_COUNT, "h4_cell.two", "h4_cell.two")
    (other,) = _classes(_COUNT, "h4_cell.one")
    assert collection_of(again["Count"]) == collection_of(first["Count"])
    assert nnx.variable_type_from_name(collection_of(again["Count"])) is again["Count"]
    assert collection_of(other["Count"]) != collection_of(again["Count"])


def test_explicit_collection_claims_still_collide():
    with pytest.raises(errors.InvalidVariablesError, match="already the collection of"):
        class Mine(nnx.Variable, collection="params"):
            pass
    assert collection_of(nnx.Param) == "params"


def test_variable_types_take_a_value_type_in_annotations_as_flax_nnx():
    import typing

    import jax

    def step(w: nnx.Variable[jax.Array]) -> nnx.Param[jax.Array]:
        return w
    hints = typing.get_type_hints(step)
    assert typing.get_origin(hints["w"]) is nnx.Variable
    assert typing.get_origin(hints["return"]) is nnx.Param
    assert typing.get_args(hints["return"]) == typing.get_args(fnnx.Param[jax.Array])
    assert type(nnx.Param(jnp.ones(2))) is nnx.Param


def test_sharding_names_is_out_sharding_under_its_deprecated_name_as_flax_nnx():
    with pytest.warns(DeprecationWarning, match="'sharding_names' is deprecated") as record:
        made = nnx.Param(jnp.ones(2), sharding_names=("a",))
    assert record[0].filename == __file__
    assert made.get_metadata("out_sharding") == ("a",) and not made.has_metadata("sharding_names")
    later = nnx.Param(jnp.ones(2))
    with pytest.warns(DeprecationWarning, match="'sharding' is deprecated"):
        later.set_metadata("sharding", ("b",))
    assert later.get_metadata("out_sharding") == ("b",)
    with pytest.warns(DeprecationWarning):
        assert made.sharding_names == ("a",)


def test_item_writes_keep_the_value_kind_shape_and_dtype_as_flax_nnx():
    import warnings

    import jax

    def run(lib):
        with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
            warnings.simplefilter("ignore")     # JAX warns of the float32 -> bfloat16 cast
            stat = lib.BatchStat(jnp.ones((2,), jnp.bfloat16))
            stat[...] = jnp.zeros((2,), jnp.float32) + 0.3
        param = lib.Param(jnp.ones((2,)))
        param[...] = 5.0
        param[0] = 1.0
        mapping, items, host = lib.Variable({"a": 1}), lib.Variable([1, 2]), lib.Variable(np.ones(2))
        mapping["a"], items[0], host[...] = 2, 5, 3.0
        return (str(stat.get_value().dtype), param.get_value().tolist(), mapping.get_value(),
                items.get_value(), type(host.get_value()).__name__, host.get_value().tolist())
    assert run(nnx) == run(fnnx) == ("bfloat16", [1.0, 5.0], {"a": 2}, [5, 2], "ndarray",
                                     [3.0, 3.0])
