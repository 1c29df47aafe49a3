"""cast-params: compute with ``params`` in a lower precision (mixed precision).

The worked example of ``notes/writing-passes.md``.  Parameters stay stored in
their own dtype; every floating ``params`` read is cast to ``dtype`` (one
``Rule``), and the rewriter is taught autocasting, because lax-level
equations do not promote: an equation mixing float dtypes computes in the
narrowest one, and every region (the function, a loop body, a branch)
returns the dtypes it declared, so loop carries and outputs keep their types;
a value written to a variable is cast back to the dtype the write declared (the
variable's, or its initializer's when the write creates it), so stored variables
never change dtype.
Use as ``vj.functionalize(fn, passes="cast-params{dtype=bfloat16}")``.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import jax.numpy as jnp

from varjax import _jax
from varjax.ir import nested
from varjax.ir.primitives import var_get_p, var_set_p
from varjax.ir.typing import Dtype
from varjax.passes.framework.base import Pass, PassContext, Root, relative_path
from varjax.passes.framework.options import FloatDtype
from varjax.passes.framework.rewrite import Region, Rewriter, Rule


@dataclasses.dataclass(frozen=True)
class CastRead(Rule):
    primitive = var_get_p
    dtype: Any
    roots: tuple[Root, ...] = ()     # the pass's (``Pass.rooted``)

    def match(self, eqn: _jax.JaxprEqn) -> bool:
        return (eqn.params["collection"] == "params"
                and relative_path(self.roots, eqn.params["path"]) is not None)

    def rewrite(self, eqn: _jax.JaxprEqn, invals: list, region: Region) -> list:
        return [_cast(x, self.dtype) for x in region.bind(eqn, invals)]


def _cast(x: Any, dtype: Any) -> Any:
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    return x.astype(dtype) if floating and x.dtype != dtype else x


class Autocast(Rewriter):
    """Narrowest float dtype per first-order equation; declared dtypes at region edges."""

    def eqn(self, eqn: _jax.JaxprEqn, invals: list, region: Region) -> list:
        if nested.bodies(eqn) or eqn.primitive is var_set_p:   # keep declared dtypes
            invals = [_cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)]
        elif self.rule_for(eqn) is None:
            floats = {x.dtype for x in invals if jnp.issubdtype(jnp.result_type(x), jnp.floating)}
            if len(floats) > 1:
                low = min(floats, key=lambda d: (jnp.finfo(d).bits, d.name))
                invals = [_cast(jnp.asarray(x), low) if jnp.result_type(x) in floats else x
                          for x in invals]
        return super().eqn(eqn, invals, region)

    def eval(self, closed: _jax.ClosedJaxpr, args, region: Region) -> list:
        outs = super().eval(closed, args, region)
        return [_cast(o, a.dtype) for o, a in zip(outs, closed.out_avals)]


@dataclasses.dataclass(frozen=True)
class CastParams(Pass):
    """Computes with floating ``params`` cast to ``dtype``; stored values keep their dtype
    (``cast-params{dtype=bfloat16}``: mixed precision)."""

    name = "cast-params"
    summary = "compute with floating params cast to `dtype`"
    before = ("forward-stores", "discharge")
    rootable = True
    dtype: Annotated[Dtype, FloatDtype()] = "bfloat16"   # a name, or a dtype in Python
    """The floating dtype reads are cast to: a name (``bfloat16``) or a dtype."""

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        return Autocast([CastRead(jnp.dtype(self.dtype), self.roots)]).run(jaxpr)
