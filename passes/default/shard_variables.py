"""shard-variables: sharding constraints on the reads and writes of annotated variables.

A variable initialised through ``nn.with_partitioning`` / ``nn.with_logical_partitioning``
holds a box (``varjax.ir.axis_metadata``), and a variable's treedef is a parameter of its
``var_get``/``var_set`` equations, so its partition names are *in the IR*: every
equation touching the variable carries them (``vj.pretty`` prints them,
``var_get[params:Dense_0/kernel ('embed', 'mlp')]``).  This pass reads them there and
constrains the value of each annotated read (right after the ``var_get``) and of each
annotated write (right before the ``var_set``) with ``with_sharding_constraint``, under
the mesh active while the function is traced (``jax.set_mesh``) and the active logical
axis rules (``nn.logical_axis_rules``), or the box's own ``mesh``/``rules``.  After
``discharge`` reads are inputs and writes outputs, so XLA sees sharded parameters,
batch statistics and caches without the user threading a ``PartitionSpec`` anywhere.

An object-mode ``vj.Variable(value, out_sharding=('data', None))`` (or a subclass) rides the
same way: the call gives its value to the trace in a ``Partitioned`` box of those mesh axes
(``varjax.trace.variable.boxed``), and a Variable made inside the call is stored in one, so
this pass places arguments and a sharded init (``vj.jit(make_model)()``) alike.  On a mesh of
Explicit axes (``jax.make_mesh``'s default) a Variable made inside the call is placed with
``jax.sharding.reshard``, as flax.nnx places a new Variable; elsewhere the constraint of an
Explicit axis is JAX's assert.

Linen applies the same constraint when a module unboxes a parameter (``param(...,
unbox=True)``); varjax's modules unbox without it and leave the job to this pass, so a
box read but never unboxed, a box written (a cache, batch statistics) and an
object-mode variable are constrained alike, and the constraints can be seen, dumped and
switched off (``vj.functionalize(..., passes=...)`` cannot drop a default pass, but with
no mesh active and no box carrying a mesh the pass changes nothing).

A name that is no axis of the mesh is a logical name, as an ``nnx`` Variable's
``out_sharding`` may hold (``nnx.with_partitioning(init, ('embed', None))``): it is read
through the active logical axis rules, as flax.nnx reads it when it shards the Variable
(``axis_metadata.through_rules``), and a name no rule maps is a ``PartitioningError``
naming the variable (flax.nnx and Linen raise JAX's ``ValueError`` there).

Sharp edges:
  * A name that is a mesh axis is kept even where a rule maps it (flax.nnx would map it):
    the box cannot tell an NNX Variable's names from a Linen ``Partitioned``'s mesh axes.
    A Variable's own ``sharding_rules`` and ``mesh`` metadata are not in its box: only
    the active rules and mesh are read.
  * The mesh and rules are read when the function is traced; ``vj.functionalize`` keys
    its trace cache on them, a raw ``jax.jit`` around ``apply`` keys on the mesh only
    (as with Linen, changing the rules under a live ``jax.jit`` cache needs a new jit).
  * A body a lifted transform runs directly (``notes/lifting.md``) reads its variables
    from a dictionary, not through ``var_get``: its values are constrained where the
    transform reads them, in the enclosing trace, with the enclosing names (a stacked
    kernel under ``nn.scan`` with ``metadata_params``: ``('layers', 'embed', 'mlp')``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from varjax import _jax
from varjax.ir import axis_metadata, errors
from varjax.ir.primitives import var_get_p, var_set_p
from varjax.passes.framework.base import Pass, PassContext
from varjax.passes.framework.rewrite import Region, Rewriter, Rule
from varjax.trace.variable import CREATED


def annotated(tree: Any) -> bool:
    """Whether a variable of treedef ``tree`` holds a box constrained under the active
    mesh and rules (``axis_metadata.constraint_of``)."""
    return any(axis_metadata.constraint_of(b) is not None for b in axis_metadata.boxes_of(tree))


def _on_mesh(eqn: _jax.JaxprEqn, box: Any, sharding: NamedSharding | PartitionSpec
             ) -> NamedSharding | PartitionSpec:
    """``sharding`` with its names that are no mesh axis read through the active logical
    axis rules (``axis_metadata.through_rules``: an NNX Variable's ``out_sharding`` of
    logical names); a name still off the mesh is the user's error, named here with the
    variable, not JAX's inside the pass."""
    named = isinstance(sharding, NamedSharding)
    mesh = sharding.mesh if named else axis_metadata.global_mesh()
    spec = axis_metadata.through_rules(sharding.spec if named else sharding, mesh.axis_names)
    unknown = axis_metadata.off_mesh(spec, mesh.axis_names)
    if unknown:
        collection, path = eqn.params["collection"], eqn.params["path"]
        if collection == CREATED:     # (collection, n): no path of the user's yet
            collection, path = path[0], None
            what = f"a Variable of collection '{collection}' made inside the transform"
        else:
            what = f"variable {errors.format_path(path)} of collection '{collection}'"
        rules = axis_metadata.get_logical_axis_rules()
        raise errors.PartitioningError(
            f"{what} is partitioned {tuple(box.names)}, but {', '.join(map(repr, unknown))} is no axis "
            f"of the mesh {tuple(mesh.axis_names)} and no logical axis rule maps it "
            f"(active rules: {tuple(rules) or 'none'}).",
            collection=collection, path=path, **errors.where(eqn.source_info),
            fix="map the logical name to mesh axes around the call (nnx.logical_axis_rules("
                "[('embed', 'model')]), or nn.logical_axis_rules), or name a mesh axis "
                "(None: not sharded)")
    return NamedSharding(mesh, spec) if named else spec


