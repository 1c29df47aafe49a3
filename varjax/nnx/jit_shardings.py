"""``nnx.jit``'s ``in_shardings``, ``out_shardings`` and ``static_argnames``, as flax.nnx
0.12.8 takes them, made what object mode's ``jit`` takes.

``in_shardings`` is ``jax.jit``'s prefix over the non-static positional arguments: an
argument's entry is a ``Sharding`` (every Variable of a module, or an array), None
(unspecified), or, for a module, a ``StateSharding`` giving each filter of its state its
own sharding.  A ``StateSharding`` is made the argument's prefix tree (``nnx.prefix`` by its
filters, as ``nnx.shard_map`` makes its ``in_specs``), and static positions get None, so
object mode sees one entry per positional argument; each Variable's update comes back with
its entry's sharding, as flax.nnx's ``jit`` gives an argument's state out with its
``in_shardings``.

``nnx.jit_partial`` passes its bound arguments to object mode's ``jit`` as their nodes, one
positional argument each (``partial_prefix``): a bound argument's entry is broadcast to each
of its nodes, as flax.nnx broadcasts it over the argument's flattened Variables.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import jax
from jax.sharding import PartitionSpec

from varjax.ir import errors
from varjax.ir.typing import Prefix, ShardingLike
from varjax.nnx.filter_maps import StateSharding
from varjax.nnx.prefixes import prefix
from varjax.objects.nodes import is_node
from varjax.trace.variable import Variable

__all__ = ["static_positions", "in_prefix", "needs_graph_updates", "partial_prefix",
           "refuse_state_shardings"]


def _is_sharding_map(x: Any) -> bool:
    return isinstance(x, StateSharding)


def static_positions(fn: Callable, argnums: Any, argnames: Any) -> tuple[tuple[int, ...],
                                                                         tuple[str, ...]]:
    """The static arguments as positions and as names, each completed from the other by
    ``fn``'s signature, as ``jax.jit`` completes them when only one is given (given both,
    ``jax.jit`` would take them as they are and a static name passed by position would be
    traced)."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums or ())
    names = (argnames,) if isinstance(argnames, str) else tuple(argnames or ())
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return nums, names
    positional = [p.name for p in params
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    by_name = [p.name for p in params if p.kind != p.POSITIONAL_ONLY]
    nums += tuple(positional.index(n) for n in names
                  if n in positional and positional.index(n) not in nums)
    names += tuple(positional[i] for i in nums
                   if -len(positional) <= i < len(positional) and positional[i] in by_name
                   and positional[i] not in names)
    return nums, names


def in_prefix(in_shardings: Any, statics: Iterable[int],
              graph_updates: bool) -> Callable[[tuple], Any]:
    """The call's prefix over every positional argument: ``in_shardings`` with None at the
    static positions and each ``StateSharding`` (an argument's entry, or anywhere inside
    one: ``((state_sharding, replicated),)`` for a ``(model, x)`` argument) made the prefix
    tree of the part of the argument it stands for; without graph mode and graph updates a
    ``StateSharding`` is flax.nnx's ``ValueError``."""
    needs_graph_updates("in_shardings", in_shardings, graph_updates)
    if not isinstance(in_shardings, (tuple, list)):
        return lambda args: in_shardings
    entries = list(in_shardings)
    for i in sorted(statics):
        entries.insert(i, None)

    def of(args: tuple) -> tuple:
        if len(entries) != len(args):   # object mode names the mismatch
            return tuple(entries)
        return tuple(_expanded(e, a) for a, e in zip(args, entries))
    return of


def _has_sharding_map(tree: Any) -> bool:
    return any(map(_is_sharding_map, jax.tree.leaves(tree, is_leaf=_is_sharding_map)))


def _expanded(entry: ShardingLike, arg: Any) -> ShardingLike:
    """``entry`` with each ``StateSharding`` in it the prefix tree of the part of ``arg`` it
    stands for (``nnx.prefix`` by its filters)."""
    if _is_sharding_map(entry):
        return prefix(arg, entry.map_prefix)
    if not _has_sharding_map(entry):
        return entry
    return jax.tree.map(lambda e, a: prefix(a, e.map_prefix) if _is_sharding_map(e) else e,
                        entry, arg, is_leaf=lambda x: x is None or _is_sharding_map(x)
                        or isinstance(x, (jax.sharding.Sharding, PartitionSpec)))


def needs_graph_updates(name: str, shardings: ShardingLike, graph_updates: bool) -> None:
    """A ``StateSharding`` in ``shardings`` (``nnx.jit``'s ``name`` option) needs graph mode
    and graph updates, as in flax.nnx, whose ``ValueError`` this is: the module it stands
    for is split by its filters, which a tree-mode call does not do."""
    if not graph_updates and _has_sharding_map(shardings):
        raise ValueError(f"`{name}` cannot contain `StateSharding` objects when "
                         "`graph=False` or `graph_updates=False`: split the module "
                         "(nnx.split(model, filter, ...)) and give its states their own "
                         "shardings, or pass graph=True and graph_updates=True.")


def _per_node(entry: Prefix, arg: Any, position: int) -> list[ShardingLike]:
    """``entry`` (a Sharding, None, or a prefix tree of ``arg``, its leaves Shardings or
    Variables holding one, as ``nnx.get_named_sharding`` gives) broadcast to each node of
    ``arg`` in flattening order."""
    def spread(leaf: Any, sub: Any) -> list[Any]:
        sharding = leaf.value if isinstance(leaf, Variable) else leaf
        return [sharding] * len(jax.tree.leaves(sub, is_leaf=is_node))
    try:
        spread_tree = jax.tree.map(spread, entry, arg, is_leaf=lambda x: x is None or is_node(x))
    except ValueError as e:
        raise errors.ConfigError(
            f"nnx.jit_partial: in_shardings entry {position} is not a prefix of bound "
            f"argument {position} ({type(arg).__name__}): {e}", **errors.where(),
            fix="give a bound argument one Sharding (or None), or a tree of its structure "
                "(nnx.get_named_sharding(model, mesh))") from None
    return jax.tree.leaves(spread_tree, is_leaf=lambda x: x is None)


def partial_prefix(in_shardings: ShardingLike, partial_args: tuple,
                   statics: Iterable[int]) -> Callable[[tuple], Any]:
    """``nnx.jit_partial``'s ``in_shardings`` over object mode's positional arguments (each
    node of the bound arguments, then the call's): a tuple's first ``len(partial_args)``
    entries are the bound arguments', each broadcast to its nodes (``_per_node``), the rest
    the call's; anything else is every argument's, as ``jax.jit`` takes it.  A
    ``StateSharding`` (in or out) is refused before: flax.nnx's ``ValueError``."""
    if not isinstance(in_shardings, (tuple, list)):
        return in_prefix(in_shardings, statics, False)
    bound = len(partial_args)
    if len(in_shardings) < bound:
        raise errors.ConfigError(
            f"nnx.jit_partial: in_shardings has {len(in_shardings)} entries for {bound} bound "
            "arguments.", **errors.where(),
            fix="give one entry per bound argument, then one per argument of the call")
    per_node = [s for i, (entry, arg) in enumerate(zip(in_shardings, partial_args))
                for s in _per_node(entry, arg, i)]
    return in_prefix((*per_node, *in_shardings[bound:]), statics, False)


def refuse_state_shardings(what: str, **options: Any) -> None:
    """flax.nnx's ``ValueError`` for a ``StateSharding`` in ``jit_partial``'s options: the
    bound arguments are flattened to their Variables once, before any filter could split
    them (varjax's ``ConfigError``, also a ``ValueError``)."""
    for name, value in options.items():
        if any(map(_is_sharding_map, jax.tree.leaves(value, is_leaf=_is_sharding_map))):
            raise errors.ConfigError(
                f"`{name}` cannot contain `StateSharding` objects in `{what}`.",
                **errors.where(),
                fix="give each bound module a Sharding, or a tree of its structure "
                    "(nnx.get_named_sharding(model, mesh))")
