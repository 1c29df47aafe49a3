"""``nn.meta``: boxed axis metadata under Linen's module path (Flax's ``flax.core.meta``).

A box (``Partitioned``) wraps a variable's value with the mesh axis each of its axes is
sharded over; ``with_partitioning(init, names)`` makes an initializer return one, so
``init`` returns boxed variables, ``get_partition_spec`` reads their ``PartitionSpec`` s
and ``unbox`` strips them.  The boxes and helpers are ``varjax.ir.axis_metadata``'s (the IR
layer, where variable types carry the names); this module adds Linen's initializer
wrapper and its names for the active mesh.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from varjax.ir.axis_metadata import PARTITION_NAME as PARTITION_NAME
from varjax.ir.axis_metadata import AxisMetadata as AxisMetadata
from varjax.ir.axis_metadata import LogicalNames as LogicalNames
from varjax.ir.axis_metadata import Partitioned as Partitioned
from varjax.ir.axis_metadata import add_axis as add_axis
from varjax.ir.axis_metadata import get_partition_spec as get_partition_spec
from varjax.ir.axis_metadata import get_sharding as get_sharding
from varjax.ir.axis_metadata import global_mesh
from varjax.ir.axis_metadata import is_axis_metadata as is_axis_metadata
from varjax.ir.axis_metadata import map_axis_meta as map_axis_meta
from varjax.ir.axis_metadata import remove_axis as remove_axis
from varjax.ir.axis_metadata import replace_boxed as replace_boxed
from varjax.ir.axis_metadata import unbox as unbox

__all__ = ["PARTITION_NAME", "AxisMetadata", "Partitioned", "add_axis", "get_global_mesh",
           "get_partition_spec", "get_sharding", "global_mesh_defined", "is_axis_metadata",
           "map_axis_meta", "remove_axis", "replace_boxed", "unbox", "with_partitioning"]


def get_global_mesh() -> jax.sharding.AbstractMesh | None:
    """The active mesh (``jax.set_mesh``), or None."""
    return global_mesh()


def global_mesh_defined() -> bool:
    """Whether a mesh is active."""
    return global_mesh() is not None


def with_partitioning(fn: Callable[..., Any], names: LogicalNames,
                      mesh: jax.sharding.Mesh | None = None) -> Callable[..., Partitioned[Any]]:
    """``fn`` (an initializer) with its result boxed in ``Partitioned(result, names, mesh)``:
    axis ``i`` of the variable is sharded over mesh axis ``names[i]`` (None: not sharded)."""
    @functools.wraps(fn)
    def boxed(*args: Any, **kwargs: Any) -> Partitioned[Any]:
        return Partitioned(fn(*args, **kwargs), names, mesh=mesh)
    return boxed
