"""Lifted ``vmap``, ``shard_map`` and ``pmap``: one body, many members.

``variable_axes`` maps collection filters to an axis (the variable has one
slice per member, stacked along that axis) or ``None`` (one value shared by
every member, read-only in practice: a per-member write raises
``TransformError``).  A touched collection that no filter
names raises ``TransformError``.  ``split_rngs`` maps stream filters to
``True`` (one key per member: members initialise and drop out differently)
or ``False``; every other stream is broadcast (the same key for all members).

A group of a plain function's body holds every variable of its collections in
the enclosing trace; one that lacks the mapped axis (or is not divisible by
the mesh) is set aside (``varjax.lifting.groups.set_aside``): passed through
unchanged, and a body that touches it raises ``TransformError``.  Keyword
arguments of the call are broadcast by ``vmap`` (Linen ignores them with a
warning) and must be static (non-array) for ``shard_map`` / ``pmap``.
"""
from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec

from varjax.ir import errors, filters
from varjax.ir.typing import AxesPrefix, AxisName, Passes, ShardingLike, Target
from varjax.lifting.groups import is_array, set_aside
from varjax.lifting.region import lift
from varjax.objects import object_transforms as objects
from varjax.trace.context import site
from varjax.transforms.common import (
    apply_to,
    array_axes,
    axis_names,
    filter_items,
    has_axis,
    lift_methods,
    object_options,
    reject,
    rng_groups,
    split_keys,
)

_AXES_FIX = ("add '{collection}' to variable_axes: an axis to give each member its own "
             "copy, or None to share one")


def vmap(target: Target | None = None, variable_axes: Mapping[Any, int | None] | None = None,
         split_rngs: Mapping[Any, bool] | None = None, in_axes: AxesPrefix = 0,
         out_axes: AxesPrefix = 0, axis_size: int | None = None,
         axis_name: AxisName | None = None,
         spmd_axis_name: AxisName | tuple[AxisName, ...] | None = None,
         metadata_params: Mapping[str, Any] | None = None,
         methods: Sequence[str] | Mapping[str, Mapping[str, Any]] | None = None,
         passes: Passes = ()) -> Target:
    """Lifted ``jax.vmap`` (Linen's ``nn.vmap``).

    ``metadata_params={nn.PARTITION_NAME: name}`` inserts ``name`` into the partition
    names of boxed variables at their mapped axis, as Linen does.  ``passes``: passes run
    on the body's IR, after those of the enclosing program (``vj.lift``)."""
    if target is None:       # @vj.vmap(in_axes=...)
        return functools.partial(vmap, variable_axes=variable_axes, split_rngs=split_rngs,
                                 in_axes=in_axes, out_axes=out_axes, axis_size=axis_size,
                                 axis_name=axis_name, spmd_axis_name=spmd_axis_name,
                                 metadata_params=metadata_params, methods=methods, passes=passes)
    if isinstance(methods, Mapping):
        return lift_methods(target, "vmap", methods, lambda options, names: vmap(
            target, **options, methods=names))
    axes = filter_items(variable_axes, "variable_axes")
    var_axes = tuple(a for _, a in axes)
    rng_filters, split = rng_groups(split_rngs)

    def transform(region: Callable, groups: tuple, rngs: tuple, *args: Any, **kwargs: Any) -> Any:
        arg_axes = array_axes(in_axes, args)
        n = axis_size if axis_size is not None else _infer_size(args, arg_axes, groups, var_axes)
        reject(n is None and any(g for g, do in zip(rngs, split) if do), "vmap",
               "split_rngs needs the mapped axis size, and no mapped argument or variable "
               "shows it.", "pass axis_size=")
        keys = split_keys(rngs, split, n) if n is not None else rngs
        rng_axes = tuple(0 if do else None for do in split)
        mapped, aside = set_aside(groups, lambda i, x: has_axis(x, var_axes[i], n))
        mapped = axis_names(mapped, var_axes, metadata_params, add=False)
        # Keyword arguments are broadcast (Linen ignores them with a warning).
        try:
            out, gs_out = jax.vmap(lambda gs, ks, *a: region(gs, ks, *a, **kwargs),
                                   in_axes=(var_axes, rng_axes, *arg_axes),
                                   out_axes=(out_axes, var_axes), axis_size=n,
                                   axis_name=axis_name,
                                   spmd_axis_name=spmd_axis_name)(mapped, keys, *args)
        except ValueError as e:
            shared = _shared_write(e, region, [f for f, _ in axes], var_axes)
            if shared is None:
                raise
            raise errors.TransformError(
                f"vj.vmap: the body writes a per-member value to variable "
                f"{errors.format_path(shared[1])} of collection '{shared[0]}', whose "
                "variable_axes entry is None (one value shared by every member).",
                collection=shared[0], path=shared[1], **site(),
                fix=f"map '{shared[0]}' along an axis in variable_axes (e.g. "
                    f"{{'{shared[0]}': 0}}) to keep one copy per member") from e
        gs_out = axis_names(gs_out, var_axes, metadata_params, add=True)
        return out, tuple({**a, **g} for a, g in zip(aside, gs_out))

    return apply_to(target, "vmap", lambda fn: lift(
        transform, fn, variables=tuple(f for f, _ in axes), rngs=rng_filters, name="vmap",
        fix=_AXES_FIX, passes=passes), methods, object_options(
            "vmap", lambda fn: objects.vmap(fn, in_axes=in_axes, out_axes=out_axes,
                                           axis_size=axis_size, axis_name=axis_name,
                                           passes=passes),
            variable_axes=(variable_axes, None), split_rngs=(split_rngs, None),
            spmd_axis_name=(spmd_axis_name, None), metadata_params=(metadata_params, None)))


