"""``ToNNX``: a ``varjax.nn`` (Linen) module used as an NNX module, and ``lazy_init``.

A Linen module makes its variables when it first sees an input (``init``); an NNX module
owns them as attributes.  ``ToNNX`` holds the Linen module and an ``Rngs`` fork, and
``lazy_init(model, x)`` runs the model once with every ``ToNNX`` in it initializing: each
one calls the Linen module's ``init_with_output`` with keys drawn from its streams and keeps
the variables as NNX Variables (``bridge.variables``), one attribute per top-level name.
After that a call is the Linen module's ``apply`` over those Variables, and the
collections it is allowed to change (``mutable``) come back into them.
"""
from __future__ import annotations

import functools
import typing as tp
import warnings

import jax

from varjax.ir import errors, streams
from varjax.ir.typing import CollectionFilter, PyTree
from varjax.nn.module import Module as LinenModule
from varjax.nn.module.lifecycle import module_stack
from varjax.nnx import state_ops, traversals
from varjax.nnx.bridge.variables import linen_vars_to_nnx_attrs, nnx_attrs_to_linen_vars
from varjax.nnx.module import Module
from varjax.nnx.pytree import data
from varjax.nnx.variablelib import Variable
from varjax.trace.rngs import Rngs

__all__ = ["ToNNX", "lazy_init"]

# The static attribute marking a ToNNX that ``lazy_init`` is initializing.  A mark on the
# objects of ``fn``'s graph, not a flag of the call, so a ToNNX from outside that graph
# (a trained model passed as an argument) keeps its variables; static, so the copies a
# transform inside ``fn`` rebuilds from the graph carry it (flax.nnx's ``initializing``).
_INITIALIZING = "_to_nnx__initializing"

F = tp.TypeVar("F", bound=tp.Callable[..., PyTree])


def _set_initializing(module: Module, initializing: bool) -> None:
    for _, node in state_ops.iter_graph(module, graph=True):
        if isinstance(node, ToNNX):
            if initializing:
                setattr(node, _INITIALIZING, True)
            elif _INITIALIZING in vars(node):
                delattr(node, _INITIALIZING)


def lazy_init(fn: F, *args: tp.Any, **kwargs: tp.Any) -> F:
    """Calls ``fn`` (an NNX module, or a bound method of one) once on a sample input with
    every ``ToNNX`` of its module's graph initializing, so each creates its Linen variables;
    returns ``fn``.  This is where Linen code calls ``module.init``."""
    module = fn if isinstance(fn, Module) else getattr(fn, "__self__", None)
    if not isinstance(module, Module):
        raise errors.ConfigError(
            f"lazy_init takes an NNX module or a method of one, not {type(fn).__name__}.",
            **errors.where(), fix="bridge.lazy_init(model, x) or bridge.lazy_init(model.method, x)")
    _set_initializing(module, True)
    try:
        fn(*args, **kwargs)
    finally:
        _set_initializing(module, False)
    return fn


def _enclosing_mutable() -> CollectionFilter:
    """The collections the Linen call around this one may change (its ``mutable``), as a
    ToNNX inside a Linen module (or a ToLinen) defaults to; False outside any."""
    stack = module_stack()
    scope = stack[-1].scope if stack else None
    if scope is None:
        return False
    if scope.eager():
        return scope.root.mutable
    return scope.context(stack[-1], "bridge.ToNNX").mutable


def _keys(rngs: Rngs | jax.Array | None) -> dict[str, jax.Array]:
    """One key per stream, for Linen's ``rngs`` (NNX's ``default`` is Linen's ``params``)."""
    if isinstance(rngs, Rngs):
        keys = {name: rngs[name]() for name in rngs}
    elif rngs is not None:
        keys = {streams.PARAMS: rngs}
    else:
        keys = {}
    if streams.PARAMS not in keys and streams.DEFAULT in keys:
        keys[streams.PARAMS] = keys.pop(streams.DEFAULT)
    return keys


