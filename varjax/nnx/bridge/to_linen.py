"""``ToLinen``: an NNX module used as a ``varjax.nn`` (Linen) module, and ``to_linen``.

A Linen module is a stateless template; its variables live in collections that ``init``
returns and ``apply`` takes.  So ``ToLinen`` is given the NNX class and its arguments, not
an instance, and makes the NNX module inside each call: with keys from the Linen streams
(``make_rng`` of every stream the call has, as ``nnx.Rngs``), then, outside ``init``,
overwritten with the call's variables.  After the call the module's Variables go back
into the collections their types name (RNG state aside: NNX keeps its streams, Linen
draws anew each call), where those collections may change.
"""
from __future__ import annotations

import functools
import typing as tp
import warnings

from varjax.ir import axis_metadata, errors, streams
from varjax.ir.typing import PyTree
from varjax.nn import compact
from varjax.nn.frozen_dict import FrozenDict
from varjax.nn.module import Module as LinenModule
from varjax.nnx import filterlib, graph, state_ops, traversals, variablelib
from varjax.nnx.bridge.variables import to_linen_var
from varjax.nnx.module import Module
from varjax.trace.rngs import Rngs

__all__ = ["ToLinen", "to_linen"]


class ToLinen(LinenModule):
    """``ToLinen(nnx.Linear, args=(2, 3))``: the NNX module ``nnx_class(*args, **kwargs,
    rngs=...)`` as a Linen module.  ``skip_rng`` for a class that takes no ``rngs``;
    ``metadata_fn`` turns each Variable into its collection entry (None: the bare value)."""

    nnx_class: tp.Callable[..., Module]
    """The NNX module class (or any callable making one) built inside every call."""
    args: tp.Sequence[PyTree] = ()
    """Positional arguments of ``nnx_class``."""
    kwargs: tp.Mapping[str, PyTree] = FrozenDict({})
    """Keyword arguments of ``nnx_class`` (``rngs`` is added unless ``skip_rng``)."""
    skip_rng: bool = False
    """Build the module without ``rngs`` (a class that takes none)."""
    metadata_fn: tp.Callable[[variablelib.Variable], PyTree] | None = to_linen_var
    """Turns each Variable into its Linen collection entry (``to_linen_var``: an ``NNXMeta``
    box where it has metadata; None: the bare value)."""

    @compact
    def __call__(self, *args: tp.Any, nnx_method: tp.Callable[..., PyTree] | str | None = None,
                 **kwargs: tp.Any) -> PyTree:
        module = self.nnx_class(*self.args, **self._module_kwargs())
        method = _method(module, nnx_method)
        if self.is_initializing():     # init keeps the values made, before the call (Flax)
            self._store(module)
            return method(module, *args, **kwargs)
        self._load(module)
        out = method(module, *args, **kwargs)
        self._store(module)
        return out

    def __getattr__(self, name: str) -> PyTree:
        """As flax.nnx's: a keyword argument of ``nnx_class`` by its name
        (``to_linen(NNXDot, 6, out_dim=5).out_dim``), and a method of ``nnx_class`` as this
        module's call of it (``dot.twice(x)`` is ``dot(x, nnx_method=NNXDot.twice)``).
        Dunder names are not forwarded, so copying and pickling see the module's own."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__"):
                raise
        kwargs = self.__dict__.get("kwargs", {})
        if name in kwargs:
            return kwargs[name]
        method = getattr(self.__dict__.get("nnx_class"), name, None)
        if not callable(method):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        bound = functools.partial(self.__call__, nnx_method=method)
        bound.__self__ = self                         # type: ignore[attr-defined]
        return bound

    def _module_kwargs(self) -> dict[str, PyTree]:
        kwargs = dict(self.kwargs)
        if not self.skip_rng:
            names = self.scope.context(self, "bridge.ToLinen").rng_streams
            keys: dict[str, tp.Any] = {name: self.make_rng(name) for name in names}
            if not self.is_initializing():
                # NNX modules draw at construction; outside init those draws are thrown away
                # (the variables overwrite them), so a missing stream gets a fixed seed.
                keys.setdefault(streams.DEFAULT, 0)
            kwargs["rngs"] = Rngs(**keys)
        return kwargs

    def _load(self, module: Module) -> None:
        """Overwrites ``module``'s Variables with this call's variables."""
        states = [axis_metadata.unbox(dict(v), apply_constraint=False)
                  for v in self.variables.values()]
        given = _merged(states)
        known = set(traversals.flatten_mapping(graph.to_pure_dict(graph.state(module))))
        unknown = sorted("/".join(map(str, p)) for p in given if p not in known)
        if unknown:
            warnings.warn("Found unknown module paths in incoming state:"
                          + "".join(f"\n  - {p}" for p in unknown), stacklevel=2)
        graph.update(module, traversals.unflatten_mapping(
            {p: v for p, v in given.items() if p in known}))

    def _store(self, module: Module) -> None:
        """Puts ``module``'s Variables (RNG state aside) into the collections of their types
        that this call may change."""
        state = graph.state(module, filterlib.Not(variablelib.RngState))
        by_collection: dict[str, dict[tuple, tp.Any]] = {}
        for path, var in state_ops.to_flat_state(state):
            name = variablelib.variable_name_from_type(type(var), allow_register=True)
            by_collection.setdefault(name, {})[path] = (
                var.get_value() if self.metadata_fn is None else self.metadata_fn(var))
        for collection, flat in by_collection.items():
            if self.is_mutable_collection(collection):
                for key, value in traversals.unflatten_mapping(flat).items():
                    self.put_variable(collection, key, value)


def _merged(states: list[dict[str, tp.Any]]) -> dict[tuple, tp.Any]:
    flat: dict[tuple, tp.Any] = {}
    for tree in states:
        flat.update(traversals.flatten_mapping(tree))
    return flat


def _method(module: Module, method: tp.Callable[..., PyTree] | str | None) -> tp.Callable:
    """The unbound method ``nnx_method`` names (``__call__`` by default).  A name the class
    lacks is an ``AttributeError``, a value that cannot be called a ``TypeError``, as the
    errors flax.nnx raises."""
    if method is None:
        method = "__call__"
    if isinstance(method, str) and not hasattr(type(module), method):
        raise errors.UnknownMethodError(
            f"nnx_method {method!r} of ToLinen is not an attribute of "
            f"{type(module).__name__}.", **errors.where(),
            fix="pass a method name of the NNX class, or the method itself")
    found = getattr(type(module), method) if isinstance(method, str) else method
    if not callable(found):
        raise errors.NotCallableError(
            f"nnx_method {method!r} of ToLinen is a {type(found).__name__} of "
            f"{type(module).__name__}, not a method.", **errors.where(),
            fix="pass a method name of the NNX class, or the method itself")
    return found


def to_linen(nnx_class: tp.Callable[..., Module], *args: tp.Any,
             metadata_fn: tp.Callable[[variablelib.Variable], PyTree] | None = to_linen_var,
             name: str | None = None, skip_rng: bool = False, abstract_init: bool = True,
             **kwargs: tp.Any) -> ToLinen:
    """``ToLinen(nnx_class, args=args, kwargs=kwargs, ...)``: ``to_linen(NNXDot, 32, 64)``.
    ``abstract_init`` is taken and has no effect, as in flax.nnx 0.12.8 (so it is not
    passed on to ``nnx_class``)."""
    return ToLinen(nnx_class, args=args, kwargs=FrozenDict(kwargs), metadata_fn=metadata_fn,
                   skip_rng=skip_rng, name=name)
