"""stop-gradient: no gradient flows into the variables of one collection (freeze it).

Every ``var_get`` of ``collection`` -- at any depth, in ``init`` as in ``apply`` -- is
followed by ``lax.stop_gradient``, so the pure function's derivative with respect to
those variables is zero while their values, and everything else, are unchanged.
``under=Encoder`` narrows it to the variables under one module path (``/``-separated
names), to freeze part of a model.  Writes are left alone: a collection updated in
place (``batch_stats``) keeps updating.  ``notes/pass-library.md`` shows the IR.

Use as ``vj.functionalize(fn, passes="stop-gradient{collection=params}")``.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import jax

from varjax import _jax
from varjax.ir.primitives import Path, var_get_p
from varjax.passes.framework.base import Pass, PassContext, Root, relative_path
from varjax.passes.framework.options import (
    Name,
    VariablePath,
    check_collection,
    given_variables,
    program_variables,
    unmatched,
)
from varjax.passes.framework.rewrite import Region, Rewriter, Rule


def split_path(text: str) -> Path:
    """``"Dense_0/kernel"`` as a variable path: ``("Dense_0", "kernel")``; ``""`` is ``()``."""
    return tuple(name for name in text.split("/") if name)


class ReadRewriter(Rewriter):
    """A rewriter whose rules replace reads on their own: each rewrite depends only on
    the equation, so a top-level read is spliced in place without re-tracing."""

    local = True


@dataclasses.dataclass(frozen=True)
class StopGradientRead(Rule):
    primitive = var_get_p
    collection: str
    under: Path = ()
    roots: tuple[Root, ...] = ()     # the pass's (``Pass.rooted``); ``under`` is relative

    def match(self, eqn: _jax.JaxprEqn) -> bool:
        p = eqn.params
        if p["collection"] != self.collection:
            return False
        path = relative_path(self.roots, p["path"])
        return path is not None and path[:len(self.under)] == self.under

    def rewrite(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        return [jax.lax.stop_gradient(x) for x in region.bind(eqn, invals)]


@dataclasses.dataclass(frozen=True)
class StopGradient(Pass):
    """Reads of ``collection`` (under the module path ``under``) carry no gradient
    (``stop-gradient{collection=params}``: freeze them)."""

    name = "stop-gradient"
    summary = "reads of `collection` (under the module path `under`) carry no gradient"
    # In init a parameter is read back after it is created; forward-stores would turn
    # that read into the created value before this pass saw it.
    before = ("forward-stores", "discharge")
    rootable = True
    collection: Annotated[str, Name()]
    """The collection whose reads carry no gradient."""
    under: Annotated[str, VariablePath(empty=True)] = ""
    """A ``/``-separated module path: only variables under it are frozen (``''``: all)."""

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        under = split_path(self.under)
        check_collection(self, "collection", self.collection, jaxpr, ctx)
        self._check_under(under, jaxpr, ctx)
        return ReadRewriter([StopGradientRead(self.collection, under, self.roots)]).run(jaxpr)

    def _check_under(self, under: Path, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> None:
        """``under`` must hold a variable of ``collection`` (a typo freezes nothing)."""
        if ctx.region or not under or any(c == self.collection and p[:len(under)] == under
                                          for c, p in given_variables(self, ctx)):
            return
        paths = [p for c, p in program_variables(self, jaxpr, ctx) if c == self.collection]
        if not any(p[:len(under)] == under for p in paths):
            scopes = sorted({"/".join(p[:len(under)]) for p in paths})
            raise unmatched(self, f"under={self.under}",
                            f"holds no variable of collection '{self.collection}'",
                            f"module paths of '{self.collection}' at that depth", scopes)
