"""Object-mode control flow: ``cond``/``switch`` and the loops over object carries.

The branches and loop bodies run through ``run`` as the other object-mode transforms do
(``varjax.objects.object_transforms``), inside ``jax.lax``'s own control flow.  What is particular
to them: every branch must leave the operands' variables with one type; a loop body may
move its carry objects to other places, so the updates are written back by object, followed
through the trip count (``_Carried``); and nothing may be created where it would exist in
some iterations or branches only.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from varjax import _jax
from varjax.ir import errors
from varjax.ir.caches import LRU
from varjax.ir.primitives import VarType
from varjax.objects.graph import Graph
from varjax.objects.layout import Layout
from varjax.objects.nodes import is_node, kind_of
from varjax.objects.object_transforms import dealias, wrapper
from varjax.objects.run import Result, arg_names, run
from varjax.passes.framework.pipeline import parse_entries
from varjax.trace.type_checks import branch_types_error

# --- control flow -------------------------------------------------------------------------

def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _where_defined(fn: Callable) -> dict[str, Any]:
    """``errors.where()`` with the user's function's own ``file:line (name)`` as the source,
    for an error about what it returned (the line that returned it is in no frame)."""
    found = errors.where()
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is not None:
        found["source"] = f"{code.co_filename}:{code.co_firstlineno} ({code.co_qualname})"
    return found


def _copies(fn: Callable, layout: Layout, args: tuple) -> Graph:
    """The graph of the copies JAX hands a branch or loop body, taken apart by the layout of
    the caller's graph (``Graph.copies``), named as ``fn`` names its arguments: the
    operands are walked once, by the caller, not again by every branch and step."""
    return Graph.copies(layout.named(arg_names(fn)), (args, {}))


def _run_branch(fn: Callable, args: tuple, layout: Layout, shared: tuple[int, ...],
                passes: tuple) -> tuple[Any, Graph, Result]:
    """``fn(*args)`` through the IR, its updates kept on the (copied) argument objects:
    the output, the graph of ``args`` (``_copies`` by ``layout``, the originals') and what
    the call changed (``shared``: the originals' ``Graph.shared``, as the copies share
    nothing; ``passes``: the transform's, parsed)."""
    graph = _copies(fn, layout, args)
    out, result = run(fn, args, {}, graph=graph, shared=shared, passes=passes)
    _no_creation(fn, result)
    graph.write_back(result.updates, result.created)
    return out, graph, result


def _no_creation(fn: Callable, result: Result) -> None:
    for created in result.created:
        for col, path in created:
            raise errors.VariableCreationError(
                f"{_name(fn)} creates variable {errors.format_path(path)} of collection "
                f"'{col}' inside a loop or branch, where it would exist in some iterations "
                "only.", collection=col, path=path, **errors.where(),
                fix="create it before the loop or conditional")


@errors.api_boundary
def cond(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any,
         passes: Any = ()) -> Any:
    """``jax.lax.cond`` over objects: a variable written in either branch is updated.
    ``passes`` (instances or pipeline strings, as ``vj.jit``'s) run on each branch's IR."""
    return _switch("vj.cond", jnp.asarray(pred, jnp.int32), [false_fun, true_fun],
                   ["false_fun", "true_fun"], operands, parse_entries(passes))


@errors.api_boundary
def switch(index: Any, branches: Sequence[Callable], *operands: Any, passes: Any = ()) -> Any:
    """``jax.lax.switch`` over objects (see ``_switch``; ``passes`` as ``cond``'s)."""
    return _switch("vj.switch", index, list(branches),
                   [f"branch {i}" for i in range(len(branches))], operands,
                   parse_entries(passes))


def _switch(what: str, index: Any, fns: list[Callable], labels: list[str],
            operands: tuple, passes: tuple) -> Any:
    """Each branch returns its output and the operands' objects as it left them, so JAX
    sees the same structure from every branch; a variable the branches leave with
    different types is a ``VariableStructureError`` naming it and the branches."""
    graph, written = Graph.of((operands, {})), set()
    first: list[tuple[str, Graph]] = []      # the first branch traced, to compare with

    def branch(fn: Callable, label: str) -> Callable:
        def run_branch(*ops: Any) -> Any:
            ops = dealias(ops, {}, tuple(graph.places))[0]
            out, inside, result = _run_branch(fn, ops, graph.layout(), graph.shared(), passes)
            written.update(i for i, v in enumerate(result.updates) if v is not None)
            if first:
                _same_types(what, graph, first[0], (f"{label} ({_name(fn)})", inside))
            else:
                first.append((f"{label} ({_name(fn)})", inside))
            return out, ops
        return run_branch
    out, final = jax.lax.switch(index, [branch(f, label) for f, label in zip(fns, labels)], *operands)
    # JAX returns a copy per place: an object passed at two places (a submodule shared by
    # two modules) is one again, so the cells line up with the operands' graph.
    after = Graph.copies(graph.layout(), (dealias(tuple(final), {}, tuple(graph.places))[0], {}))
    for i, ((_, cell), (_, new)) in enumerate(zip(graph.cells, after.cells)):
        if i in written:
            cell.set(new.get())
    return out


def _same_types(what: str, before: Graph, a: tuple[str, Graph], b: tuple[str, Graph]) -> None:
    """Two branches must leave every variable of the operands with one type."""
    for (_, old), (_, cell_a), (node, cell_b) in zip(before.cells, a[1].cells, b[1].cells):
        types = [VarType.of(c.get()) for c in (old, cell_a, cell_b)]
        if types[1] != types[2]:
            raise branch_types_error(what, cell_b.collection, node.prefix + cell_b.path,
                                     (a[0], types[1]), (b[0], types[2]), types[0],
                                     **errors.where())


# --- loops --------------------------------------------------------------------------------

def _objects(tree: Any) -> list[Any]:
    """The object nodes of ``tree``, one per place, in tree order."""
    return [x for x in jax.tree.leaves(tree, is_leaf=is_node) if is_node(x)]


def _order(carry: Any, new_carry: Any) -> tuple[int, ...]:
    """Per object place of ``new_carry``, which of ``carry``'s objects it holds (their
    index, one per object); any other object gets an index of its own past those."""
    index: dict[int, int] = {}
    for x in _objects(carry):
        index.setdefault(id(x), len(index))
    return tuple(index.setdefault(id(x), len(index)) for x in _objects(new_carry))


def _pair(fn: Callable, out: Any) -> Any:
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return out
    got = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else \
        f"a {type(out).__name__}"
    raise errors.TransformError(
        f"vj.scan: the body {_name(fn)} returned {got}; a scan body returns a pair "
        "(carry, y): the new carry and this step's output.", **_where_defined(fn),
        fix="return (carry, y), e.g. `return carry, None` for no per-step output")


_TRACKED = LRU()    # (fn, carry argument, returns a pair) -> fn returning also its _order


def _tracked(fn: Callable, arg: int, pair: bool) -> Callable:
    """``fn`` returning also where its new carry holds the carry objects it got
    (``_order``, static: the trace caches it with its jaxpr); one per ``fn``, so
    ``run``'s trace cache sees the same function every call."""
    key = (fn, arg, pair)
    found = _TRACKED.get(key)
    if found is None:
        def found(*args: Any) -> Any:
            out = _pair(fn, fn(*args)) if pair else fn(*args)
            return out, _order(args[arg], out[0] if pair else out)
        functools.update_wrapper(found, fn)
        _TRACKED[key] = found
    return found


class _Carried:
    """The carry objects of one loop call, followed by object, not by place.

    JAX carries values by position, and a body may return its carry objects in other
    places (``return (q, p), y``), as a Python loop may: the object that came in at one
    place goes on at another.  The body's trace says where each goes (``moves[n]``: the
    object slot ``n`` holds after a step is the one slot ``moves[n]`` held, or a new one,
    ``>= len(moves)``).  After ``trips`` steps each original object is written the values
    of the place it ends in, only the variables some step wrote while it passed."""

    def __init__(self, what: str, fn: Callable, init: Any, trips: int | None, arg: int,
                 passes: tuple, xs: Graph | None = None):
        self.what, self.fn, self.trips, self.passes = what, fn, trips, passes
        self.tracked = _tracked(fn, arg, what == "vj.scan")
        self.graph = Graph.of((init, {}))
        self.places = tuple(self.graph.places)
        # The body's arguments: a plain index before the carry (fori_loop's), the carry, and
        # scan's slice of xs (``xs``: the graph of the whole xs, whose slices have its layout).
        self.layout = Layout.arguments([None] * arg + [self.graph.layout()]
                                       + ([] if xs is None else [xs.layout()]))
        self.written: list[set[int]] = [set() for _ in self.graph.nodes]
        self.moves = tuple(range(len(self.graph.nodes)))

    def step(self, args: tuple) -> tuple[Any, Graph, Result]:
        """One step of the body on ``args`` (its carry at ``arg``): the body's output, the
        graph of its arguments (the carry's nodes first) and what it changed."""
        args = dealias(args, {}, self.layout.places)[0]
        inside = _copies(self.fn, self.layout, args)
        (out, order), result = run(self.tracked, args, {}, graph=inside,
                                   shared=self.graph.shared(),   # the carry's nodes come first
                                   passes=self.passes)
        _no_creation(self.fn, result)
        start = 0
        for node, written in zip(inside.nodes, self.written):
            written.update(c for c in range(len(node.cells)) if result.updates[start + c] is not None)
            start += len(node.cells)
        if len(order) == len(self.places):     # else JAX reports the new carry's structure
            self.moves = self._moves(order)
            for k in range(len(self.moves)):
                self._end(k)                   # raises now, while tracing, if it cannot end
        return out, inside, result

    def _place(self, k: int) -> str:
        leaf = [i for i, o in enumerate(self.graph.is_object) if o][self.places.index(k)]
        return "carry" + "".join(f"[{p}]" for p in self.graph.paths[leaf][1:])

    def _moves(self, order: tuple[int, ...]) -> tuple[int, ...]:
        pairs = set(zip(self.places, order))
        if len(pairs) != len(self.graph.nodes) or len({o for _, o in pairs}) != len(pairs):
            raise errors.TransformError(
                f"{self.what}: {_name(self.fn)} returns a new carry whose objects are shared "
                "differently from the carry it got (one object in two places where it got "
                "two, or the reverse).", **_where_defined(self.fn),
                fix="return each carry object where one object was, as many times as it "
                    "came in")
        return tuple(o for _, o in sorted(pairs))

    def _walk(self, k: int) -> tuple[list[int], bool]:
        """The slots original object ``k`` passes through, step by step, and whether it
        comes back to slot ``k`` (a cycle) rather than leaving the carry."""
        before = {o: n for n, o in enumerate(self.moves)}
        slots = [k]
        while slots[-1] in before:
            if before[slots[-1]] == k:
                return slots, True
            slots.append(before[slots[-1]])
        return slots, False

    def _end(self, k: int) -> tuple[int, set[int]] | None:
        """The slot original object ``k`` ends in and the cells written on its way; None
        when none was (its value never changes)."""
        slots, cycle = self._walk(k)
        written = set().union(*(self.written[s] for s in slots))
        if not written:
            return None
        if self.trips is None and slots != [k]:
            raise errors.TransformError(
                f"{self.what}: {_name(self.fn)} writes carry object {self._place(k)} and "
                "returns it in another place of its new carry; the number of iterations is "
                "not known while tracing, so the place it ends in is not known either.",
                **_where_defined(self.fn),
                fix="return each carry object in the place it came in (swap values instead: "
                    "p.value, q.value = q.value, p.value), or loop a known number of times "
                    "(vj.scan, vj.fori_loop with int bounds)")
        trips = self.trips or 0
        if cycle:
            return slots[trips % len(slots)], written
        if trips < len(slots):
            return slots[trips], written
        raise errors.TransformError(
            f"{self.what}: {_name(self.fn)} writes carry object {self._place(k)} and then "
            "leaves it out of its new carry (another object takes its place), so the value "
            "it was written is in no output and cannot be written back to it.",
            **_where_defined(self.fn),
            fix="return the carry objects it was given (in any order); to give a variable "
                "a new value, assign its .value")

    def write_back(self, final: Any) -> None:
        """Write each original object the values of the place it ends in (``_end``)."""
        finals = _objects(final)
        for k, node in enumerate(self.graph.nodes):
            end = self._end(k)
            if end is None:
                continue
            slot, written = end
            there = finals[self.places.index(slot)]
            cells = kind_of(there).cells(there)
            for c in sorted(written):
                node.cells[c].set(cells[c].get())


def _scan_length(length: int | None, xs: Any) -> int | None:
    leaves = jax.tree.leaves(xs)
    return length if length is not None or not leaves else jnp.shape(leaves[0])[0]


def _trip_count(lower: Any, upper: Any) -> int | None:
    """``fori_loop``'s number of iterations, when its bounds are not traced."""
    if _jax.trace_of(lower) is not None or _jax.trace_of(upper) is not None:
        return None
    return max(int(upper) - int(lower), 0)


@errors.api_boundary
def while_loop(cond_fun: Callable, body_fun: Callable, init_val: Any, *,
               passes: Any = ()) -> Any:
    """``jax.lax.while_loop`` over objects in the carry: the body's updates are carried;
    ``cond_fun`` may read them only (JAX keeps nothing it writes).  ``passes`` (as
    ``cond``'s) run on the IR of ``cond_fun`` and of ``body_fun``."""
    parsed = parse_entries(passes)
    carried = _Carried("vj.while_loop", body_fun, init_val, None, 0, parsed)

    def cond(v: Any) -> Any:
        out, inside, result = _run_branch(cond_fun, (dealias((v,), {}, carried.places)[0][0],),
                                          carried.layout, carried.graph.shared(), parsed)
        for (node, cell), value in zip(inside.cells, result.updates):
            if value is not None:
                path = node.prefix + cell.path
                raise errors.TransformError(
                    f"vj.while_loop: cond_fun {_name(cond_fun)} writes variable "
                    f"{errors.format_path(path)} of collection '{cell.collection}'; JAX's "
                    "while_loop keeps nothing its condition writes.",
                    collection=cell.collection, path=path, **errors.where(),
                    fix="write it in body_fun")
        return out
    final = jax.lax.while_loop(cond, lambda v: carried.step((v,))[0], init_val)
    carried.write_back(final)
    return final


@errors.api_boundary
def fori_loop(lower: int, upper: int, body_fun: Callable, init_val: Any, *,
              unroll: int | bool | None = None, passes: Any = ()) -> Any:
    """``jax.lax.fori_loop`` over objects in the carry (``passes`` run on the body's IR).
    ``unroll`` is JAX's: the loop becomes a ``scan`` unrolled that many steps per iteration,
    so the bounds must be concrete."""
    carried = _Carried("vj.fori_loop", body_fun, init_val, _trip_count(lower, upper), 1,
                       parse_entries(passes))
    final = jax.lax.fori_loop(lower, upper, lambda i, v: carried.step((i, v))[0], init_val,
                              unroll=unroll)
    carried.write_back(final)
    return final


def scan(fn: Callable, *, length: int | None = None, reverse: bool = False,
         unroll: int | bool = 1, _split_transpose: bool = False,
         passes: Any = ()) -> Callable:
    """``jax.lax.scan`` over objects, as ``(carry, xs) -> (carry, ys)``: objects in the carry
    are carried (updated every step, followed by object: ``_Carried``), objects in ``xs``
    are sliced per step and their updates stacked along axis 0.  ``passes`` (as ``cond``'s)
    run on the body's IR; ``_split_transpose`` is passed on to ``jax.lax.scan``, which (JAX
    0.10) takes it and ignores it: its transpose is no longer split."""
    parsed = parse_entries(passes)

    def call(init: Any, xs: Any) -> Any:
        xs_graph = Graph.of((xs, {}))
        carried = _Carried("vj.scan", fn, init, _scan_length(length, xs), 0, parsed, xs_graph)
        n_carry = len(carried.graph.cells)

        def step(carry: Any, x: Any) -> Any:
            (new_carry, y), _, result = carried.step((carry, x))
            return new_carry, (y, result.updates[n_carry:])
        final, (ys, stacked) = jax.lax.scan(step, init, xs, length=length, reverse=reverse,
                                            unroll=unroll, _split_transpose=_split_transpose)
        for (_, cell), value in zip(xs_graph.cells, stacked):
            if value is not None:
                cell.set(value)
        carried.write_back(final)
        return final, ys
    return wrapper(fn, call)