def _shared_write(e: ValueError, region: Any, var_filters: list, var_axes: tuple) -> Any:
    """The variable of a broadcast (axis None) group that JAX's "got axis spec None but
    output was batched" error ``e`` is about: one the body wrote, named in the message if
    possible; None if ``e`` is another error."""
    if "axis spec None but output was batched" not in str(e):
        return None
    shared = [k for k in sorted(region.writes)
              if (i := next((i for i, f in enumerate(var_filters)
                             if filters.matches(f, k[0])), None)) is not None
              and var_axes[i] is None]
    named = [k for k in shared if repr(k) in str(e)]
    return (named or shared or [None])[0]


def _infer_size(args: tuple, arg_axes: tuple, groups: tuple, var_axes: tuple) -> int | None:
    for ax, x in zip(jax.tree.leaves(arg_axes, is_leaf=lambda a: a is None),
                     jax.tree.leaves(args)):
        if ax is not None and is_array(x):
            return x.shape[ax]
    # No mapped argument: the size most variables of the mapped groups have along their
    # axis (a group may also hold variables of modules outside the body, see set_aside).
    sizes = collections.Counter(
        x.shape[ax] for ax, group in zip(var_axes, groups) if ax is not None
        for x in jax.tree.leaves(group) if -x.ndim <= ax < x.ndim)
    return sizes.most_common(1)[0][0] if sizes else None


def shard_map(target: Target, mesh: jax.sharding.Mesh, in_specs: ShardingLike,
              out_specs: ShardingLike, variable_specs: Mapping[Any, Any] | None = None,
              split_rngs: Mapping[Any, bool] | None = None, check_vma: bool = True,
              methods: Sequence[str] | None = None) -> Target:
    """Lifted ``jax.shard_map`` (Flax has none): the body runs once per shard.

    ``variable_specs`` maps collection filters to a ``PartitionSpec`` for every
    variable of the group (``P()``: replicated; ``P('data')``: sharded along its first
    axis).  A split stream gives each shard its own key (the key folded with the shard's
    index over the mesh axes); other streams are the same on every shard."""
    specs = filter_items(variable_specs, "variable_specs")
    return _sharded(target, "shard_map", mesh, specs, split_rngs, in_specs, out_specs,
                    check_vma, squeeze=False, methods=methods,
                    fix="add '{collection}' to variable_specs with its PartitionSpec")


