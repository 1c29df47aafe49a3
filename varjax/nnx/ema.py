"""``nnx.EMA``: an exponential moving average of a model's Variables (flax.nnx's
``training/ema.py``).

``EMA(model, decay, only=filter)`` holds a ``State`` of new Variables, copies of the
selected ones (same type and metadata, so the same paths and collections), as its data
attribute ``params``: an ``nnx.jit`` train step taking the ``EMA`` writes ``update``'s
blends back to it.  ``apply_to(model)`` merges the model's structure over those Variables,
so the evaluation model it returns reads the averages themselves and follows later updates
without being rebuilt.  The blend is ``functional.normalization.ema``, the running average
BatchNorm keeps too (in the promoted dtype, cast to the average's when written, as
flax.nnx's).
"""
from __future__ import annotations

from typing import TypeVar

import jax.numpy as jnp

from varjax.functional.normalization import ema
from varjax.ir import errors
from varjax.ir.typing import Filter, Node, PathParts
from varjax.nnx.graph import merge, split, state
from varjax.nnx.pytree import Pytree, data
from varjax.nnx.state_ops import merge_state
from varjax.nnx.statelib import State
from varjax.trace.variable import Variable

__all__ = ["EMA"]

M = TypeVar("M")


def _path_text(path: PathParts) -> str:
    return "/".join(map(str, path))


def _ema_copy(path: PathParts, leaf: object) -> Variable:
    """A new Variable of ``leaf``'s type and metadata over a copy of its value; a plain
    array in the state (an ``nnx.data`` attribute) has no type to keep."""
    if not isinstance(leaf, Variable):
        raise errors.InvalidVariablesError(
            f"EMA tracks Variables only, got a {type(leaf).__name__} at '{_path_text(path)}'.",
            path=tuple(map(str, path)), **errors.where(),
            fix="select Variables with EMA's `only` filter (only=nnx.Param)")
    return leaf.replace(jnp.copy(leaf.get_value()))


class EMA(Pytree):
    """``params``: copies of ``node``'s Variables that ``only`` selects, each moved by
    ``update(new)`` to ``decay * average + (1 - decay) * new``.

    ``graph`` is the graph functions' ``graph=`` (None: the current ``nnx.set_graph_mode``).
    """

    def __init__(self, params: Node, decay: float, *, only: Filter = ...,
                 graph: bool | None = None):
        self.graph, self.decay, self.filter = graph, decay, only
        self.params: State = data(state(params, only, graph=graph).map(_ema_copy))

    def update(self, updates: Node) -> None:
        """Blends the Variables of ``updates`` (the model, or a state of the structure
        given at construction) into the averages, in place."""
        averages = self.params.flat()
        news = state(updates, self.filter, graph=self.graph).flat()
        if averages.keys() != news.keys():
            differ = sorted(averages.keys() ^ news.keys(), key=str)[0]
            raise errors.ConfigError(
                f"EMA.update: the Variable at '{_path_text(differ)}' is in only one of the "
                "averages and the update.", path=tuple(map(str, differ)), **errors.where(),
                fix="pass a model of the structure the EMA was made from")
        for path, average in averages.items():
            average[...] = ema(average[...], news[path][...], self.decay)

    def apply_to(self, model: M) -> M:
        """A new object of ``model``'s structure whose tracked Variables are the averages
        themselves (the rest are ``model``'s)."""
        graphdef, current = split(model, graph=self.graph)
        return merge(graphdef, merge_state(current, self.params))
