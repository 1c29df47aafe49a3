"""Where a graph's nodes are, without the nodes: the static half of ``Graph`` that keys a
transform's trace and takes JAX's copies apart inside it (``Graph.copies``), and the names
a function gives its arguments' nodes (``argument_prefix``)."""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from varjax.ir.primitives import Path
from varjax.objects.aliasing import repeats


def argument_prefix(prefix: Path, names: Sequence[str]) -> Path:
    """A node's prefix in ``(args, kwargs)`` (``Graph.of``'s key path) as the function sees
    it: positional argument i under ``names[i]`` (else ``args{i}``), a keyword argument
    under its name."""
    head, *rest = prefix
    if head == "0":
        i = int(rest[0])
        rest[0] = names[i] if i < len(names) else f"args{i}"
    return tuple(rest)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """A graph without its objects: per tree position whether a node is there and which
    (``places``), each node's prefix, each leaf's key path, and each node's structure
    (its type and treedef: the same for a node and its copies), which keys a call's trace.
    Static and hashable (the hash computed once), so a transform's pure function is
    keyed by it and takes JAX's copies apart by it (``Graph.copies``)."""

    places: tuple[int, ...]
    is_object: tuple[bool, ...]
    prefixes: tuple[Path, ...]
    paths: tuple[tuple[str, ...], ...]
    statics: tuple[tuple[type, Any], ...]
    objects: tuple[int, ...] = ()     # ``Graph.objects``
    # Whether an object repeats in ``objects`` (``aliasing.repeats``), set when made.
    shares_objects: bool = dataclasses.field(init=False, compare=False, repr=False)

    def named(self, names: Sequence[str]) -> "Layout":
        """This layout of ``(args, kwargs)`` with each node's prefix named by a function's
        argument names (``argument_prefix``, as ``run.graph_of`` names them): one caller's
        graph, renamed for each branch or loop body it is handed to."""
        return Layout(self.places, self.is_object,
                      tuple(argument_prefix(p, names) for p in self.prefixes), self.paths,
                      self.statics, self.objects)

    @classmethod
    def arguments(cls, parts: Sequence["Layout | None"]) -> "Layout":
        """The layout of ``((a_0, a_1, ...), {})`` from each argument's own, of
        ``(a_i, {})`` (None: a plain value, one leaf, a loop's index): a loop body's
        arguments, its carry and its slice of ``xs``, whose graphs the caller built once.
        No node is shared across two arguments: JAX copies each apart."""
        places: list[int] = []
        is_object: list[bool] = []
        prefixes: list[Path] = []
        paths: list[tuple[str, ...]] = []
        statics: list[tuple[type, Any]] = []
        objects: list[int] = []
        for i, part in enumerate(parts):
            at = ("0", str(i))
            if part is None:
                is_object.append(False)
                paths.append(at)
                continue
            places += [len(prefixes) + p for p in part.places]
            is_object += part.is_object
            prefixes += [at + p[1:] for p in part.prefixes]
            paths += [at + p[1:] for p in part.paths]
            statics += part.statics
            offset = len(objects)     # no object is in two parts: JAX copies each apart
            objects += [offset + f for f in part.objects]
        return cls(tuple(places), tuple(is_object), tuple(prefixes), tuple(paths),
                   tuple(statics), tuple(objects))

    def _fields(self) -> tuple:
        return (self.places, self.is_object, self.prefixes, self.paths, self.statics,
                self.objects)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self._fields()))
        object.__setattr__(self, "shares_objects", repeats(self.objects))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        return self is other or (isinstance(other, Layout) and self._hash == other._hash
                                 and self._fields() == other._fields())
