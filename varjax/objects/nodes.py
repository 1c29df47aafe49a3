"""Object nodes and their cells: what object mode reads, writes back and splits.

A *node* is an object that holds variables: a ``vj.Variable``, a ``vj.Rngs``, a
bare ``vj.RngStream``, or a bound module (registered by ``varjax.nn``, which sits
above this layer).  Each node shows its variables as *cells*: one variable each,
with the collection and path it has inside the node, a getter and a setter.  A cell's ``identity``
says when two nodes share a variable: one ``Variable`` object reached twice, or
one bound module root reached through two modules.

A node kind also says how to *bind* a node to a trace: give back an object of
the same kind whose every access is a ``var_get``/``var_set`` of the running
trace (``Variable.at`` for a variable).  That is how object mode stays on
the IR: the body of an object-mode transform sees only bound objects, and the
discharge pass says which variables it wrote.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Mapping, Protocol

import jax

from varjax.ir import axis_metadata, streams
from varjax.ir.primitives import Key, Path
from varjax.trace.context import TraceContext
from varjax.trace.rngs import Rngs, RngStream
from varjax.trace.variable import Variable


@dataclasses.dataclass(eq=False)
class Cell:
    """One variable of a node: ``(collection, path)`` inside the node, and access to it.

    ``var_type`` is the ``Variable`` class the variable is (``Variable`` for a variable of
    a bound module or an ``Rngs``), ``metadata`` its metadata (``out_sharding=...``): what
    a trace needs to hand the variable on as an object of its own class."""

    identity: Hashable
    collection: str
    path: Path
    get: Callable[[], Any]
    set: Callable[[Any], None]
    var_type: type[Variable] = dataclasses.field(default=Variable, kw_only=True)
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict, kw_only=True)


class NodeKind(Protocol):
    """How object mode handles one kind of node (see the module docstring)."""

    def accepts_type(self, t: type) -> bool:
        """Whether an instance of ``t`` may be a node of this kind (checked once per type)."""
        ...

    def accepts(self, x: Any) -> bool:
        """Whether ``x``, an instance of a type ``accepts_type`` took, is a node of this kind."""
        ...

    def cells(self, node: Any) -> list[Cell]:
        """The node's variables, in a fixed order (the same for a node and its copies)."""
        ...

    def mutable(self, node: Any) -> Any:
        """The collections a transformed function may write in this node (a filter)."""
        ...

    def watch(self, node: Any) -> Callable[[], Hashable] | None:
        """A function whose value changes whenever ``cells(node)`` would give other cells
        (variables added, a stream replaced), or None if they never do: while it keeps its
        value, a graph of the node may be reused (``graph.ArgumentGraphs``)."""
        ...

    def reader(self, node: Any) -> Callable[[], tuple]:
        """A function giving the children the node's pytree flatten gives, valid while
        ``token`` is (so is the static part): what a kept graph passes to JAX in place of
        the node, read without finding the node's cells again."""
        ...

    def trace_key(self, node: Any, cell: Cell, prefix: Path) -> Key:
        """Where ``cell`` lives in the trace of a transformed function, the node being
        at ``prefix`` in its arguments."""
        ...

    def explicit_rngs(self, node: Any) -> dict[str, Any]:
        """RNG keys the node hands to the trace (a module bound with ``rngs={...}``)."""
        ...

    def passes(self, node: Any) -> tuple | None:
        """The passes a call over the node runs for the node's variables (a module's
        ``bind(passes=...)``), or None for a node that has no say (a ``Variable``, an
        ``Rngs``).  They are rooted at the node (``Pass.rooted``): they see its variables
        as an eager call does, at ``passes_path`` + the cell's path."""
        ...

    def passes_path(self, node: Any) -> Path:
        """Where the node's variables are in what its passes were given for: ``()`` for a
        bound module, ``Dense_0`` for its submodule (an eager call of it runs the passes
        over the whole bound module)."""
        ...

    def bind(self, node: Any, prefix: Path, ctx: TraceContext) -> Any:
        """An object like ``node`` whose variables are those of ``ctx`` at ``prefix``."""
        ...

    def add(self, node: Any, collection: str, path: Path, value: Any) -> None:
        """Record a variable the transformed function created under this node."""
        ...

    def writer(self, node: Any) -> Callable[[list[Any]], None]:
        """A function writing a call's new values into the node, one per cell in
        ``cells`` order (None: unchanged), and advancing what the node counts per call;
        valid while ``token`` is.  Not asked of a ``Variable`` node: ``Graph.write_back``
        sets a graph's Variables in one loop (its one cell is ``Variable.value``)."""
        ...