class ToNNX(Module):
    """A Linen module as an NNX module: ``ToNNX(nn.Dense(4), rngs=nnx.Rngs(0))``, then
    ``lazy_init(model, x)``; its variables are its attributes (``model.kernel``)."""

    def __init__(self, module: LinenModule, rngs: Rngs | jax.Array | None = None):
        self.to_nnx__module = module
        self.to_nnx__rngs = (Rngs(params=rngs) if isinstance(rngs, jax.Array)
                             else rngs.fork() if isinstance(rngs, Rngs) else rngs)

    @property
    def rngs(self) -> Rngs | None:
        """Deprecated (as in flax.nnx): ``to_nnx__rngs``."""
        warnings.warn("`ToNNX.rngs` is deprecated. Please use `to_nnx__rngs` instead.",
                      DeprecationWarning, stacklevel=2)
        return self.to_nnx__rngs

    @property
    def module(self) -> LinenModule:
        """Deprecated (as in flax.nnx): ``to_nnx__module``."""
        warnings.warn("`ToNNX.module` is deprecated. Please use `to_nnx__module` instead.",
                      DeprecationWarning, stacklevel=2)
        return self.to_nnx__module

    def lazy_init(self, *args: tp.Any, **kwargs: tp.Any) -> ToNNX:
        """``bridge.lazy_init(self, *args, **kwargs)``."""
        return lazy_init(self, *args, **kwargs)

    def __getattr__(self, name: str) -> tp.Callable[..., PyTree]:
        """The Linen module's other methods, run as ``apply(..., method=...)``."""
        method = getattr(type(self.__dict__.get("to_nnx__module")), name, None)
        if name.startswith("_") or not callable(method):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        bound = functools.partial(self.__call__, method=method)
        bound.__self__ = self
        return bound

    def __call__(self, *args: tp.Any, rngs: Rngs | jax.Array | None = None,
                 method: tp.Callable[..., PyTree] | str | None = None,
                 mutable: CollectionFilter | None = None, **kwargs: tp.Any) -> PyTree:
        """The Linen module's ``init_with_output`` inside ``lazy_init``, else its ``apply``
        over this module's Variables; ``mutable`` as in Linen's ``apply`` (None: the
        enclosing Linen call's, or False outside one)."""
        keys = _keys(self.to_nnx__rngs if rngs is None else rngs)
        linen = self.to_nnx__module
        if self.__dict__.get(_INITIALIZING, False):
            out, updates = linen.init_with_output(keys, *args, method=method, **kwargs)
        else:
            if mutable is None:
                mutable = _enclosing_mutable()
            variables = nnx_attrs_to_linen_vars(self._linen_attrs())
            try:
                out = linen.apply(variables, *args, rngs=keys, method=method, mutable=mutable,
                                  **kwargs)
            except errors.MissingVariableError as e:
                if variables:
                    raise
                raise errors.MissingVariableError(
                    f"ToNNX({type(linen).__name__}) has no variables yet: a Linen module makes "
                    f"them from a sample input ({e.what})", collection=e.collection, path=e.path,
                    **errors.where(),
                    fix="call bridge.lazy_init(model, x) once first, as Linen calls init") from e
            out, updates = out if mutable is not False else (out, None)
        if updates:
            self._take(linen_vars_to_nnx_attrs(updates))
        return out

    def _linen_attrs(self) -> dict[str, PyTree]:
        return {k: v for k, v in vars(self).items()
                if not k.startswith(("to_nnx__", "_"))}

    def _take(self, attrs: dict[str, PyTree]) -> None:
        """Writes the Variables a Linen call returned: an existing Variable of the same type
        keeps its identity and takes the value; new names and paths become attributes."""
        for name, new in attrs.items():
            old = self.__dict__.get(name)
            if isinstance(new, dict) and isinstance(old, dict):
                flat_old = traversals.flatten_mapping(old)
                flat_new = traversals.flatten_mapping(new)
                added = {p: v for p, v in flat_new.items() if not _same_kind(flat_old.get(p), v)}
                for path, var in flat_new.items():
                    if path not in added:
                        flat_old[path].set_value(var.get_value())
                if added:
                    setattr(self, name, data(traversals.unflatten_mapping({**flat_old, **added})))
            elif _same_kind(old, new):
                old.set_value(new.get_value())
            else:
                setattr(self, name, data(new))


def _same_kind(old: tp.Any, new: Variable) -> bool:
    return isinstance(old, Variable) and type(old) is type(new) and \
        old.get_metadata() == new.get_metadata()
