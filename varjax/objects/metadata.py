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
``out_axes`` entry.  A ``None`` axis leaves a variable alone.

Sharp edges:
  * Only ``vj.Variable`` objects are adjusted.  A bound Linen module's boxed variables
    cross ``nn.vmap``/``nn.scan``, whose ``metadata_params`` do this; passing one with
    boxed variables at an axis raises ``NotProvidedError`` rather than leaving its names
    wrong.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax

from varjax.ir import axis_metadata, errors
from varjax.ir.typing import AxesPrefix
from varjax.objects.nodes import is_node
from varjax.trace.variable_api import Variable

_KEY = "out_sharding"


def _change(var: Variable, axis: int, params: dict, add: bool) -> None:
    names = var._metadata.get(_KEY)
    if names:
        names = list(names)
        if add:
            names.extend([None] * (axis - len(names)))
            names.insert(axis, params[axis_metadata.PARTITION_NAME])
        elif names.pop(axis) != params[axis_metadata.PARTITION_NAME]:
            raise errors.PartitioningError(
                f"vj.transform_metadata: axis {axis} of a variable of collection "
                f"'{var.collection}' is named {var._metadata[_KEY][axis]!r}, not "
                f"{params[axis_metadata.PARTITION_NAME]!r}.", collection=var.collection,
                path=var.path, **errors.where(),
                fix="give transform_metadata the partition the axis was added with")
        var._metadata[_KEY] = tuple(names)
    value = var.value
    if any(map(axis_metadata.is_axis_metadata,
               jax.tree.leaves(value, is_leaf=axis_metadata.is_axis_metadata))):
        var.value = (axis_metadata.add_axis if add else axis_metadata.remove_axis)(value, axis, params)


def _variables(axes: Any, tree: Any, what: str) -> list[tuple[Variable, int]]:
    """The ``vj.Variable`` objects of ``tree`` with their axis from the prefix ``axes``."""
    found: list[tuple[Variable, int]] = []

    def visit(axis: Any, sub: Any) -> None:
        for leaf in jax.tree.leaves(sub, is_leaf=lambda x: isinstance(x, Variable) or is_node(x)):
            if axis is None:
                continue
            if isinstance(leaf, Variable):
                found.append((leaf, axis))
            elif is_node(leaf) and any(map(axis_metadata.is_axis_metadata, jax.tree.leaves(
                    leaf, is_leaf=axis_metadata.is_axis_metadata))):
                raise errors.NotProvidedError(
                    f"vj.transform_metadata: {what} holds a {type(leaf).__name__} with boxed "
                    "(partitioned) variables; only vj.Variable objects are adjusted.",
                    **errors.where(), fix="lift the module with nn.vmap / nn.scan and "
                                          "metadata_params={nn.PARTITION_NAME: ...}")
    jax.tree.map(visit, axes, tree, is_leaf=lambda x: x is None or isinstance(x, Variable)
                 or is_node(x))
    return found


def _prefix(axes: Any, n: int) -> tuple:
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,) * n


def transform_metadata(fn: Callable | None = None, *, in_axes: AxesPrefix = 0,
                       out_axes: AxesPrefix = 0, partition: str | None) -> Callable[..., Any]:
    """Remove ``partition`` from the arguments' variables' names at their axis while ``fn``
    runs, and add it to the output's (see the module docstring)."""
    if fn is None:
        return functools.partial(transform_metadata, in_axes=in_axes, out_axes=out_axes,
                                 partition=partition)
    params = {axis_metadata.PARTITION_NAME: partition}

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
