"""A stream's key and count as NNX sees them: ``RngKey``/``RngCount`` Variables that read
and write the stream.

flax.nnx's ``RngStream`` keeps its key and count in an ``RngKey`` and an ``RngCount``
Variable tagged with the stream's name; that is how filters (``nnx.RngState``,
``nnx.RngKey``, ``nnx.RngCount``, a stream name such as ``'dropout'``) select random state
and how ``split``/``merge``/``update`` carry it.  varjax's stream (``vj.RngStream``) keeps
plain arrays, as the object core and the Linen frontend draw from it, so the NNX walk
(``pytree.flatten_node``) presents each field as a *view*: a Variable of NNX's type whose
value is the stream's field, read and written through.  A stream has one pair of views for
as long as it lives, so ``nnx.state(model)`` twice holds the same Variables (as flax.nnx's
does) and an object-mode transform given them sees one cell per field.

A view copied by JAX (``jax.tree.map`` over a state) or by ``clone`` is a plain held
Variable of its NNX type (``plain_type``): only the walk makes views.

``merge`` goes the other way: a stream rebuilt from a state's two Variables (views of
another stream, or plain ones: a clone's, the parts a transform hands its body) is a
``VariableStream`` holding those Variables, so a draw from the merged module writes the
state's ``RngCount``, as flax.nnx's merged stream holds the state's Variables, and
``nnx.state`` of the merged module gives them back.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

from varjax.nnx.variablelib import RngCount, RngKey
from varjax.trace.rngs import RngStream
from varjax.trace.variable import Variable, collection_of, held

__all__ = ["stream_variables", "stream_children", "StreamDef", "VariableStream", "plain_type",
           "FIELDS"]

FIELDS = ("key", "count")
"""A stream's fields, in the order its pytree flattens them."""


def _field(name: str) -> property:
    """The ``value`` of a view: the stream's field ``name`` (a held copy or an object-mode
    handle, which has no stream, is an ordinary Variable)."""
    def get(self: Variable) -> Any:
        stream = getattr(self, "_stream", None)
        if stream is None or self.path is not None:
            return Variable.value.fget(self)
        return getattr(stream, name)

    def set_(self: Variable, new: Any) -> None:
        stream = getattr(self, "_stream", None)
        if stream is None or self.path is not None:
            Variable.value.fset(self, new)
        elif name == "key":    # keeps the stream's kind of key; refused inside a transform
            stream._varjax_replace(new, stream.count)
        else:
            stream.count = new
    return property(get, set_)


def _identity(name: str) -> Any:
    """A view's identity as a variable of a transform's graph: its stream's field, so a
    stream and the views of it (an ``nnx.state`` passed beside its module) are one."""
    def identity(self: Variable) -> Any:
        stream = getattr(self, "_stream", None)
        return Variable._varjax_identity(self) if stream is None else \
            stream._varjax_identity(name)
    return identity


def _repr(self: Variable) -> str:
    """Shown as the Variable of NNX's type it stands for, with the stream's value."""
    return repr(held(plain_type(self), self.collection, self.value, self.get_metadata()))


class RngKeyView(RngKey):
    """An ``RngKey`` whose value is its stream's key."""

    __slots__ = ("_stream",)
    value = _field("key")
    _varjax_identity = _identity("key")

    def _varjax_pickled_type(self) -> type[Variable]:
        return RngKey
    __repr__ = _repr


class RngCountView(RngCount):
    """An ``RngCount`` whose value is its stream's count."""

    __slots__ = ("_stream",)
    value = _field("count")
    _varjax_identity = _identity("count")

    def _varjax_pickled_type(self) -> type[Variable]:
        return RngCount
    __repr__ = _repr


_VIEWS: dict[str, tuple[type[Variable], type[Variable]]] = {
    "key": (RngKeyView, RngKey), "count": (RngCountView, RngCount)}
_PLAIN = {view: plain for view, plain in _VIEWS.values()}
_MADE = "_nnx_variables"    # the attribute of a stream holding its views


class VariableStream(RngStream):
    """A stream whose key and count live in two Variables (``StreamDef.unflatten`` of a
    state's ``RngKey``/``RngCount``): reads and draws go through them."""

    def __init__(self, tag: str, key: Variable, count: Variable):
        self.tag, self._variables = tag, {"key": key, "count": count}

    key = property(lambda self: self._variables["key"].value,
                   lambda self, value: setattr(self._variables["key"], "value", value))
    count = property(lambda self: self._variables["count"].value,
                     lambda self, value: setattr(self._variables["count"], "value", value))

    def _varjax_identity(self, field: str) -> Any:
        return self._variables[field]._varjax_identity()

    def __reduce__(self) -> tuple:
        """Pickled as a plain stream holding the two values."""
        return RngStream._varjax_rebuilt, (self.tag, self.key, self.count)


# JAX copies it as any stream: a plain one holding the two values.
jax.tree_util.register_pytree_node(VariableStream, lambda s: s.tree_flatten(),
                                   RngStream.tree_unflatten)


def stream_variables(stream: RngStream) -> dict[str, Variable]:
    """``{'key': RngKey, 'count': RngCount}`` of ``stream``, each tagged with the stream's
    name: the same two Variables every time for the same stream.  The stream holds them
    (not a table here), so they live and die with it; a ``VariableStream``'s are the ones
    it was merged from."""
    if isinstance(stream, VariableStream):
        return stream._variables
    made = stream.__dict__.get(_MADE)
    if made is None or made["key"]._stream is not stream:    # none yet, or a copy's
        made = {}
        for name, (view_type, plain) in _VIEWS.items():
            view = held(view_type, collection_of(plain), None, {"tag": stream.tag})
            view._stream = stream
            made[name] = view
        stream.__dict__[_MADE] = made
    return made


def plain_type(variable: Variable) -> type[Variable]:
    """The NNX type a Variable stands for: ``RngKey``/``RngCount`` for a view, else its own
    type.  What a copy of it is made as."""
    return _PLAIN.get(type(variable), type(variable))


@dataclasses.dataclass(frozen=True)
class StreamDef:
    """What rebuilds a stream from its two children: a ``VariableStream`` of two Variables
    (views or plain ones), else a new ``RngStream`` holding the values.  Hashable, as a
    ``GraphDef``'s parts are."""

    tag: str

    def unflatten(self, children: Any) -> RngStream:
        key, count = children
        if isinstance(key, Variable) and isinstance(count, Variable):
            return VariableStream(self.tag, key, count)
        key, count = (c.value if isinstance(c, Variable) else c for c in children)
        return RngStream._varjax_rebuilt(self.tag, key, count)


def stream_children(stream: RngStream) -> tuple[list[tuple[str, Variable]], StreamDef]:
    """``stream``'s children as the NNX walk names them (its views, in ``FIELDS`` order)
    and what rebuilds a stream from them."""
    views = stream_variables(stream)
    return [(name, views[name]) for name in FIELDS], StreamDef(stream.tag)
