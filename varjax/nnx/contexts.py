"""flax.nnx's split, merge and update contexts: ``split_context``, ``merge_context``,
``update_context``, ``current_update_context``.

A context shares the bookkeeping of several walks (``varjax.nnx.graphlib``): inside one
``split_context`` every ``ctx.split``/``ctx.flatten`` numbers objects in one ``RefMap``, so an
object split before comes out as a reference and several splits keep what they share
shared; inside one ``merge_context`` every ``ctx.merge``/``ctx.unflatten`` resolves those
references to the objects built before (and copies the Variables, as flax.nnx does).

``update_context(tag)`` is NNX's protocol for carrying changes out of a function as its
graph updates do, four calls around it with the same tag: (1) a split outside numbers the
caller's objects; (2) a merge inside (``inner=True``) builds the function's copies and
remembers which copy stands for which caller's object; (3) a split inside marks each copy
with its caller's number; (4) a merge outside (``inner=False``) refills the caller's
objects in place from the function's result, so new attributes, changed statics, cycles
and Variable values reach them and identity is kept.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Any, Callable, Hashable, Iterator, Mapping, TypeVar

from varjax.ir import errors
from varjax.ir.typing import Filter, Node
from varjax.nnx.graphlib import GraphDef, RefMap, build, build_from_states, flatten_graph, nested
from varjax.nnx.statelib import FlatState, State
from varjax.trace.variable import Variable

__all__ = ["SplitContext", "MergeContext", "UpdateContext", "split_context", "merge_context",
           "update_context", "current_update_context"]

F = TypeVar("F", bound=Callable[..., Any])


class UpdateContext:
    """What the four calls of an ``update_context`` leave for the next: the caller's
    objects by number (after the first split) and, inside, which copy stands for which
    (after the inner merge)."""

    def __init__(self, tag: Hashable):
        self.tag = tag
        self.outer_objects: dict[int, Any] | None = None
        self.inner_outer_index: dict[int, int] | None = None
        self._inner_objects: dict[int, Any] = {}     # keeps the ids above theirs

    def flatten_end(self, refs: RefMap) -> None:
        """After a split: the first one numbered the caller's objects; a later one (the
        inner split) has used the inner numbering, which is dropped."""
        if self.outer_objects is None:
            self.outer_objects = refs.objects()
        else:
            self.inner_outer_index, self._inner_objects = None, {}

    def unflatten_end(self, built: dict[int, Any], inner: bool) -> None:
        """After a merge: an inner one's objects stand for the caller's of the same number."""
        if inner:
            self._inner_objects = dict(built)
            self.inner_outer_index = {id(obj): i for i, obj in built.items()}


class _Stacks(threading.local):
    def __init__(self) -> None:
        self.update: dict[Hashable, list[UpdateContext]] = {}


_STACKS = _Stacks()


def current_update_context(tag: Hashable) -> UpdateContext:
    """The innermost active ``update_context`` of ``tag``."""
    stack = _STACKS.update.get(tag)
    if not stack:
        raise errors.TransformError(
            f"no update_context with tag {tag!r} is active.", **errors.where(),
            fix=f"run this inside `with nnx.update_context({tag!r}):`")
    return stack[-1]


class _UpdateContextManager:
    """``update_context(tag)``: a ``with`` block or a decorator activating an
    ``UpdateContext`` for its duration."""

    def __init__(self, tag: Hashable):
        self.tag = tag

    def __enter__(self) -> UpdateContext:
        ctx = UpdateContext(self.tag)
        _STACKS.update.setdefault(self.tag, []).append(ctx)
        return ctx

    def __exit__(self, *exc: Any) -> None:
        stack = _STACKS.update[self.tag]
        stack.pop()
        if not stack:
            del _STACKS.update[self.tag]

    def __call__(self, f: F) -> F:
        @functools.wraps(f)
        def in_context(*args: Any, **kwargs: Any) -> Any:
            with self:
                return f(*args, **kwargs)
        return in_context   # type: ignore[return-value]


def update_context(tag: Hashable) -> _UpdateContextManager:
    """An ``UpdateContext`` for the four splits and merges of one call (module docstring)."""
    return _UpdateContextManager(tag)


@dataclasses.dataclass
class SplitContext:
    """Splits sharing one numbering (``split_context``)."""

    ctxtag: Hashable | None
    refs: RefMap
    is_inner: bool | None

    def _outer(self) -> dict[int, int] | None:
        if self.ctxtag is None:
            return None
        return current_update_context(self.ctxtag).inner_outer_index

    def split(self, node: Node, *filters: Filter) -> tuple:
        """``nnx.split`` in this context: ``(graphdef, state, ...)``."""
        g, *flats = self.flatten(node, *filters)
        return (g, *(nested(dict(f)) for f in flats))

    def flatten(self, node: Node, *filters: Filter, with_paths: bool = True) -> tuple:
        """``(graphdef, flat_state, ...)``, one ``FlatState`` per filter; with
        ``with_paths=False`` (no filters) ``(graphdef, values)``."""
        if filters and not with_paths:
            raise errors.ConfigError("flatten: filters need with_paths=True.",
                                     **errors.where(), fix="drop the filters")
        g, entries = flatten_graph(node, True, refs=self.refs, outer=self._outer())
        if not with_paths:
            return g, [getattr(leaf, "value", leaf) for _, leaf in entries]
        parts = FlatState(entries, sort=False).split(*(filters or (...,)))
        return (g, *(parts if isinstance(parts, tuple) else (parts,)))


@contextlib.contextmanager
def split_context(ctxtag: Hashable | None = None) -> Iterator[SplitContext]:
    """A ``SplitContext`` whose splits share one numbering (module docstring)."""
    is_inner = None
    if ctxtag is not None:
        is_inner = current_update_context(ctxtag).outer_objects is not None
    ctx = SplitContext(ctxtag, RefMap(), is_inner)
    yield ctx
    if ctxtag is not None:
        current_update_context(ctxtag).flatten_end(ctx.refs)


@dataclasses.dataclass
class MergeContext:
    """Merges resolving one numbering (``merge_context``)."""

    ctxtag: Hashable | None
    built: dict[int, Any]
    is_inner: bool | None

    def _outer(self) -> dict[int, Any] | None:
        if self.ctxtag is None:
            return None
        return current_update_context(self.ctxtag).outer_objects

    def merge(self, graphdef: GraphDef, state: State | Mapping | Variable, /,
              *states: State | Mapping | Variable) -> Node:
        """``nnx.merge`` in this context, with copies of the states' Variables."""
        return build_from_states(graphdef, (state, *states), copy=True, built=self.built,
                                 outer=self._outer())

    def unflatten(self, graphdef: GraphDef, flat_state: FlatState | list, /,
                  *flat_states: FlatState) -> Node:
        """The object of ``flatten``'s results: ``FlatState``s, or one list of values."""
        if isinstance(flat_state, list):
            if flat_states or len(flat_state) != len(graphdef.paths):
                raise errors.VariableStructureError(
                    f"unflatten: the GraphDef has {len(graphdef.paths)} leaves; pass one list "
                    "of them.", **errors.where(), fix="pass what flatten returned")
            flat = dict(zip(graphdef.paths, flat_state))
        else:
            flat = dict(FlatState.merge(flat_state, *flat_states))
        return build(graphdef, flat.__getitem__, built=self.built, outer=self._outer())


@contextlib.contextmanager
def merge_context(ctxtag: Hashable | None = None, inner: bool | None = None
                  ) -> Iterator[MergeContext]:
    """A ``MergeContext`` whose merges resolve one numbering; with a tag, ``inner`` says
    which merge of the update protocol this is (module docstring)."""
    if ctxtag is not None and inner is None:
        raise errors.ConfigError(
            "merge_context: with a tag, say inner=True (the merge inside the function) or "
            "inner=False (the one outside).", **errors.where(), fix="pass inner=")
    ctx = MergeContext(ctxtag, {}, inner)
    yield ctx
    if ctxtag is not None:
        current_update_context(ctxtag).unflatten_end(ctx.built, bool(inner))
