"""``nn.partitioning``: Linen's legacy partitioning module (``flax.linen.partitioning``).

Linen keeps this older API beside ``nn.spmd`` for code written before boxed metadata.
Its rule helpers work here under their legacy names: ``axis_rules``, ``get_axis_rules``,
``set_axis_rules``, ``logical_to_mesh_axes``, ``logical_to_mesh``, ``RulesFallback`` and
``with_sharding_constraint`` (Linen's ``with_logical_constraint``), and ``remat`` is
``nn.remat`` (which takes ``static_argnums``, the reason Linen has its own).

The rest records axis names by sowing a leafless ``partitioning.AxisMetadata`` (names
only, no arrays) into ``params_axes``-style collections: ``param_with_axes``,
``variable_with_axes``, ``PartitionedVariable``, ``get_axis_names``, ``scan_with_axes``,
``vmap_with_axes``.  A varjax variable holds arrays -- it is an input or output of the
IR -- so a variable without leaves cannot be stored, and ``apply`` would refuse the
variables ``init`` returned.  Those names raise ``NotProvidedError`` where used, as does
``core_remat_static``, a lift for ``flax.core`` scope functions.  Boxed metadata does the
same job: ``nn.with_logical_partitioning`` on the initializer and
``nn.get_partition_spec`` on the variables.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NoReturn

# Registers the boxes with flax.serialization once the user imports it (see its docstring).
import varjax.nn.serialization  # noqa: F401
from varjax.ir.axis_metadata import get_logical_axis_rules as get_axis_rules
from varjax.ir.axis_metadata import logical_axis_rules as axis_rules
from varjax.ir.axis_metadata import logical_to_mesh_axes as logical_to_mesh_axes
from varjax.ir.axis_metadata import set_logical_axis_rules as set_axis_rules
from varjax.ir.typing import Target
from varjax.nn.module import Module
from varjax.nn.spmd import RulesFallback as RulesFallback
from varjax.nn.spmd import logical_to_mesh as logical_to_mesh
from varjax.nn.spmd import with_logical_constraint as with_sharding_constraint
from varjax.trace.unprovided import not_provided, unprovided_class
from varjax.transforms import remat as remat

__all__ = ["AxisMetadata", "PartitionedVariable", "RulesFallback", "axis_rules", "core_remat_static",
           "get_axis_names", "get_axis_rules", "logical_to_mesh", "logical_to_mesh_axes",
           "param_with_axes", "remat", "scan_with_axes", "set_axis_rules", "variable_with_axes",
           "vmap_with_axes", "with_sharding_constraint"]

_WHY = ("Linen's legacy partitioning API sows axis names as leafless AxisMetadata variables "
        "('params_axes'), and a varjax variable must hold arrays.")
_FIX = ("box the initializer instead: nn.with_logical_partitioning(init, ('embed', 'mlp')), then "
        "nn.get_partition_spec(variables) and nn.logical_to_mesh(...)")

AxisMetadata = unprovided_class("AxisMetadata", _WHY, _FIX, __name__)
PartitionedVariable = unprovided_class("PartitionedVariable", _WHY, _FIX, __name__)


def param_with_axes(name: str, init_fn: Callable[..., Any], *init_args: Any,
                    axes: tuple[str, ...] | None = None, module: Module | None = None,
                    **init_kwargs: Any) -> NoReturn:
    """Not provided (see the module docstring); raises ``NotProvidedError``."""
    not_provided("nn.partitioning.param_with_axes", _WHY, _FIX, by="varjax.nn")


def variable_with_axes(collection: str, name: str, init_fn: Callable[..., Any], *init_args: Any,
                       axes: tuple[str, ...] | None = None, module: Module | None = None,
                       fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED,
                       **init_kwargs: Any) -> NoReturn:
    """Not provided (see the module docstring); raises ``NotProvidedError``."""
    not_provided("nn.partitioning.variable_with_axes", _WHY, _FIX, by="varjax.nn")


def get_axis_names(axes_metadata: Mapping[str, Any]) -> NoReturn:
    """Not provided (see the module docstring); raises ``NotProvidedError``."""
    not_provided("nn.partitioning.get_axis_names", _WHY, _FIX, by="varjax.nn")


def scan_with_axes(target: Target, *args: Any, **kwargs: Any) -> NoReturn:
    """Not provided (see the module docstring); raises ``NotProvidedError``."""
    not_provided("nn.partitioning.scan_with_axes", _WHY,
                 "nn.scan(..., metadata_params={nn.PARTITION_NAME: 'layers'}) over boxed variables",
                 by="varjax.nn")


def vmap_with_axes(target: Target, *args: Any, **kwargs: Any) -> NoReturn:
    """Not provided (see the module docstring); raises ``NotProvidedError``."""
    not_provided("nn.partitioning.vmap_with_axes", _WHY,
                 "nn.vmap(..., metadata_params={nn.PARTITION_NAME: 'name'}) over boxed variables",
                 by="varjax.nn")


def core_remat_static(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NoReturn:
    """Not provided: a lift of ``flax.core`` scope functions, which varjax does not have."""
    not_provided("nn.partitioning.core_remat_static",
                 "it lifts flax.core functions of a Scope; varjax.nn has no flax.core layer.",
                 "use nn.partitioning.remat (nn.remat), which takes static_argnums", by="varjax.nn")