def pmap(target: Target, variable_axes: Mapping[Any, int | None] | None = None,
         split_rngs: Mapping[Any, bool] | None = None,
         in_axes: int | None | tuple[int | None, ...] = 0, out_axes: int | None = 0,
         axis_name: str = "devices", devices: Sequence[jax.Device] | None = None,
         methods: Sequence[str] | None = None) -> Target:
    """``pmap`` as a thin wrapper of the lifted ``shard_map`` over a one-axis mesh of
    ``devices`` (default: all): mapped arguments, outputs and variables have a leading
    axis of one entry per device, and the body sees one entry (axes 0 or None only)."""
    mesh = jax.sharding.Mesh(list(jax.devices() if devices is None else devices), (axis_name,))
    spec = {0: PartitionSpec(axis_name), None: PartitionSpec()}

    def to_spec(ax: Any, what: str) -> PartitionSpec:
        reject(ax not in spec, "pmap", f"{what} {ax!r} is not supported.", "use 0 or None")
        return spec[ax]
    axes = [(f, to_spec(ax, "variable axis")) for f, ax in filter_items(variable_axes, "variable_axes")]
    in_specs = (tuple(to_spec(ax, "in_axes") for ax in in_axes) if isinstance(in_axes, tuple)
                else to_spec(in_axes, "in_axes"))
    return _sharded(target, "pmap", mesh, axes, split_rngs, in_specs, to_spec(out_axes, "out_axes"),
                    False, squeeze=True, methods=methods, fix=_AXES_FIX)


def _sharded(target: Any, name: str, mesh: Any, specs: list, split_rngs: Any, in_specs: Any,
             out_specs: Any, check_vma: bool, *, squeeze: bool, methods: Any, fix: str) -> Any:
    """The lifted ``jax.shard_map``; with ``squeeze``, sharded values lose their per-shard
    axis of one before the body sees them and regain it after (``pmap``)."""
    var_specs = tuple(s for _, s in specs)
    rng_filters, split = rng_groups(split_rngs)
    axis_names = tuple(mesh.axis_names)

    def fits(i: int, x: Any) -> bool:
        spec, shape = var_specs[i], jax.numpy.shape(x)
        if len(spec) > len(shape):
            return False
        for d, names in enumerate(spec):
            if names is not None:
                names = names if isinstance(names, tuple) else (names,)
                size = int(np.prod([mesh.shape[a] for a in names]))
                if shape[d] % size or (squeeze and shape[d] != size):
                    return False
        return True

    def transform(region: Callable, groups: tuple, rngs: tuple, *args: Any, **kwargs: Any) -> Any:
        arg_specs = in_specs if isinstance(in_specs, tuple) else (in_specs,) * len(args)
        reject(any(is_array(x) for x in jax.tree.leaves(kwargs)), name,
               "an array keyword argument has no in_specs entry.",
               "pass it positionally, with its PartitionSpec in in_specs")
        groups, aside = set_aside(groups, fits)

        def strip(x: Any, spec: Any) -> Any:
            sharded = squeeze and spec != PartitionSpec()
            return jax.tree.map(lambda v: v[0], x) if sharded else x

        def add(x: Any, spec: Any) -> Any:
            sharded = squeeze and spec != PartitionSpec()
            return jax.tree.map(lambda v: v[None], x) if sharded else x

        def per_shard(gs, ks, *a):
            index = 0
            for axis in axis_names:
                index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
            ks = tuple({s: jax.random.fold_in(k, index) for s, k in g.items()} if do else g
                       for g, do in zip(ks, split))
            gs = tuple(strip(g, sp) for g, sp in zip(gs, var_specs))
            a = tuple(strip(x, sp) for x, sp in zip(a, arg_specs))
            out, gs_out = region(gs, ks, *a, **kwargs)     # static keyword arguments
            return add(out, out_specs), tuple(add(g, sp) for g, sp in zip(gs_out, var_specs))
        rng_specs = tuple(PartitionSpec() for _ in rngs)
        out, gs_out = jax.shard_map(per_shard, mesh=mesh,
                                    in_specs=(var_specs, rng_specs, *arg_specs),
                                    out_specs=(out_specs, var_specs), check_vma=check_vma)(
            groups, rngs, *args)
        return out, tuple({**a, **g} for a, g in zip(aside, gs_out))

    return apply_to(target, name, lambda fn: lift(
        transform, fn, variables=tuple(f for f, _ in specs), rngs=rng_filters, name=name,
        fix=fix), methods)
