"""What makes an NNX object's attribute data or static, beyond its value's type:
``nnx.Data``/``nnx.Static`` annotations, ``nnx.dataclass`` fields marked ``nnx.data()``/
``nnx.static()``, ``register_data_type``; and ``is_data``/``has_data``/``check_pytree``,
against flax.nnx."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx import pytree as ours_lib


def _paths(tree):
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.parametrize("lib, mod", [(nnx, ours_lib), (flax_nnx, flax_nnx)])
def test_dataclass_fields_marked_data_are_children_the_rest_static_as_flax_nnx(lib, mod):
    @mod.dataclass
    class Point(lib.Pytree):
        name: str
        xy: jax.Array = mod.data(default=None)
        tag: str = mod.static(default="p")
        extra: list = mod.data(default_factory=list)
    p = Point("a", jnp.ones(2), extra=[jnp.zeros(1)])
    assert _paths(p) == [".extra[0]", ".xy"] and p == Point("a", p.xy, extra=p.extra)
    assert jax.tree.map(lambda a: a + 1, p).tag == "p"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")    # flax.nnx deprecates them
@pytest.mark.parametrize("lib, mod", [(nnx, ours_lib), (flax_nnx, flax_nnx)])
def test_data_and_static_annotations_fix_an_attributes_kind_as_flax_nnx(lib, mod):

    class Holder(lib.Pytree):
        count: mod.Data[int]
        table: mod.Static[jax.Array]

        def __init__(self, table):
            self.count = 3
            self.table = table
    assert jax.tree.leaves(Holder(2)) == [3]
    with pytest.raises(ValueError, match="table"):
        Holder(jnp.ones(1))


def test_a_static_annotated_attribute_holding_data_is_a_static_data_error():
    class Holder(nnx.Pytree):
        table: ours_lib.Static[jax.Array]

        def __init__(self):
            self.table = jnp.ones(1)
    with pytest.raises(errors.StaticDataError, match="'table'"):
        Holder()
    with pytest.raises(errors.StaticDataError, match="'rows'"):
        nnx.Pytree().rows = ours_lib.static([jnp.ones(1)])
    with pytest.raises(errors.ConfigError, match="not both"):
        ours_lib.data(1, default=2)


@pytest.mark.parametrize("lib, mod", [(nnx, ours_lib), (flax_nnx, flax_nnx)])
def test_a_registered_data_type_is_data_on_assignment_as_flax_nnx(lib, mod):
    @mod.register_data_type
    @dataclasses.dataclass(frozen=True)
    class Tokens:
        ids: int

    class Holder(lib.Pytree):
        def __init__(self):
            self.tokens = Tokens(1)
            self.name = "h"
    assert jax.tree.leaves(Holder()) == [Tokens(1)]
    assert mod.is_data(Tokens(2)) and mod.is_data(jnp.ones(1)) and mod.is_data(lib.Param(1.0))
    assert not mod.is_data([jnp.ones(1)]) and not mod.is_data("x")
    found = mod.has_data([jnp.ones(1), 3, lib.Param(1.0), {"t": Tokens(3)}])
    assert [type(x).__name__ for x in found] == ["ArrayImpl", "Param", "Tokens"]


@pytest.mark.parametrize("lib, mod", [(nnx, ours_lib), (flax_nnx, flax_nnx)])
def test_check_pytree_finds_data_put_in_a_static_attribute_behind_setattr(lib, mod):
    class Holder(lib.Pytree):
        def __init__(self):
            self.name = "h"
    h = Holder()
    mod.check_pytree(h)
    object.__setattr__(h, "name", [jnp.ones(1)]) if lib is flax_nnx else h.__dict__.update(name=[jnp.ones(1)])
    with pytest.raises(ValueError, match="name"):
        mod.check_pytree(h)
    with pytest.raises(TypeError):
        mod.check_pytree(3)