def _made_on_explicit_mesh(eqn: _jax.JaxprEqn, sharding: NamedSharding | PartitionSpec) -> bool:
    """Whether ``eqn`` writes a Variable made inside the call on a mesh of Explicit axes.
    There a sharding is part of an array's type, so ``with_sharding_constraint`` only
    asserts it; a new Variable's value has the initializer's sharding, and flax.nnx places
    it with ``jax.sharding.reshard`` when it is made.  So does this pass (a sharded init
    under ``nnx.jit`` or ``nnx.eval_shape`` on ``jax.make_mesh``'s default mesh); a variable
    handed to the call keeps the assert: it is placed before the call."""
    mesh = sharding.mesh if isinstance(sharding, NamedSharding) else axis_metadata.global_mesh()
    return (eqn.primitive is var_set_p and eqn.params["collection"] == CREATED
            and mesh is not None and mesh.are_all_axes_explicit)


def constrain(eqn: _jax.JaxprEqn, leaves: list[Any]) -> list[Any]:
    """``leaves`` of ``eqn``'s variable, each box's value constrained as Linen's
    ``Partitioned.unbox()`` constrains it, logical names read as ``_on_mesh`` says."""
    def one(box: Any) -> Any:
        sharding = axis_metadata.constraint_of(box)
        if sharding is None:
            return box
        sharding = _on_mesh(eqn, box, sharding)
        if _made_on_explicit_mesh(eqn, sharding):
            return box.replace_boxed(jax.sharding.reshard(box.value, sharding))
        try:
            return box.replace_boxed(jax.lax.with_sharding_constraint(box.value, sharding))
        except AssertionError as e:   # JAX's check under Explicit mesh axes
            collection, path = eqn.params["collection"], eqn.params["path"]
            raise errors.PartitioningError(
                f"variable {errors.format_path(path)} of collection '{collection}' is "
                f"partitioned {box.names}, but its value's sharding does not match: {e}",
                collection=collection, path=path, **errors.where(eqn.source_info),
                fix="with Explicit mesh axes a sharding is part of the type: place the "
                    "variables with jax.device_put(v, nn.get_sharding(boxed, mesh)) first, "
                    "or make the mesh with AxisType.Auto axes") from None
    value = axis_metadata.map_axis_meta(one, jax.tree.unflatten(eqn.params["tree"], leaves))
    return jax.tree.leaves(value)


@dataclasses.dataclass(frozen=True)
class _Annotated(Rule):
    # A lift's boundary too: there the box names include the axes the transform adds.
    handed = True
    constrained: list    # one entry per rewritten equation, for the pass's counter

    def match(self, eqn: _jax.JaxprEqn) -> bool:
        return annotated(eqn.params["tree"])


class ShardRead(_Annotated):
    primitive = var_get_p

    def rewrite(self, eqn: _jax.JaxprEqn, invals: list, region: Region) -> list:
        self.constrained.append(eqn)
        return constrain(eqn, region.bind(eqn, invals))


class ShardWrite(_Annotated):
    primitive = var_set_p

    def rewrite(self, eqn: _jax.JaxprEqn, invals: list, region: Region) -> list:
        self.constrained.append(eqn)
        return region.bind(eqn, constrain(eqn, invals))


class _Local(Rewriter):
    local = True


@dataclasses.dataclass(frozen=True)
class ShardVariables(Pass):
    """Constrains reads and writes of partitioned variables to their shardings (a default
    pass)."""

    name = "shard-variables"
    summary = "constrain reads and writes of partitioned variables to their shardings"
    after = ("forward-stores", "dead-reads")
    before = ("discharge",)
    rootable = True     # a variable's own box says how to shard it, whoever holds it

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        constrained: list = []
        out = _Local([ShardRead(constrained), ShardWrite(constrained)]).run(jaxpr)
        if constrained:
            ctx.count(self.name, "constrained", len(constrained))
        return out
