"""Lifted ``cond`` and ``switch``.

Every branch gets the same variable groups; the result carries the union of
what the branches write, and a branch that does not write a variable passes
its value through -- so, beyond Linen, branches may mutate different
variables.  A variable *created* by some branches but not all would exist on
one path only: that raises ``VariableCreationError`` naming the variable and
the branches.  A variable a pass declares beside one handed to the branches (a
LoRA adapter of a kernel made before the cond) is created before the branches
and handed to all of them (``lift(create_outside=True)``, ``pass_scopes.declare``).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from varjax.ir import errors
from varjax.ir.primitives import VarType
from varjax.ir.protocols import LiftableModule
from varjax.ir.typing import ArrayLike, CollectionFilter, Passes, PyTree, StreamFilter
from varjax.lifting.groups import partition
from varjax.lifting.region import lift
from varjax.objects import control_flow as objects
from varjax.trace.context import site
from varjax.trace.type_checks import branch_types_error
from varjax.transforms.common import call_direct, object_call, object_options, unbound


@errors.api_boundary
def cond(pred: ArrayLike, true_fun: Callable, false_fun: Callable,
         mdl: LiftableModule | PyTree, *operands: Any, variables: CollectionFilter = True,
         rngs: StreamFilter = True, passes: Passes = ()) -> PyTree:
    """Lifted ``jax.lax.cond``: ``true_fun(mdl, *operands)`` if ``pred`` else
    ``false_fun(mdl, *operands)`` (without ``mdl`` when it is None).  In object mode
    (``object_call``) JAX's ``cond(pred, true_fun, false_fun, *operands)``.  ``passes``:
    passes run on the branches' IR (``vj.lift``)."""
    if object_call("cond", (mdl, *operands), {}):
        _object_options("cond", variables, rngs)
        return objects.cond(pred, true_fun, false_fun, mdl, *operands, passes=passes)
    index = jnp.asarray(pred).astype(jnp.int32)
    return _branches("cond", index, [false_fun, true_fun], ["false_fun", "true_fun"], mdl,
                     operands, variables, rngs, passes)


@errors.api_boundary
def switch(index: ArrayLike, branches: Sequence[Callable], mdl: LiftableModule | PyTree,
           *operands: Any, variables: CollectionFilter = True,
           rngs: StreamFilter = True, passes: Passes = ()) -> PyTree:
    """Lifted ``jax.lax.switch``: ``branches[index](mdl, *operands)``; in object mode JAX's
    ``switch(index, branches, *operands)``.  ``passes``: as for ``cond``."""
    if object_call("switch", (mdl, *operands), {}):
        _object_options("switch", variables, rngs)
        return objects.switch(index, branches, mdl, *operands, passes=passes)
    return _branches("switch", index, list(branches), [f"branch {i}" for i in range(len(branches))],
                     mdl, operands, variables, rngs, passes)


def _object_options(name: str, variables: Any, rngs: Any) -> None:
    object_options(name, lambda f: f, variables=(variables, True), rngs=(rngs, True))(None)


def _check_creations(name: str, labels: list[str], created: list[set]) -> None:
    """A variable created by some branches only would exist on some paths only."""
    for key in sorted(set().union(*created)):
        makers = [label for label, c in zip(labels, created) if key in c]
        others = [label for label, c in zip(labels, created) if key not in c]
        if others:
            raise errors.VariableCreationError(
                f"variable {errors.format_path(key[1])} is created in {', '.join(makers)} of "
                f"vj.{name} but not in {', '.join(others)}, so after the {name} it would "
                "exist on some paths only.", collection=key[0], path=key[1],
                **site(), fix=f"create it in every branch, or before the {name}")


def _check_types(name: str, first: tuple[str, dict], this: tuple[str, dict]) -> None:
    """Every branch must leave a variable with one type."""
    for key, have in this[1].items():
        want = first[1].get(key, have)
        if want != have:
            raise branch_types_error(f"vj.{name}", key[0], key[1], (first[0], want),
                                     (this[0], have), **site())


def _branches(name: str, index: Any, fns: list[Callable], labels: list[str], mdl: Any,
              operands: tuple, variables: Any, rngs: Any, passes: Any) -> Any:
    def transform(*regions_and_rest: Any) -> Any:
        regions = regions_and_rest[:len(fns)]
        groups, rng_groups, index, *ops = regions_and_rest[len(fns):]
        leaves, rebuild = partition(tuple(ops))
        created: list[set] = []

        # The branches trace in Linen's order -- lax.cond's (true_fun first), lax.switch's
        # (branch 0 first) -- so Linen's draw counts, which run on across branches, match.
        order = [1, 0] if name == "cond" else list(range(len(regions)))

        types: list[tuple[str, dict]] = []      # per branch traced: its label, variable types

        def branch(i: int) -> Callable:
            def run(gs, ks, *arrays):
                out, gs_out = regions[i](gs, ks, *rebuild(arrays))
                created.append({k for g, g_out in zip(gs, gs_out) for k in g_out if k not in g})
                if len(created) == len(regions):
                    _check_creations(name, [labels[i] for i in order], created)
                types.append((f"{labels[i]} ({getattr(fns[i], '__name__', 'fn')})",
                              {k: VarType.of(v) for g in gs_out for k, v in g.items()}))
                _check_types(name, types[0], types[-1])
                return out, gs_out
            return run
        if name == "cond":
            return jax.lax.cond(index != 0, branch(1), branch(0), groups, rng_groups, *leaves)
        return jax.lax.switch(index, [branch(i) for i in range(len(regions))], groups,
                              rng_groups, *leaves)

    lifted = lift(transform, *map(unbound, fns), variables=(variables,), rngs=(rngs,), name=name,
                  passes=passes, create_outside=True)
    return call_direct(lifted, mdl, index, *operands)