_KINDS: list[NodeKind] = []
# type -> the kinds that may accept its instances: kind_of runs for every subtree of every
# argument of every object-mode call (JAX's is_leaf), so the common answer, "no kind", is
# one dict lookup.
_CANDIDATES: dict[type, list[NodeKind]] = {}


def register_kind(kind: NodeKind) -> NodeKind:
    """Add a node kind (``varjax.nn`` registers bound modules)."""
    _KINDS.append(kind)
    _CANDIDATES.clear()
    return kind


def kind_of(x: Any) -> NodeKind | None:
    t = type(x)
    candidates = _CANDIDATES.get(t)
    if candidates is None:
        candidates = _CANDIDATES[t] = [k for k in _KINDS if k.accepts_type(t)]
    for kind in candidates:
        if kind.accepts(x):
            return kind
    return None


def is_node(x: Any) -> bool:
    return kind_of(x) is not None


# --- vj.Variable ------------------------------------------------------------------------

class VariableKind:
    """A ``vj.Variable`` or an instance of any subclass: one cell, at the node's own path."""

    def accepts_type(self, t: type) -> bool:
        return issubclass(t, Variable)

    def accepts(self, x: Any) -> bool:
        return True

    def cells(self, node: Variable) -> list[Cell]:
        identity = node._varjax_identity() if node.path is None else \
            (id(node._origin if node._store is None else node._store), node.key)
        def set_(value: Any) -> None:
            node.value = value
        return [Cell(identity, node.collection, (), lambda: node.value, set_,
                     var_type=type(node), metadata=node._metadata)]

    def mutable(self, node: Variable) -> Any:
        return node.collection

    def watch(self, node: Variable) -> Callable[[], Hashable] | None:
        return None

    def reader(self, node: Variable) -> Callable[[], tuple]:
        return lambda: (node.value,)

    def trace_key(self, node: Variable, cell: Cell, prefix: Path) -> Key:
        return (node.collection, prefix)

    def explicit_rngs(self, node: Any) -> dict[str, Any]:
        return {}

    def passes(self, node: Any) -> tuple | None:
        return None

    def passes_path(self, node: Any) -> Path:
        return ()

    def bind(self, node: Variable, prefix: Path, ctx: TraceContext) -> Variable:
        # run gives the value boxed when its metadata place it (variable.boxed): the trace's
        # type says so.  Not the node's value: a node JAX did not copy (an argument a nested
        # grad does not differentiate) is a handle of the enclosing trace, not readable here.
        vt = ctx.variables.get((node.collection, tuple(prefix)))
        boxed_in = vt is not None and axis_metadata.is_axis_metadata(
            jax.tree.unflatten(vt.tree, vt.avals))
        return type(node).at(node.collection, prefix, node.get_metadata(), ctx.origin,
                             unbox=boxed_in)

    def add(self, node: Any, collection: str, path: Path, value: Any) -> None:
        raise AssertionError("a Variable has no variables below it")


# --- vj.Rngs ----------------------------------------------------------------------------

class _TracedStream(RngStream):
    """A stream of an ``Rngs`` inside an object-mode body: key and count are variables."""

    def __init__(self, tag: str, key: Variable, count: Variable):
        self.tag, self._key, self._count = tag, key, count

    key = property(lambda self: self._key.value)
    count = property(lambda self: self._count.value,
                     lambda self, value: setattr(self._count, "value", value))


# A traced stream flattens as a stream (reading its key and count through the IR), so an
# Rngs drawn from inside an object-mode body can be returned or carried.
jax.tree_util.register_pytree_node(
    _TracedStream, lambda s: ((s.key, s.count), s.tag),
    lambda tag, children: RngStream._varjax_rebuilt(tag, *children))


def _stream_cells(stream: RngStream, name: str | None) -> list[Cell]:
    """A stream's key and count, at ``name/key`` and ``name/count`` (a stream of an
    ``Rngs``) or at ``key`` and ``count`` (a bare stream, ``name`` None)."""
    def set_key(v: Any) -> None:
        stream.key = v

    def set_count(v: Any) -> None:
        stream.count = v
    at = () if name is None else (name,)
    return [Cell(stream._varjax_identity("key"), streams.STATE, (*at, "key"), lambda: stream.key,
                 set_key),
            Cell(stream._varjax_identity("count"), streams.STATE, (*at, "count"),
                 lambda: stream.count,
                 set_count)]


