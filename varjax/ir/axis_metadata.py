"""Boxed axis metadata: what each axis of a variable means, carried in the variable's pytree.

Linen annotates a variable by *boxing* its value: ``nn.with_partitioning(init, ('embed',
'mlp'))`` makes the initializer return ``Partitioned(value, names=('embed', 'mlp'))``.  The
box is a pytree node whose only child is the value and whose names (and mesh, and logical
rules) are static aux data.  varjax stores a variable as its leaves plus its treedef, so a
boxed variable keeps its box through ``init``, and its ``VarType`` -- what every
``var_get``/``var_set`` equation carries -- names its axes.  That is why the boxes live
here, in the IR layer, rather than in ``varjax.nn``: the type check (``varjax.trace.variable_api``) and
the passes read the names off the types without knowing about modules.

What is here, each as Linen's (``flax.core.meta``, ``flax.core.spmd``, ``flax.linen.spmd``):

* ``AxisMetadata``, the base class of boxes, and the tree helpers over them (``unbox``,
  ``add_axis``, ``remove_axis``, ``replace_boxed``, ``map_axis_meta``, ...).
* ``Partitioned`` (mesh axis names) and ``LogicallyPartitioned`` (logical names, turned
  into mesh axes by rules), frozen dataclasses with Linen's fields.
* The logical axis rules of the running thread (``logical_axis_rules``, a context manager)
  and ``logical_to_mesh_axes``, Linen's resolution of logical names into a
  ``PartitionSpec``: rules are tried in order, an axis takes the first rule whose mesh
  axes are all still unused, and an axis no rule assigns stays unsharded.
* ``global_mesh()``: the mesh Linen calls "global", JAX's active abstract mesh
  (``jax.set_mesh``).
* ``BOX_CLASSES``, every ``Partitioned`` class, and ``box_class_hooks``, told of each new
  one: ``varjax.nn.serialization`` registers them with ``flax.serialization``.

Linen constrains a value to its box's sharding when it unboxes it under a mesh.
``partition_spec_of`` and ``constraint_of`` say which constraint that is, without
applying it, for code (the ``shard-variables`` pass) that places the constraint itself.

Sharp edges:
  * ``LogicallyPartitioned.get_partition_spec()`` gives the *logical* names, as in Linen;
    ``partition_spec_of`` gives the mesh axes they resolve to under the active rules.
  * ``unbox(..., apply_constraint=False)`` leaves a user box (an ``AxisMetadata`` that
    is not a ``Partitioned``) to its own ``unbox()``, which takes no arguments in Linen.
  * Names or rules given as lists are kept as lists; the treedef compares and hashes
    them as tuples, so varjax can key caches on it.
"""
from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
import threading
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import jax
from jax.sharding import NamedSharding, PartitionSpec

from varjax.ir import errors
from varjax.ir.typing import PyTree

__all__ = [
    "PARTITION_NAME", "AxisMetadata", "Partitioned", "LogicallyPartitioned", "LogicalNames",
    "LogicalRules", "is_axis_metadata", "map_axis_meta", "unbox", "add_axis", "remove_axis",
    "replace_boxed", "rebox", "get_partition_spec", "get_sharding", "unboxed_structure", "equal_unboxed",
    "logical_axis_rules", "get_logical_axis_rules", "set_logical_axis_rules",
    "logical_to_mesh_axes", "assign_mesh_axes", "UNASSIGNED", "global_mesh",
    "partition_spec_of", "constraint_of", "through_rules", "off_mesh",
]

A = TypeVar("A")
# One entry per array axis: a name, None, or PartitionSpec.UNCONSTRAINED.
LogicalNames = Sequence[Any]
# (logical name, mesh axis | tuple of mesh axes | None) pairs, highest priority first.
LogicalRules = Sequence[tuple[str, Any]]

# The key of ``metadata_params`` (on ``nn.vmap`` / ``nn.scan``) naming the axis they add.
PARTITION_NAME = "partition_name"


