"""Reading and writing one variable of the running trace: what a ``Variable`` handle does
on ``.value`` and what the variable API (``varjax.trace.variable_api``) builds on.

A variable whose value is a dict is stored as one variable per entry, as a variables dict
nests it, so ``init`` and ``apply`` agree on the keys; these functions hide that split.
Each access passes the context's one access guard, then goes to the context's store (the
IR, normally: ``var_get`` / ``var_set``).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax

from varjax.ir import errors
from varjax.ir.primitives import Key, Path, VarType
from varjax.trace.context import TraceContext, site
from varjax.trace.type_checks import mismatch


def subkeys(ctx: TraceContext, collection: str, path: Path) -> list[Key]:
    """The variables below ``path``: a variable whose value is a dict is stored as one
    variable per entry, as a variables dict nests it (so init and apply agree)."""
    n = len(path)
    return [k for k in ctx.variables if k[0] == collection and len(k[1]) > n and k[1][:n] == path]


def exists(ctx: TraceContext, collection: str, path: Path) -> bool:
    return (collection, path) in ctx.variables or bool(subkeys(ctx, collection, path))


def read_value(ctx: TraceContext, collection: str, path: Path) -> Any:
    """The variable's value (a dict of its entries for a dict-valued one)."""
    ctx.guard(collection, path)
    vt = ctx.variables.get((collection, path))
    if vt is None:                       # a dict-valued variable: read its entries
        value: dict[str, Any] = {}
        for _, sub in sorted(subkeys(ctx, collection, path)):
            node = value
            for name in sub[len(path):-1]:
                node = node.setdefault(name, {})
            node[sub[-1]] = read_value(ctx, collection, sub)
        return value
    return ctx.store.read(ctx, collection, path, vt)


def write_value(ctx: TraceContext, collection: str, path: Path, value: Any) -> None:
    """Store ``value`` as the variable (creating it); mutability is the caller's check."""
    ctx.guard(collection, path)
    if isinstance(value, Mapping) and value:
        for name, entry in value.items():   # stored as the variables dict nests it
            write_value(ctx, collection, path + (str(name),), entry)
        return
    leaves, tree = jax.tree.flatten(value)
    leaves = [jax.numpy.asarray(x) for x in leaves]
    vt = VarType.of_leaves(tree, leaves)
    pending = ctx.pending.pop((collection, path), None)
    if pending is not None and mismatch(ctx.given[(collection, path)], vt) is not None:
        raise pending     # the code neither keeps the given shape nor gets the one it expects
    ctx.set_type((collection, path), vt)
    ctx.store.write(ctx, collection, path, leaves, tree)


def missing_error(ctx: TraceContext, collection: str, path: Path, why: str) -> errors.MissingVariableError:
    return errors.MissingVariableError(
        f"variable {errors.format_path(path)!s} of collection '{collection}' does not exist "
        f"and {why}.", collection=collection, path=path, **site(ctx),
        fix=f"pass it in the variables dict, or run init / apply with mutable=['{collection}'] "
            "so it can be created")


def read_at(ctx: TraceContext, collection: str, path: Path) -> Any:
    """The variable's current value; ``MissingVariableError`` if it does not exist."""
    ctx.guard(collection, path)
    if not exists(ctx, collection, path):
        raise missing_error(ctx, collection, path, "it was never created in this trace")
    return read_value(ctx, collection, path)
