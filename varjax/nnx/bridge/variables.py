"""How a variable crosses the bridge: a Linen collection entry <-> an NNX Variable.

Linen names a variable's kind by its collection, NNX by its Variable type; the registry of
``varjax.nnx.variablelib`` (``register_variable_name``) is the one link between the two,
so ``params`` is ``nnx.Param``, ``batch_stats`` ``nnx.BatchStat``, ``intermediates``
``nnx.Intermediate``, and an unknown collection gets a new Variable type of its name.
A Variable with metadata (a sharding) crosses into Linen as an ``NNXMeta`` box, so the
metadata survives the round trip; a plain one as its bare value, so Linen code that never
asked for boxes sees none.
"""
from __future__ import annotations

import dataclasses
import typing as tp

import jax

from varjax.ir import errors
from varjax.ir.axis_metadata import AxisMetadata, Partitioned
from varjax.ir.typing import PyTree
from varjax.nnx import spmd, traversals, variablelib

__all__ = ["NNXMeta", "to_linen_var", "to_nnx_var", "linen_vars_to_nnx_attrs",
           "nnx_attrs_to_linen_vars", "with_partitioning"]

A = tp.TypeVar("A")

# Metadata every NNX Variable may carry without it being "metadata" worth a box.
_PLAIN_METADATA = frozenset({"hijax", "ref", "eager_sharding"})
# A Linen box's field <-> the NNX metadata of the same meaning, as flax's boxes'
# ``to_nnx_metadata``/``from_nnx_metadata``: ``nn.Partitioned.names`` is a Variable's
# ``out_sharding``, ``nn.LogicallyPartitioned.rules`` its ``sharding_rules``.
_NNX_NAMES = {"names": "out_sharding", "rules": "sharding_rules"}
_LINEN_NAMES = {v: k for k, v in _NNX_NAMES.items()}


@dataclasses.dataclass(frozen=True)
class NNXMeta(AxisMetadata[A]):
    """An NNX Variable's value in a Linen collection, with its type and metadata kept, so
    ``ToLinen`` gives the same Variable back and ``nn.get_partition_spec`` reads its
    sharding."""

    var_type: type[variablelib.Variable]
    value: PyTree
    metadata: dict[str, tp.Any]

    def unbox(self) -> A:
        return self.value

    def replace_boxed(self, val: PyTree) -> NNXMeta[PyTree]:
        return dataclasses.replace(self, value=val)

    # NNX's metadata hooks for a new axis are not run through a Linen transform (as in
    # flax.nnx 0.12.8): the box is kept as it is.
    def add_axis(self, index: int, params: dict[tp.Any, tp.Any]) -> NNXMeta[A]:
        return self

    def remove_axis(self, index: int, params: dict[tp.Any, tp.Any]) -> NNXMeta[A]:
        return self

    def get_partition_spec(self) -> jax.sharding.PartitionSpec:
        return spmd.get_partition_spec(self.to_nnx_variable()).get_value()

    def to_nnx_variable(self) -> variablelib.Variable:
        return self.var_type(self.value, **self.metadata)


def _flatten(box: NNXMeta) -> tuple:
    return ((jax.tree_util.GetAttrKey("value"), box.value),), (
        box.var_type, tuple(sorted(box.metadata.items())))


jax.tree_util.register_pytree_with_keys(
    NNXMeta, _flatten, lambda aux, kids: NNXMeta(aux[0], kids[0], dict(aux[1])),
    lambda box: ((box.value,), (box.var_type, tuple(sorted(box.metadata.items())))))


def _is_plain(variable: variablelib.Variable) -> bool:
    return all(key in _PLAIN_METADATA or (key.endswith("_hooks") and value == ())
               for key, value in variable.get_metadata().items())


def to_linen_var(variable: variablelib.Variable) -> PyTree:
    """``variable``'s entry in a Linen collection: its value, the Linen box it came from
    (``linen_meta_type``, as ``to_nnx_var`` records it), or an ``NNXMeta`` box when it
    carries other metadata."""
    metadata = variable.get_metadata()
    if "linen_meta_type" in metadata:
        box = metadata["linen_meta_type"]
        fields = {f.name for f in dataclasses.fields(box)}
        given = {_LINEN_NAMES.get(k, k): v for k, v in metadata.items()}
        return box(variable.get_value(), **{k: v for k, v in given.items()
                                            if k in fields and k != "value"})
    if _is_plain(variable):
        return variable.get_value()
    return NNXMeta(type(variable), variable.get_value(), variable.get_metadata())


def to_nnx_var(collection: str, value: PyTree) -> variablelib.Variable:
    """The NNX Variable of a Linen collection entry: the type the collection names, its
    metadata from an ``NNXMeta`` box or from another box's fields."""
    typ = variablelib.variable_type_from_name(collection, allow_register=True)
    if isinstance(value, NNXMeta):
        return value.to_nnx_variable()
    if isinstance(value, AxisMetadata):
        fields = {_NNX_NAMES.get(f.name, f.name): getattr(value, f.name)
                  for f in dataclasses.fields(value)}
        inner = fields.pop("value")
        return typ(inner, **fields, linen_meta_type=type(value))
    return typ(value)


def with_partitioning(fn: tp.Callable[..., tp.Any], names: tp.Sequence[tp.Any],
                      mesh: jax.sharding.Mesh | None = None) -> tp.Callable[..., tp.Any]:
    """``nnx.with_partitioning`` whose Variable goes into Linen as an ``nn.Partitioned``
    box (not an ``NNXMeta``), for NNX code whose Linen callers read Linen's boxes."""
    return spmd.with_partitioning(fn, names, mesh, linen_meta_type=Partitioned)


def linen_vars_to_nnx_attrs(variables: tp.Mapping[str, tp.Any]) -> dict[str, tp.Any]:
    """Linen's ``{collection: {name: ...}}`` as NNX attributes ``{name: ...}`` of
    Variables: each leaf typed by its collection.  NNX has one namespace, so one name in two
    collections is refused."""
    flat: dict[tuple, variablelib.Variable] = {}
    for collection, tree in variables.items():
        for path, value in traversals.flatten_mapping(tree).items():
            if path in flat:
                raise errors.ConfigError(
                    f"the Linen module has a variable at {'/'.join(map(str, path))} in two "
                    f"collections ('{flat[path].collection}' and '{collection}'); an NNX "
                    "module has one attribute per name.", path=tuple(map(str, path)),
                    collection=collection, **errors.where(),
                    fix="give the variables of different collections different names")
            flat[path] = to_nnx_var(collection, value)
    return traversals.unflatten_mapping(flat)


def nnx_attrs_to_linen_vars(attrs: tp.Mapping[str, tp.Any]) -> dict[str, tp.Any]:
    """The inverse of ``linen_vars_to_nnx_attrs``: each Variable under its collection."""
    nested: dict[tuple, tp.Any] = {}
    for path, leaf in traversals.flatten_mapping(attrs).items():
        if not isinstance(leaf, variablelib.Variable):
            raise errors.ConfigError(
                f"ToNNX attribute {'/'.join(map(str, path))} holds a "
                f"{type(leaf).__name__}, not an nnx.Variable, so it has no Linen collection.",
                path=tuple(map(str, path)), **errors.where(),
                fix="hold the wrapped Linen module's variables as nnx.Variables")
        nested[(variablelib.variable_name_from_type(type(leaf)), *path)] = to_linen_var(leaf)
    return traversals.unflatten_mapping(nested)