class AxisMetadata(Generic[A], metaclass=abc.ABCMeta):
    """A box around a variable's value that carries metadata about its axes.

    A subclass is a pytree whose leaves are those of the value ``unbox()`` returns, so JAX
    and varjax see the arrays; ``add_axis`` and ``remove_axis`` keep the metadata right
    when a lifted ``vmap`` or ``scan`` stacks the value along a new axis (each undoes the
    other).
    """

    @abc.abstractmethod
    def unbox(self) -> A:
        """The boxed value itself (not unboxed further if it is a box too)."""

    @abc.abstractmethod
    def replace_boxed(self, val: PyTree) -> AxisMetadata[Any]:
        """The same box around ``val``."""

    @abc.abstractmethod
    def add_axis(self, index: int, params: dict[Any, Any]) -> AxisMetadata[A]:
        """The box with an axis inserted at ``index`` (``params``: the transform's
        ``metadata_params``)."""

    @abc.abstractmethod
    def remove_axis(self, index: int, params: dict[Any, Any]) -> AxisMetadata[A]:
        """The box with axis ``index`` removed (``params`` as in ``add_axis``)."""


def _frozen(x: Any) -> Any:
    return tuple(map(_frozen, x)) if isinstance(x, (list, tuple)) else x


class _Static:
    """A box's static fields as treedef aux data: given back as they were, compared and
    hashed with lists read as tuples (varjax keys caches on variable types)."""

    __slots__ = ("values",)

    def __init__(self, values: tuple):
        self.values = values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and _frozen(self.values) == _frozen(other.values)

    def __hash__(self) -> int:
        return hash(_frozen(self.values))

    def __repr__(self) -> str:
        return repr(self.values)


# Every Partitioned class, in definition order, and what is told of each one defined later.
BOX_CLASSES: list[type] = []
box_class_hooks: list[Callable[[type], None]] = []


def _register(cls: type) -> None:
    """Registers a ``Partitioned`` dataclass as a pytree: ``value`` the one child."""
    static = tuple(f.name for f in dataclasses.fields(cls) if f.name != "value")

    def flatten_with_keys(box: Any) -> tuple:
        return (((jax.tree_util.GetAttrKey("value"), box.value),),
                _Static(tuple(getattr(box, n) for n in static)))

    def flatten(box: Any) -> tuple:
        return (box.value,), _Static(tuple(getattr(box, n) for n in static))

    def unflatten(aux: _Static, children: Sequence[Any]) -> Any:
        return cls(children[0], **dict(zip(static, aux.values)))

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    BOX_CLASSES.append(cls)
    for hook in box_class_hooks:
        hook(cls)


@dataclasses.dataclass(frozen=True)
class Partitioned(AxisMetadata[A]):
    """A value with the mesh axis each of its axes is sharded over (``None``: not sharded).

    ``mesh``, if given, is the mesh to constrain to; otherwise the active one
    (``global_mesh()``) is used, and without either nothing is constrained.  A subclass
    is made a frozen dataclass and a pytree (``value`` its one child) on definition.
    """

    value: PyTree
    names: LogicalNames
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)
        _register(cls)

    def replace(self, **changes: Any) -> Partitioned[Any]:
        """A copy with ``changes`` to its fields."""
        return dataclasses.replace(self, **changes)

    def unbox(self, apply_constraint: bool = True) -> A:
        """The value; under a mesh (this box's or the active one) and with
        ``apply_constraint``, constrained to this box's sharding."""
        sharding = constraint_of(self) if apply_constraint else None
        return self.value if sharding is None else jax.lax.with_sharding_constraint(self.value, sharding)

    def replace_boxed(self, val: PyTree) -> Partitioned[Any]:
        return self.replace(value=val)

    def _partition_name(self, params: dict[Any, Any]) -> Any:
        if PARTITION_NAME not in params:
            raise errors.PartitioningError(
                f"a {type(self).__name__} variable is transformed along a new axis, but "
                f"'{PARTITION_NAME}' is not specified in metadata_params: {self!r}",
                **errors.where(),
                fix="pass metadata_params={nn.PARTITION_NAME: 'layers'} (the new axis's "
                    "mesh axis name, or None) to the transform")
        return params[PARTITION_NAME]

    def add_axis(self, index: int, params: dict[Any, Any]) -> Partitioned[A]:
        names = list(self.names)
        names.extend([None] * (index - len(names)))
        names.insert(index, self._partition_name(params))
        return self.replace(names=tuple(names))

    def remove_axis(self, index: int, params: dict[Any, Any]) -> Partitioned[A]:
        name = self._partition_name(params)
        names = list(self.names)
        if names.pop(index) != name:
            raise errors.PartitioningError(
                f"axis {index} of a {type(self).__name__} variable is named "
                f"{self.names[index]!r}, but the transform removes an axis named {name!r}.",
                **errors.where(), fix="give the transform the partition_name it added the axis with")
        return self.replace(names=tuple(names))

    def get_partition_spec(self) -> PartitionSpec:
        """``PartitionSpec(*names)``: the names as given (logical ones for a
        ``LogicallyPartitioned``)."""
        return PartitionSpec(*self.names)

    def get_sharding(self, mesh: jax.sharding.Mesh) -> jax.sharding.Sharding:
        return NamedSharding(mesh, self.get_partition_spec())


