"""``Functional``: an NNX module class with Linen's two-step life, ``init`` then ``apply``.

For code that wants an NNX module's state as a value it passes around (as Linen's
variables are) rather than a module it holds: ``functional(Linear)(2, 3)`` makes nothing
until ``init(rngs=...)``, which builds the module and returns its state; ``apply(state)``
is ``GraphDef.apply``, ``(out, (graphdef, state))`` of a call.
"""
from __future__ import annotations

import dataclasses
import typing as tp

from varjax.ir import errors
from varjax.nnx import graph
from varjax.nnx.graphlib import ApplyCaller
from varjax.nnx.module import Module
from varjax.nnx.statelib import State
from varjax.trace.rngs import Rngs

__all__ = ["Functional", "functional"]

M = tp.TypeVar("M", bound=Module)


@dataclasses.dataclass
class Functional(tp.Generic[M]):
    """An NNX class and its arguments; ``graphdef`` is known once ``init`` has run."""

    module_type: type[M]
    graphdef: graph.GraphDef | None
    args: tuple[tp.Any, ...]
    kwargs: dict[str, tp.Any]

    def init(self, *, rngs: Rngs | None = None) -> State:
        """Builds the module (with ``rngs`` if given) and returns its state."""
        extra = {} if rngs is None else {"rngs": rngs}
        self.graphdef, state = graph.split(self.module_type(*self.args, **self.kwargs, **extra))
        return state

    def apply(self, *states: State) -> ApplyCaller:
        """``graphdef.apply(*states)``: call it with the inputs for ``(out, (graphdef,
        state))``."""
        if self.graphdef is None:
            raise errors.ConfigError(
                f"Functional({self.module_type.__name__}).apply before init: its module "
                "has not been built.", **errors.where(), fix="call .init(rngs=...) first")
        return self.graphdef.apply(*states)


def functional(cls: type[M]) -> tp.Callable[..., Functional[M]]:
    """``functional(Linear)(2, 3)``: a ``Functional`` of ``cls`` with those arguments."""
    def make(*args: tp.Any, **kwargs: tp.Any) -> Functional[M]:
        return Functional(cls, None, args, kwargs)
    return make
