"""NNX's sharding helpers: ``with_partitioning``, ``get_partition_spec``,
``get_named_sharding``, ``logical_axis_rules``.

A Variable says how it is sharded in its ``out_sharding`` metadata: one mesh axis name (or
logical name, or None) per array axis.  These helpers read that metadata into JAX's
``PartitionSpec``/``NamedSharding`` trees, as flax.nnx's do, to place a model's state
(``jax.jit(..., out_shardings=...)``, ``jax.device_put``).  Logical names go through the
rules ``logical_axis_rules`` sets, the one rule context varjax has (Linen's ``nn`` reads
it too), and a Variable's own ``sharding_rules`` metadata; as in flax.nnx, a name no rule
maps stays as it is (Linen's ``logical_to_mesh_axes`` drops it).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar, Union

import jax
from jax.sharding import NamedSharding, PartitionSpec

from varjax.ir import errors
from varjax.ir.axis_metadata import PARTITION_NAME, get_logical_axis_rules, logical_axis_rules
from varjax.nnx.variablelib import with_metadata
from varjax.trace.variable import Variable, held

__all__ = ["PARTITION_NAME", "logical_axis_rules", "with_partitioning", "get_partition_spec",
           "get_named_sharding", "Initializer"]

A = TypeVar("A")
F = TypeVar("F", bound=Callable[..., Any])
Initializer = Union[jax.nn.initializers.Initializer, Callable[..., Any]]


def with_partitioning(initializer: F, sharding: Sequence[str | tuple[str, ...] | None],
                      mesh: jax.sharding.Mesh | None = None,
                      **metadata: Any) -> F:
    """``initializer`` whose Variable carries ``out_sharding=sharding`` (and ``mesh``)."""
    return with_metadata(initializer, out_sharding=sharding, mesh=mesh, **metadata)


def _rules(variable: Variable) -> dict[Any, Any]:
    """The active rules and the Variable's own, as one mapping; the two may not map one
    logical name to two mesh axes."""
    merged = dict(get_logical_axis_rules())
    for alias, mesh_axes in variable.get_metadata().get("sharding_rules", ()):
        if alias in merged and merged[alias] != mesh_axes:
            raise errors.PartitioningError(
                f"logical axis '{alias}' of a {type(variable).__name__} of collection "
                f"'{variable.collection}' maps to {merged[alias]!r} in logical_axis_rules and "
                f"to {mesh_axes!r} in its sharding_rules.", collection=variable.collection,
                **errors.where(), fix="map each logical name to one mesh axis")
        merged[alias] = mesh_axes
    return merged


def _spec(variable: Variable) -> PartitionSpec | None:
    names = variable.get_metadata().get("out_sharding")
    if names:
        rules = _rules(variable)
        return PartitionSpec(*(rules.get(n, n) if isinstance(n, str) else n for n in names))
    return PartitionSpec() if hasattr(variable.value, "shape") else None


def get_partition_spec(tree: A) -> A:
    """``tree`` with each Variable's value replaced by its ``PartitionSpec`` (a Variable
    of the same type and metadata holds it), each array by ``PartitionSpec()`` and
    anything else by None."""
    def spec(x: Any) -> Any:
        if isinstance(x, Variable):
            return held(type(x), x.collection, _spec(x), x.get_metadata())
        return PartitionSpec() if hasattr(x, "shape") else None
    return jax.tree.map(spec, tree, is_leaf=lambda x: isinstance(x, Variable))


def get_named_sharding(tree: A, mesh: jax.sharding.Mesh) -> A:
    """``get_partition_spec(tree)`` with each spec a ``NamedSharding`` on ``mesh``."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), get_partition_spec(tree))
