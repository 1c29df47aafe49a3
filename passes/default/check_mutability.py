"""check-mutability: reject writes to collections that are not mutable.

An analysis pass: when the program's write set (``analysis.traffic``) names an
immutable collection, it walks every equation, nested bodies included, and raises
``ImmutableCollectionError`` at the first ``var_set`` whose collection does
not match ``ctx.mutable``, pointing at the user's line.  It never changes the
IR, so it returns its input.  Collections starting with ``__`` are varjax's
own scratch space (RNG keys and loop counters) and always writable.
"""
from __future__ import annotations

import dataclasses

from varjax import _jax
from varjax.ir import errors, filters
from varjax.ir.nested import enclosing_eqns, walk_eqns
from varjax.ir.primitives import is_internal, var_set_p
from varjax.passes.framework.analysis import traffic
from varjax.passes.framework.base import Pass, PassContext


@dataclasses.dataclass(frozen=True)
class CheckMutability(Pass):
    """Raises ``ImmutableCollectionError`` at a write to a collection the call did not make
    mutable (a default pass; the module docstring says how)."""

    name = "check-mutability"
    summary = "raise on writes to immutable collections"
    rootable = True     # checks the whole program, whatever part it is for

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        # The write set (memoised per jaxpr, discharge reads it too) settles the common
        # case without walking every equation: nothing immutable is written.
        if not any(not is_internal(c) and not filters.matches(ctx.mutable, c)
                   for c, _ in traffic(jaxpr).may_write):
            return jaxpr
        for eqn, _ in walk_eqns(jaxpr):
            if eqn.primitive is not var_set_p:
                continue
            col = eqn.params["collection"]
            if not is_internal(col) and not filters.matches(ctx.mutable, col):
                with errors.enclosing(*(e.source_info for e in enclosing_eqns(jaxpr, eqn))):
                    where = errors.where(eqn.source_info)
                raise errors.ImmutableCollectionError(
                    f"cannot write variable {errors.format_path(eqn.params['path'])}: collection "
                    f"'{col}' is immutable in this call.", collection=col,
                    path=eqn.params["path"], **where,
                    fix=errors.mutable_fix(col))
        return jaxpr
