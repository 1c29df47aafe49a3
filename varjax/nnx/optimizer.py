"""``nnx.Optimizer`` and ``nnx.ModelAndOptimizer``: an Optax transformation's state kept as
Variables of an NNX object, so a train step under ``nnx.jit`` updates it in place.

The optimizer is an ``nnx.Pytree`` whose ``step`` and ``opt_state`` leaves are ``OptState``
Variables (``OptVariable`` for the state of a Variable, carrying its metadata;
``OptArray`` for a bare array such as Adam's count), laid out as flax.nnx lays them out,
so ``nnx.state(optimizer)`` has flax.nnx's paths and values.  ``update`` hands Optax plain
arrays and writes the results back into the model's and the optimizer's Variables: eagerly
those are held values; inside a transform they are handles, and each write is a
``var_set`` of the trace, which the transform returns to the caller's objects.

``graph`` is flax.nnx's: ``False`` reads the model and the gradient as
trees (tree mode), so a Variable reached at two paths is refused with an
``InconsistentAliasError`` naming both, as flax.nnx refuses it; ``None`` (the default) is read
from ``nnx.set_graph_mode`` at each ``nnx.state`` call, construction and every ``update``
alike, so an optimizer made in graph mode follows the setting it is updated under.

Optax is the user's: the transformation object is passed in, and nothing here imports it,
so varjax does not depend on it.  ``optax.apply_updates`` is two lines, written out below.
"""
from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

import jax
import jax.numpy as jnp

from varjax.ir import errors
from varjax.ir.typing import Filter, PyTree
from varjax.nnx.graph import state, update
from varjax.nnx.pytree import Pytree, data
from varjax.nnx.statelib import State
from varjax.nnx.variablelib import OptState, Param
from varjax.trace.variable import Variable

__all__ = ["Optimizer", "ModelAndOptimizer", "OptState", "OptArray", "OptVariable",
           "to_opt_state", "GradientTransformation"]

M = TypeVar("M")


class GradientTransformation(Protocol):
    """What ``tx`` must be: an Optax transformation (``optax.adam(1e-3)``), or any object
    with its ``init`` and ``update``.  A protocol rather than Optax's own class, because
    varjax does not import Optax."""

    def init(self, params: PyTree) -> PyTree:
        """The optimizer state for ``params``."""

    def update(self, updates: PyTree, state: PyTree, params: PyTree | None = None,
               **extra_args: Any) -> tuple[PyTree, PyTree]:
        """``(updates, new_state)`` for the gradient ``updates``."""


class OptArray(OptState, collection="OptArray"):
    """Optimizer state of a bare array (Adam's step ``count``)."""

    __slots__ = ()


class OptVariable(OptState, collection="OptVariable"):
    """Optimizer state of a Variable (Adam's moments of a ``Param``), with its metadata."""

    __slots__ = ()


def _is_variable(x: Any) -> bool:
    return isinstance(x, Variable)


def _values(tree: Any) -> Any:
    """``tree`` with each Variable replaced by its value: what Optax computes on."""
    return jax.tree.map(lambda v: v.value if isinstance(v, Variable) else v, tree,
                        is_leaf=_is_variable)


def to_opt_state(tree: PyTree) -> PyTree:
    """Each leaf of ``tree`` as an ``OptState`` Variable: a Variable's value as an
    ``OptVariable`` with its metadata (``optimizer_sharding`` becoming ``out_sharding``),
    any other leaf as an ``OptArray``."""
    def one(x: Any) -> OptState:
        if not isinstance(x, Variable):
            return OptArray(x)
        metadata = x.get_metadata()
        if "optimizer_sharding" in metadata:
            metadata["out_sharding"] = metadata.pop("optimizer_sharding")
        return OptVariable(x.value, **metadata)
    return jax.tree.map(one, tree, is_leaf=_is_variable)


def _apply_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates``: each parameter plus its update, in the parameter's dtype."""
    return jax.tree.map(
        lambda p, u: None if p is None else jnp.asarray(p + u).astype(jnp.asarray(p).dtype),
        params, updates, is_leaf=lambda x: x is None)


