"""``vj.transform_metadata``: partition names of variables crossing a vmap or scan.

A variable created inside ``vj.vmap`` (one layer of a stack) is annotated for the layer:
``vj.Variable(w, out_sharding=('embed', 'mlp'))``, or a value boxed by
``nn.with_partitioning``.  Outside, the same variable has one more axis, and its names
need one more entry.  Object-mode transforms take plain ``in_axes``, not Linen's
``metadata_params``, so the names are adjusted by a decorator placed inside the transform,
as in NNX:

    @vj.vmap(in_axes=0, out_axes=0)
    @vj.transform_metadata(in_axes=0, out_axes=0, partition='layers')
    def make_layer(key): ...

On entry the partition name is removed, at the argument's axis, from each ``vj.Variable``
of the arguments (its ``out_sharding`` metadata, NNX's key, and a boxed value's names);
on exit it is put back, and added to each ``vj.Variable`` of the output at its
``out_axes`` entry.  A ``None`` axis leaves a variable alone.  ``names={key: name}``
(NNX's other ``transform_metadata`` keys) does the same to each metadata entry ``key``
that is a tuple of names.  Each change ends with the Variable's ``remove_axis``/
``add_axis(axis, partition)``, where NNX's Variables run their ``on_remove_axis``/
``on_add_axis`` hooks, once per Variable and crossing, as flax.nnx calls them.

Sharp edges:
  * Only ``vj.Variable`` objects are adjusted.  A bound Linen module's boxed variables
    cross ``nn.vmap``/``nn.scan``, whose ``metadata_params`` do this; passing one with
    boxed variables at an axis raises ``NotProvidedError`` rather than leaving its names
    wrong.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax

from varjax.ir import axis_metadata, errors
from varjax.ir.typing import AxesPrefix
from varjax.objects.nodes import is_node
from varjax.trace.variable_api import Variable

_KEY = "out_sharding"


def _names(var: Variable, key: str, axis: int, name: Any, add: bool) -> None:
    """Metadata entry ``key`` of ``var``, when a non-empty tuple (a name per axis), with
    ``name`` put in at ``axis`` (``add``) or taken out there: it must be ``name``."""
    names = var._metadata.get(key)
    if not names or (key != _KEY and not isinstance(names, tuple)):
        return
    names = list(names)
    if add:
        names.extend([None] * (axis - len(names)))
        names.insert(axis, name)
    elif names.pop(axis) != name:
        raise errors.PartitioningError(
            f"vj.transform_metadata: axis {axis} of a variable of collection "
            f"'{var.collection}' has {key} {var._metadata[key][axis]!r}, not {name!r}.",
            collection=var.collection, path=var.path, **errors.where(),
            fix="give transform_metadata the names the axis was added with")
    var._metadata[key] = tuple(names)


def _change(var: Variable, axis: int, params: dict, add: bool) -> None:
    """Name or unname ``var``'s axis ``axis``: its ``out_sharding`` by the partition, each
    other metadata entry ``params`` names by its value, a boxed value's names, then the
    Variable's own ``add_axis``/``remove_axis`` (NNX's hooks)."""
    partition = params[axis_metadata.PARTITION_NAME]
    _names(var, _KEY, axis, partition, add)
    for key, name in params.items():
        if key != axis_metadata.PARTITION_NAME:
            _names(var, key, axis, name, add)
    value = var.value
    if any(map(axis_metadata.is_axis_metadata,
               jax.tree.leaves(value, is_leaf=axis_metadata.is_axis_metadata))):
        var.value = (axis_metadata.add_axis if add else axis_metadata.remove_axis)(value, axis, params)
    (var.add_axis if add else var.remove_axis)(axis, partition)


def _variables(axes: Any, tree: Any, what: str) -> list[tuple[Variable, int]]:
    """The ``vj.Variable`` objects of ``tree`` with their axis from the prefix ``axes``,
    each once: a Variable held at two places (a submodule shared by two modules) has its
    axis named and unnamed once, and two different axes for it are refused."""
    found: dict[int, tuple[Variable, int]] = {}

    def visit(axis: Any, sub: Any) -> None:
        for leaf in jax.tree.leaves(sub, is_leaf=lambda x: isinstance(x, Variable) or is_node(x)):
            if axis is None:
                continue
            if isinstance(leaf, Variable):
                seen = found.setdefault(id(leaf), (leaf, axis))
                if seen[1] != axis:
                    raise errors.TransformError(
                        f"vj.transform_metadata: {what} holds one {type(leaf).__name__} at "
                        f"two places with different axes ({seen[1]} and {axis}).",
                        collection=leaf.collection, **errors.where(),
                        fix="give every place of a shared module the same axis")
            elif is_node(leaf) and any(map(axis_metadata.is_axis_metadata, jax.tree.leaves(
                    leaf, is_leaf=axis_metadata.is_axis_metadata))):
                raise errors.NotProvidedError(
                    f"vj.transform_metadata: {what} holds a {type(leaf).__name__} with boxed "
                    "(partitioned) variables; only vj.Variable objects are adjusted.",
                    **errors.where(), fix="lift the module with nn.vmap / nn.scan and "
                                          "metadata_params={nn.PARTITION_NAME: ...}")
    jax.tree.map(visit, axes, tree, is_leaf=lambda x: x is None or isinstance(x, Variable)
                 or is_node(x))
    return list(found.values())


def _prefix(axes: Any, n: int) -> tuple:
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,) * n


def transform_metadata(fn: Callable | None = None, *, in_axes: AxesPrefix = 0,
                       out_axes: AxesPrefix = 0, partition: str | None,
                       names: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """Remove ``partition`` from the arguments' variables' names at their axis while ``fn``
    runs, and add it to the output's (see the module docstring); ``names``: further
    metadata entries adjusted the same way, each by its own name for the axis."""
    if fn is None:
        return functools.partial(transform_metadata, in_axes=in_axes, out_axes=out_axes,
                                 partition=partition, names=names)
    params = {**(names or {}), axis_metadata.PARTITION_NAME: partition}

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        given = _variables(_prefix(in_axes, len(args)), args, "an argument")
        for var, axis in given:
            _change(var, axis, params, add=False)
        try:
            out = fn(*args)
        finally:
            for var, axis in given:
                _change(var, axis, params, add=True)
        made = [(v, a) for v, a in _variables(out_axes, out, "the output")
                if all(v is not g for g, _ in given)]
        for var, axis in made:
            _change(var, axis, params, add=True)
        return out
    return wrapper