_register(Partitioned)


class LogicallyPartitioned(Partitioned[A]):
    """A value with a *logical* name for each axis (``'batch'``, ``'embed'``), resolved to
    mesh axes by ``rules`` or, if None, by the active rules (``logical_axis_rules``)."""

    rules: LogicalRules | None = None


def is_axis_metadata(val: object) -> bool:
    """Whether ``val`` is a metadata box (``Partitioned``, ``LogicallyPartitioned``, ...)."""
    return isinstance(val, AxisMetadata)


def map_axis_meta(fn: Callable[[AxisMetadata[Any]], Any], tree: PyTree) -> PyTree:
    """``tree`` with each box (outermost ones) replaced by ``fn(box)``."""
    return jax.tree.map(lambda x: fn(x) if isinstance(x, AxisMetadata) else x, tree,
                        is_leaf=is_axis_metadata)


def _open(box: AxisMetadata[Any], apply_constraint: bool) -> Any:
    return box.unbox(apply_constraint) if isinstance(box, Partitioned) else box.unbox()


def unbox(tree: PyTree, apply_constraint: bool = True) -> PyTree:
    """``tree`` with every box (nested ones too) replaced by its value; see
    ``Partitioned.unbox`` for ``apply_constraint``."""
    if isinstance(tree, jax.Array):     # the common case, once per variable read
        return tree
    return map_axis_meta(lambda box: unbox(_open(box, apply_constraint), apply_constraint), tree)


def add_axis(tree: PyTree, index: int, params: dict[Any, Any]) -> PyTree:
    """``tree`` with axis ``index`` inserted into every metadata box in it (what a
    transform adding an axis, ``vmap`` or ``scan``, does to its variables' boxes)."""
    return map_axis_meta(lambda box: box.add_axis(index, params), tree)


def remove_axis(tree: PyTree, index: int, params: dict[Any, Any]) -> PyTree:
    """``tree`` with axis ``index`` removed from every metadata box in it (the inverse of
    ``add_axis``)."""
    return map_axis_meta(lambda box: box.remove_axis(index, params), tree)


def replace_boxed(tree: PyTree, updates: PyTree) -> PyTree:
    """``tree``'s boxes around the values of ``updates`` (same structure, boxes as leaves)."""
    def put(old: Any, new: Any) -> Any:
        if not isinstance(old, AxisMetadata):
            return new
        return old.replace_boxed(replace_boxed(_open(old, False), new))   # old value unused
    return jax.tree.map(put, tree, updates, is_leaf=is_axis_metadata)


def rebox(current: Any, new: Any) -> Any:
    """What writing ``new`` through an unboxing handle stores (Linen's ``Variable.value``):
    ``new`` in ``current``'s boxes where ``current`` has boxes at the top of its
    structure and ``new`` has that structure with the boxes as leaves; else ``new``."""
    tree = jax.tree.structure(current, is_leaf=is_axis_metadata)
    if tree == jax.tree.structure(new, is_leaf=is_axis_metadata) and \
            any(map(is_axis_metadata, jax.tree.leaves(current, is_leaf=is_axis_metadata))):
        return replace_boxed(current, new)
    return new


def _leaf_spec(x: Any) -> PartitionSpec | None:
    if hasattr(x, "get_partition_spec"):
        return x.get_partition_spec()
    return PartitionSpec() if hasattr(x, "shape") else None   # an unboxed array: replicated