def _same_paths(params: Any, grads: Any) -> None:
    """The gradient must give one leaf per variable the optimizer updates: Optax would
    otherwise fail later with a tree-structure error that names no variable."""
    have, want = set(grads.flat()), set(params.flat())
    wrong = [(p, "is missing") for p in sorted(want - have, key=str)] + \
        [(p, "is for no variable the optimizer updates") for p in sorted(have - want, key=str)]
    if wrong:
        path, what = wrong[0]
        raise errors.InvalidVariablesError(
            f"Optimizer.update: the gradient at {'/'.join(map(str, path))} {what}.",
            path=tuple(map(str, path)), **errors.where(),
            fix="pass the gradient of the variables wrt selects (nnx.grad(loss)(model, ...) "
                "for wrt=nnx.Param)")


_MISSING: Any = object()
"""``update``'s default for ``grads``: its absence is the pre-0.11 call ``update(grads)``."""


class Optimizer(Pytree, Generic[M]):
    """An Optax transformation and its state, for the variables of a model that ``wrt``
    selects; ``update(model, grads)`` applies one step to the model in place.

    ``step`` (an ``OptState``, uint32) counts the updates; ``opt_state`` is
    ``tx.init`` of the selected variables with each leaf an ``OptState`` Variable; ``tx``
    and ``wrt`` are static.  The model is not held (``ModelAndOptimizer`` holds it).
    ``graph`` (static) is how the model and gradient are read: ``True`` graph mode,
    ``False`` tree mode, ``None`` the current ``nnx.set_graph_mode``."""

    def __init__(self, model: M, tx: GradientTransformation, *, wrt: Filter,
                 graph: bool | None = None):
        self.graph = graph
        self.step = OptState(jnp.array(0, dtype=jnp.uint32))
        self.tx = tx
        self.opt_state = data(to_opt_state(tx.init(state(model, wrt, graph=graph))))
        self.wrt = wrt

    def __getattr__(self, name: str) -> Any:
        # Only for names not found: flax.nnx's Optimizer stopped holding the model in 0.11.
        if name == "model":
            raise AttributeError(
                f"{type(self).__name__} does not hold the model (as flax.nnx's since 0.11): "
                "pass it to update(model, grads), or use nnx.ModelAndOptimizer")
        raise AttributeError(name)

    def update(self, model: M, grads: State = _MISSING, /, **kwargs: Any) -> PyTree:
        """Applies one Optax step: ``tx.update`` of ``grads`` (the gradient of the
        variables ``wrt`` selects, as ``nnx.grad`` returns it), the updates added to the
        model's variables and the new state written into ``opt_state``, ``step`` + 1.
        ``kwargs`` go to ``tx.update`` (``GradientTransformationExtraArgs``).  Returns
        the updates."""
        if grads is _MISSING:
            # flax.nnx's pre-0.11 call, update(grads), is the porting mistake: say so.
            raise errors.InvalidVariablesError(
                f"{type(self).__name__}.update takes (model, grads) since flax.nnx 0.11; it "
                "was given one argument.", **errors.where(),
                fix="pass update(model, grads), or hold the model in nnx.ModelAndOptimizer, "
                    "whose update(grads) takes the gradient alone")
        params = state(model, self.wrt, graph=self.graph)
        grads = state(grads, self.wrt, graph=self.graph)
        _same_paths(params, grads)
        param_values = _values(params)
        updates, new_opt_state = self.tx.update(_values(grads), _values(self.opt_state),
                                                param_values, **_values(kwargs))
        update(model, _apply_updates(param_values, updates))
        leaves, treedef = jax.tree.flatten(self.opt_state, is_leaf=_is_variable)
        for variable, value in zip(leaves, treedef.flatten_up_to(new_opt_state)):
            variable.value = value
        self.step[...] += 1
        return updates


class ModelAndOptimizer(Optimizer[M]):
    """An ``Optimizer`` that holds its model (``self.model``), so ``update(grads)`` takes
    only the gradient: flax.nnx's form of before 0.11, deprecated there.  It takes no
    ``graph``, as flax.nnx's: the current ``nnx.set_graph_mode`` decides."""

    def __init__(self, model: M, tx: GradientTransformation, *, wrt: Filter = Param):
        super().__init__(model, tx, wrt=wrt)
        self.model = model

    def update(self, grads: State, /, **kwargs: Any) -> PyTree:  # type: ignore[override]
        return super().update(self.model, grads, **kwargs)
