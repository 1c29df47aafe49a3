"""``nn.spmd``: logical axis names, Linen's ``flax.linen.spmd``.

A model names its axes by meaning (``'batch'``, ``'embed'``, ``'mlp'``) and a rule table,
set with ``logical_axis_rules``, maps those names to mesh axes; the same model then runs
on any mesh by swapping the table.  ``with_logical_partitioning`` boxes an initializer's
result in ``LogicallyPartitioned``; ``logical_to_mesh`` / ``logical_to_mesh_sharding``
turn trees of logical ``PartitionSpec`` s into mesh ones; ``with_logical_constraint``
constrains an activation by logical names.  The resolution itself (``logical_to_mesh_axes``)
and the rule state are ``varjax.ir.axis_metadata``'s, shared with the IR passes.

Sharp edges:
  * Outside a mesh (``jax.set_mesh``) and without ``mesh=``, ``with_logical_constraint``
    is a no-op, and without rules it is one too, as in Linen.
  * varjax caches traces: a constraint placed while tracing reflects the rules and mesh
    active then.
"""
from __future__ import annotations

import enum
import functools
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from varjax.ir import axis_metadata as am
from varjax.ir import errors
from varjax.ir.axis_metadata import LogicallyPartitioned as LogicallyPartitioned
from varjax.ir.axis_metadata import LogicalNames, LogicalRules
from varjax.ir.axis_metadata import get_logical_axis_rules as get_logical_axis_rules
from varjax.ir.axis_metadata import logical_to_mesh_axes as logical_to_mesh_axes
from varjax.ir.typing import PyTree, ShardingLike
from varjax.nn.typing import LogicalPartitionSpecPytree

__all__ = ["LogicallyPartitioned", "RulesFallback", "get_logical_axis_rules", "logical_to_mesh",
           "logical_to_mesh_axes", "logical_to_mesh_sharding", "with_logical_constraint",
           "with_logical_partitioning"]


def logical_to_mesh(tree: LogicalPartitionSpecPytree,
                    rules: LogicalRules | None = None) -> ShardingLike:
    """Each logical ``PartitionSpec`` in ``tree`` resolved to mesh axes (``logical_to_mesh_axes``)."""
    return jax.tree.map(lambda x: logical_to_mesh_axes(x, rules), tree,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def logical_to_mesh_sharding(tree: LogicalPartitionSpecPytree, mesh: jax.sharding.Mesh,
                             rules: LogicalRules | None = None) -> ShardingLike:
    """Each logical ``PartitionSpec`` in ``tree`` as a ``NamedSharding`` on ``mesh``."""
    return jax.tree.map(lambda x: NamedSharding(mesh, x), logical_to_mesh(tree, rules),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


class RulesFallback(enum.Enum):
    """What ``with_logical_constraint`` does with a logical axis no rule places."""

    AXIS_IS_UNSHARDED = "axis_is_unsharded"
    RAISE_ERROR = "raise_error"
    NO_CONSTRAINT = "no_constraint"


def _constrain(x: Any, spec: PartitionSpec | None, mesh: jax.sharding.Mesh | None) -> Any:
    if mesh is None and am.global_mesh() is None:
        return x
    if mesh is not None and spec is not None:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(x, spec)


def _constrain_logical(names: Any, x: Any, fallback: RulesFallback, rules: LogicalRules,
                       mesh: jax.sharding.Mesh | None) -> Any:
    axes = am.assign_mesh_axes(names, rules)
    if axes is None:
        return _constrain(x, None, mesh)
    if fallback == RulesFallback.AXIS_IS_UNSHARDED:
        axes = [None if a is am.UNASSIGNED else a for a in axes]
    elif any(a is am.UNASSIGNED for a in axes):
        if fallback == RulesFallback.RAISE_ERROR:
            raise errors.PartitioningError(
                f"logical axis names {names} did not match a rule: "
                f"{[n for n, a in zip(names, axes) if a is am.UNASSIGNED]} have no mesh axis "
                f"under rules {tuple(rules)}.", **errors.where(),
                fix="add a rule for each of these names (('name', None) for an unsharded "
                    "axis), or pass fallback=RulesFallback.AXIS_IS_UNSHARDED")
        return x
    return _constrain(x, PartitionSpec(*axes), mesh)


def _is_logical_spec(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and all(
        isinstance(e, str) or e is PartitionSpec.UNCONSTRAINED or e is None for e in x))


def with_logical_constraint(x: PyTree, logical_axis_resources: LogicalPartitionSpecPytree,
                            rules: LogicalRules | None = None,
                            mesh: jax.sharding.Mesh | None = None,
                            fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED) -> PyTree:
    """``jax.lax.with_sharding_constraint`` by logical names: each leaf of
    ``logical_axis_resources`` (a tuple of names, or a ``PartitionSpec``) is resolved
    under ``rules`` (the active ones if None) and constrains the matching part of ``x``.
    A no-op without rules, or outside a mesh when ``mesh`` is None."""
    rules = get_logical_axis_rules() if rules is None else rules
    if not rules or logical_axis_resources is None:
        return x
    constrain = functools.partial(_constrain_logical, fallback=fallback, rules=rules, mesh=mesh)
    return jax.tree.map(constrain, logical_axis_resources, x, is_leaf=_is_logical_spec)


def with_logical_partitioning(fn: Callable[..., Any], names: LogicalNames,
                              mesh: jax.sharding.Mesh | None = None,
                              rules: LogicalRules | None = None) -> Callable[..., LogicallyPartitioned]:
    """``fn`` (an initializer) with its result boxed in
    ``LogicallyPartitioned(result, names, mesh, rules)``: axis ``i`` has logical name
    ``names[i]``, placed on the mesh by ``rules`` or the active ones."""
    @functools.wraps(fn)
    def boxed(*args: Any, **kwargs: Any) -> LogicallyPartitioned:
        return LogicallyPartitioned(fn(*args, **kwargs), names, mesh=mesh, rules=rules)
    return boxed