class _RngStateKind:
    """What the two kinds of RNG state share: cells in collection ``rngs`` below the
    node's own path, no passes, no explicit streams, written back cell by cell."""

    def accepts(self, x: Any) -> bool:
        return True

    def mutable(self, node: Any) -> Any:
        return streams.STATE

    def trace_key(self, node: Any, cell: Cell, prefix: Path) -> Key:
        return (cell.collection, prefix + cell.path)

    def explicit_rngs(self, node: Any) -> dict[str, Any]:
        return {}

    def passes(self, node: Any) -> tuple | None:
        return None

    def passes_path(self, node: Any) -> Path:
        return ()

    def writer(self, node: Any) -> Callable[[list[Any]], None]:
        return cell_writer(self.cells(node))


class RngsKind(_RngStateKind):
    """A ``vj.Rngs``: a key and a count per stream, collection ``rngs`` (as ``init`` keeps
    RNG state: ``rngs:dropout/count``)."""

    def accepts_type(self, t: type) -> bool:
        return t is Rngs

    def cells(self, node: Rngs) -> list[Cell]:
        return [c for name in node for c in _stream_cells(node[name], name)]

    def watch(self, node: Rngs) -> Callable[[], Hashable] | None:
        return None      # its streams are fixed when it is made (vj.reseed makes a new one)

    def reader(self, node: Rngs) -> Callable[[], tuple]:
        return lambda: node.tree_flatten()[0]

    def bind(self, node: Rngs, prefix: Path, ctx: TraceContext) -> Rngs:
        def var(name: str, part: str) -> Variable:
            return Variable.at(streams.STATE, prefix + (name, part), None, ctx.origin)
        bound = object.__new__(Rngs)
        bound._streams = {name: _TracedStream(name, var(name, "key"), var(name, "count"))
                          for name in node}
        return bound

    def add(self, node: Any, collection: str, path: Path, value: Any) -> None:
        raise AssertionError("an Rngs gains no variables")


class RngStreamKind(_RngStateKind):
    """A bare ``vj.RngStream`` (NNX's ``Dropout`` holds one): its key and count, collection
    ``rngs`` at ``key`` and ``count`` below the node's own path, so that a draw inside a
    transform advances the caller's stream as a draw from an ``Rngs``'s stream does.  A
    stream of an ``Rngs`` bound in an enclosing body (a ``_TracedStream``) is one too."""

    def accepts_type(self, t: type) -> bool:
        return issubclass(t, RngStream)

    def cells(self, node: RngStream) -> list[Cell]:
        return _stream_cells(node, None)

    def watch(self, node: RngStream) -> Callable[[], Hashable] | None:
        return None      # always its own key and count

    def reader(self, node: RngStream) -> Callable[[], tuple]:
        return lambda: (node.key, node.count)

    def bind(self, node: RngStream, prefix: Path, ctx: TraceContext) -> RngStream:
        def var(part: str) -> Variable:
            return Variable.at(streams.STATE, prefix + (part,), None, ctx.origin)
        return _TracedStream(node.tag, var("key"), var("count"))

    def add(self, node: Any, collection: str, path: Path, value: Any) -> None:
        raise AssertionError("an RngStream gains no variables")


register_kind(VariableKind())
register_kind(RngsKind())
register_kind(RngStreamKind())


def rng_state_cells(rngs: Rngs) -> list[Cell]:
    """The cells of an ``Rngs`` held by another node (a module bound with ``rngs=Rngs``)."""
    return RngsKind().cells(rngs)


def cell_writer(cells: list[Cell]) -> Callable[[list[Any]], None]:
    """A writer (``NodeKind.writer``) setting each updated cell."""
    def write(updates: list[Any]) -> None:
        for cell, value in zip(cells, updates):
            if value is not None:
                cell.set(value)
    return write


def stream_leaves(rngs: Rngs) -> tuple[list[Any], Any]:
    """An ``Rngs``'s leaves and treedef, for node kinds that carry one."""
    return jax.tree.flatten(rngs)