def get_partition_spec(tree: PyTree) -> PyTree:
    """A ``PartitionSpec`` per box (and ``PartitionSpec()`` per plain array) of ``tree``."""
    return jax.tree.map(_leaf_spec, tree, is_leaf=is_axis_metadata)


def get_sharding(tree: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    """A ``NamedSharding`` on ``mesh`` per box (and per plain array, replicated) of ``tree``."""
    def sharding(x: Any) -> jax.sharding.Sharding | None:
        if hasattr(x, "get_sharding"):
            return x.get_sharding(mesh)
        spec = _leaf_spec(x)
        return None if spec is None else NamedSharding(mesh, spec)
    return jax.tree.map(sharding, tree, is_leaf=is_axis_metadata)


def _has_box(tree: Any) -> bool:
    data = tree.node_data()       # None for a leaf
    return data is not None and (isinstance(data[0], type) and issubclass(data[0], AxisMetadata)
                                 or any(map(_has_box, tree.children())))


def boxes_of(tree: Any) -> list[AxisMetadata[Any]]:
    """The boxes (outermost) of a value of treedef ``tree``, holding leaf positions as
    values: the names a variable's ``var_get``/``var_set`` equations carry.  A treedef
    without a box is never unflattened (user pytrees are not rebuilt from placeholders)."""
    if not _has_box(tree):
        return []
    value = jax.tree.unflatten(tree, range(tree.num_leaves))
    return [b for b in jax.tree.leaves(value, is_leaf=is_axis_metadata) if is_axis_metadata(b)]


def unboxed_structure(tree: Any) -> Any:
    """The treedef ``tree`` has without its boxes (each replaced by the value's structure).

    The type check compares given variables with what the code expects modulo boxes, as
    Linen accepts unboxed parameters for a boxing initializer and the other way round."""
    if not _has_box(tree):
        return tree
    return jax.tree.structure(unbox(jax.tree.unflatten(tree, range(tree.num_leaves)), False))


def equal_unboxed(a: Any, b: Any) -> bool:
    """Whether treedefs ``a`` and ``b`` are equal without their boxes, the boxes holding the
    leaves in place (so the two types' leaves still line up)."""
    bare_a, bare_b = unboxed_structure(a), unboxed_structure(b)
    return bare_a == bare_b and bare_a.num_leaves == a.num_leaves and bare_b.num_leaves == b.num_leaves


# --- logical axis rules ------------------------------------------------------------------

class _Rules(threading.local):
    rules: LogicalRules = ()


_rules = _Rules()


def set_logical_axis_rules(rules: LogicalRules) -> None:
    """Sets this thread's logical axis rules."""
    _rules.rules = rules


def get_logical_axis_rules() -> LogicalRules:
    """This thread's logical axis rules (``()`` when none were set)."""
    return _rules.rules


@contextlib.contextmanager
def logical_axis_rules(rules: LogicalRules) -> Iterator[None]:
    """Sets this thread's logical axis rules for the ``with`` block."""
    old = _rules.rules
    _rules.rules = rules
    try:
        yield
    finally:
        _rules.rules = old


class _Unassigned:
    """A logical axis no rule has given a mesh axis (yet); false, as Linen's sentinel."""

    def __repr__(self) -> str:
        return "UnassignedAxis"

    def __bool__(self) -> bool:
        return False


UNASSIGNED = _Unassigned()


def _free(mesh_axes: Any, assigned: list) -> bool:
    """Whether none of ``mesh_axes`` is already taken by an axis in ``assigned``."""
    new = set(jax.tree.leaves(mesh_axes)) - {PartitionSpec.UNCONSTRAINED, None}
    return not new & set(jax.tree.leaves(assigned))


def assign_mesh_axes(names: LogicalNames | None, rules: LogicalRules | None = None) -> list | None:
    """The mesh axes of each axis named ``names`` under ``rules`` (the active rules if
    None), with ``UNASSIGNED`` for a logical name no rule could place.

    Rules are tried in order; an axis takes a rule's mesh axes if it is not assigned yet
    and none of those mesh axes is used by another axis.  ``None`` entries (and
    ``PartitionSpec.UNCONSTRAINED``) are kept as they are."""
    if names is None:
        return None
    rules = get_logical_axis_rules() if rules is None else rules
    repeated = tuple(k for k, n in collections.Counter(names).items() if n > 1 and isinstance(k, str))
    if repeated:
        raise errors.PartitioningError(
            f"logical axis names {repeated} occur more than once in {tuple(names)}: each array "
            "axis needs its own name.", **errors.where(),
            fix="name every axis differently (None for an axis that is not sharded)")
    if not isinstance(rules, (tuple, list)):
        raise errors.PartitioningError(
            f"logical axis rules must be a tuple or list of (logical name, mesh axes) pairs, "
            f"not a {type(rules).__name__}.", **errors.where(),
            fix="rules=(('batch', 'data'), ('embed', None), ...)")
    result = [UNASSIGNED if isinstance(name, str) else name for name in names]
    for logical, mesh_axes in rules:
        if logical in names:
            at = names.index(logical)
            if _free(mesh_axes, result) and result[at] is UNASSIGNED:
                result[at] = mesh_axes
    return result


def logical_to_mesh_axes(array_dim_names: LogicalNames | None,
                         rules: LogicalRules | None = None) -> PartitionSpec | None:
    """The ``PartitionSpec`` of an array whose axes have logical ``array_dim_names``
    under ``rules`` (the active rules if None); an axis no rule places is not sharded."""
    result = assign_mesh_axes(array_dim_names, rules)
    if result is None:
        return None
    return PartitionSpec(*(None if x is UNASSIGNED else x for x in result))


def global_mesh() -> jax.sharding.AbstractMesh | None:
    """The active mesh (``jax.set_mesh``), as an abstract mesh; None outside one."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def partition_spec_of(box: Any) -> PartitionSpec | None:
    """The mesh ``PartitionSpec`` of ``box`` under the active rules: its names for a
    ``Partitioned``, their resolution (``logical_to_mesh_axes``) with the box's own rules
    or else the active ones for a ``LogicallyPartitioned``.  None where Linen's unbox
    would not constrain whatever the mesh: a logical box without rules, or not a
    ``Partitioned``."""
    if isinstance(box, LogicallyPartitioned):
        rules = box.rules if box.rules is not None else get_logical_axis_rules()
        return logical_to_mesh_axes(box.names, rules) if rules else None
    if isinstance(box, Partitioned):
        return box.get_partition_spec()
    return None


def through_rules(spec: PartitionSpec, mesh_axes: Sequence[str],
                  rules: LogicalRules | None = None) -> PartitionSpec:
    """``spec`` with each name that is no axis of the mesh (``mesh_axes``) replaced by what
    ``rules`` (the active ones if None) map it to, the last rule for a name winning: how
    flax.nnx reads a Variable's ``out_sharding`` of logical names.  A mesh axis is kept
    as it is (a Linen ``Partitioned`` names mesh axes), and so is a name no rule maps
    (``off_mesh`` finds it)."""
    rules = get_logical_axis_rules() if rules is None else rules
    mapping: dict[Any, Any] = {}
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
            raise errors.PartitioningError(
                f"a logical axis rule must be a (logical name, mesh axes) pair, not {rule!r}.",
                **errors.where(), fix="rules=(('batch', 'data'), ('embed', None), ...)")
        mapping[rule[0]] = rule[1]
    return PartitionSpec(*(mapping[x] if isinstance(x, str) and x not in mesh_axes and x in mapping
                           else x for x in spec))


def off_mesh(spec: PartitionSpec, mesh_axes: Sequence[str]) -> tuple[str, ...]:
    """The names in ``spec`` (a tuple entry's too) that are no axis of the mesh."""
    names = [n for x in spec for n in (x if isinstance(x, (tuple, list)) else (x,))]
    return tuple(n for n in names if isinstance(n, str) and n not in mesh_axes)


def constraint_of(box: Any) -> NamedSharding | PartitionSpec | None:
    """What Linen's ``box.unbox()`` passes to ``with_sharding_constraint``: a
    ``NamedSharding`` on the box's mesh, or the bare spec under the active mesh; None
    where it does not constrain (no mesh, or ``partition_spec_of`` is None)."""
    spec = partition_spec_of(box)
    if spec is None or (box.mesh is None and global_mesh() is None):
        return None
    return spec if box.mesh is None else NamedSharding(box.mesh, spec)
