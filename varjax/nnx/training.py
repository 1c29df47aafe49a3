"""``nnx.TrainState``: the functional way to train an NNX model, a frozen pytree holding a
split model's ``GraphDef``, its ``params`` (a ``State``), an Optax transformation ``tx`` and
its state, and the step.

It is what flax.nnx 0.12.8 keeps from Flax Linen's ``TrainState`` for code written around
``nnx.split``: the model's state lives outside the model, goes through ``jax.jit``/
``jax.grad`` as a plain pytree, and ``apply_gradients`` returns a new ``TrainState``
(``nnx.Optimizer`` is the in-place way).  A subclass adds fields by annotating them (a
subclass is made a frozen dataclass and a pytree when it is defined, as a Flax
``struct.PyTreeNode`` is); a field made with ``nnx.static()`` is static, part of the
treedef, as ``graphdef`` and ``tx`` are.  varjax does not import Optax: ``tx`` is the
user's, and its updates are applied as ``nnx.Optimizer`` applies them.

This module is also ``nnx.training``, flax.nnx's training package: its ``metrics`` and
``optimizer`` are varjax.nnx's modules of those names (flax.nnx's ``ema`` is not built).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp

from varjax.ir import errors
from varjax.ir.typing import PyTree
from varjax.nnx import metrics, optimizer
from varjax.nnx.graphlib import ApplyCaller, GraphDef
from varjax.nnx.optimizer import GradientTransformation, _apply_updates
from varjax.nnx.pytree import static
from varjax.nnx.statelib import State

__all__ = ["TrainState", "metrics", "optimizer"]

M = TypeVar("M")
TS = TypeVar("TS", bound="TrainState")


def _as_pytree_dataclass(cls: type) -> type:
    """``cls`` as a frozen dataclass registered with JAX: fields marked ``static`` in the
    treedef, the others children."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    jax.tree_util.register_dataclass(
        cls, data_fields=[f.name for f in fields if not f.metadata.get("static")],
        meta_fields=[f.name for f in fields if f.metadata.get("static")])
    return cls


class TrainState(Generic[M]):
    """A split model's ``graphdef`` and ``params``, the Optax transformation ``tx``, its
    ``opt_state`` and the ``step``; ``create`` makes one, ``apply_gradients`` steps it."""

    graphdef: GraphDef = static()
    params: State
    opt_state: PyTree
    step: jax.Array
    tx: GradientTransformation = static()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _as_pytree_dataclass(cls)

    @classmethod
    def create(cls: type[TS], graphdef: GraphDef, *, params: State, tx: GradientTransformation, step: int = 0,
               **kwargs: Any) -> TS:
        """A ``TrainState`` at ``step`` whose optimizer state is ``tx.init(params)``;
        ``kwargs`` fill a subclass's fields."""
        return cls(graphdef=graphdef, params=params, opt_state=tx.init(params),
                   step=jnp.asarray(step), tx=tx, **kwargs)

    def replace(self: TS, **changes: Any) -> TS:
        """A copy with ``changes`` to its fields."""
        return dataclasses.replace(self, **changes)

    def apply(self, state: State | str, *states: State | str) -> ApplyCaller:
        """``graphdef.apply`` of the states (a ``State``, or the name of a field holding one:
        ``apply('params')``): calling it, or a method on it, returns
        ``(out, (graphdef, state))``."""
        return self.graphdef.apply(*(self._state(s) for s in (state, *states)))

    def _state(self, state: State | str) -> State:
        if not isinstance(state, str):
            return state
        found = getattr(self, state)
        if not isinstance(found, State):
            raise errors.InvalidVariablesError(
                f"{type(self).__name__}.apply('{state}'): the field '{state}' holds a "
                f"{type(found).__name__}, not a State.", path=(state,), **errors.where(),
                fix="name a field holding a State (apply('params')), or pass the State")
        return found

    def apply_gradients(self: TS, grads: State, **kwargs: Any) -> TS:
        """The next ``TrainState``: ``tx``'s update of ``params`` by ``grads`` applied,
        its new state, ``step + 1``; ``kwargs`` replace other fields."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(params=_apply_updates(self.params, updates), opt_state=opt_state,
                            step=self.step + 1, **kwargs)


_as_pytree_dataclass(TrainState)
