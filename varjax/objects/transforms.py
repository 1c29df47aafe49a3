"""Object-mode transforms: a JAX transform of ``run``, and the updates written back.

Each one is the design note's "simple transform" on varjax's IR:

    graph = nodes of the arguments                    (the originals)
    out, result = jax_transform(pure)(*args)          JAX copies the objects (pytrees)
        pure: run(fn, copies)                          a functionalized trace: reads are
                                                       var_get, updates var_set, and the
                                                       discharge pass says what was written
    graph.write_back(result.updates, result.created)   only the variables written

JAX does the structural work: objects are pytrees, so ``in_axes`` prefixes, ``argnums``
and cotangent types follow JAX's rules (``grad`` of a bound module is a bound module of
the same class).  What is left here is the bookkeeping per transform: the axes of the
updates under ``vmap``, the aux output of ``grad``, the carry of the loops.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from varjax import _jax, errors
from varjax.caches import LRU
from varjax.objects.graph import ArgumentGraphs, Graph
from varjax.objects.nodes import is_node, kind_of
from varjax.objects.run import Result, arg_names, graph_of, run
from varjax.primitives import VarType


def _dealias(args: tuple, kwargs: dict, places: tuple[int, ...]) -> tuple[tuple, dict]:
    """The copies JAX made, with one copy per original object: a node passed twice is one
    object inside, as outside."""
    if places == tuple(range(len(places))):
        return args, kwargs
    leaves, tree = jax.tree.flatten((args, kwargs), is_leaf=is_node)
    first: dict[int, Any] = {}
    k = 0
    for i, leaf in enumerate(leaves):
        if is_node(leaf):
            leaves[i] = first.setdefault(places[k], leaf)
            k += 1
    return jax.tree.unflatten(tree, leaves)


def _originals(args: tuple, kwargs: dict, fn: Callable) -> Graph:
    """The argument objects of one call, to write back into: two of them sharing a variable
    (a module and its own submodule) is an error, since JAX copies each separately."""
    graph = Graph.of((args, dict(kwargs)), paths=False)
    if len(graph.nodes) > 1:
        graph.check_unshared(f"vj transform of {getattr(fn, '__name__', 'a function')}")
    return graph


class _Pure:
    """``fn`` as the pure function a JAX transform takes: ``(*copies) -> (out, Result)``,
    one per argument structure (aliasing), cached so JAX's caches see the same function."""

    def __init__(self, fn: Callable, names: Sequence[str]):
        self.fn, self.names = fn, tuple(names)
        self._made: dict[Any, Callable] = {}
        self.graphs = ArgumentGraphs()

    def originals(self, args: tuple, kwargs: dict) -> Graph:
        """The argument objects of one call (``_originals``), kept across calls."""
        return self.graphs.of(args, kwargs, lambda: _originals(args, kwargs, self.fn))

    def get(self, key: Any, make: Callable[[Callable], Callable]) -> Callable:
        found = self._made.get(key)
        if found is None:
            places = key[0]

            def pure(*args: Any, **kwargs: Any) -> tuple[Any, Result]:
                args, kwargs = _dealias(args, kwargs, places)
                return run(self.fn, args, kwargs, names=self.names)
            functools.update_wrapper(pure, self.fn)
            found = self._made[key] = make(pure)
        return found


    def flat(self, graph: Graph, make: Callable[[Callable], Callable]) -> Callable:
        """A call ``args -> out`` for a graph kept by ``ArgumentGraphs``, writing back:
        ``make`` of ``pure`` taking each node argument as its pytree children.  The
        objects' static parts key that function once per graph, instead of JAX hashing
        them on every call, and it returns the ``Result``'s fields as a tuple (JAX
        unflattens a tuple faster than a dataclass)."""
        positions = graph.node_args
        nodes = [graph.nodes[place] for place in graph.places]
        defs = tuple(_one_level(n.obj) for n in nodes)
        places = tuple(graph.places)
        key = ("flat", places, positions, defs)
        jitted = self._made.get(key)
        if jitted is None:
            def pure(*flat_args: Any) -> tuple:
                args = list(flat_args)
                for i, treedef in zip(positions, defs):
                    args[i] = treedef.unflatten(flat_args[i])
                args, _ = _dealias(tuple(args), {}, places)
                out, result = run(self.fn, args, {}, names=self.names)
                return out, result.updates, result.created, result.captured
            functools.update_wrapper(pure, self.fn)
            jitted = self._made[key] = make(pure)
        readers = [(i, n.kind.reader(n.obj)) for i, n in zip(positions, nodes)]

        def call(args: tuple) -> Any:
            flat_args = list(args)
            for i, read in readers:
                flat_args[i] = read()
            out, updates, created, _ = jitted(*flat_args)
            graph.write_back(updates, created)
            return out
        return call


def _one_level(node: Any) -> Any:
    """The treedef of ``node`` with its children as leaves."""
    return jax.tree.structure(node, is_leaf=lambda x: x is not node)


def _wrapper(fn: Callable, call: Callable[..., Any]) -> Callable:
    """``call`` as the transformed ``fn``: a public entry point, whose varjax errors leave
    without varjax's frames (``errors.api_boundary``), as Linen-mode ones do."""
    return functools.wraps(fn)(errors.api_boundary(call))


# --- jit, remat ---------------------------------------------------------------------------

def jit(fn: Callable, *, static_argnums: int | Sequence[int] = (),
        donate_argnums: int | Sequence[int] = ()) -> Callable:
    """``jax.jit`` over objects: their variables are traced inputs; updates come back."""
    pure = _Pure(fn, arg_names(fn))

    def make(p: Callable) -> Callable:
        return jax.jit(p, static_argnums=static_argnums, donate_argnums=donate_argnums)

    def call(*args: Any, **kwargs: Any) -> Any:
        graph = pure.graphs.of(args, kwargs, lambda: _originals(args, kwargs, fn))
        if graph.node_args is not None:
            flat = graph.memo.get("jit")
            if flat is None:
                flat = graph.memo["jit"] = pure.flat(graph, make)
            return flat(args)
        out, result = pure.get((tuple(graph.places),), make)(*args, **kwargs)
        graph.write_back(result.updates, result.created)
        return out
    return _wrapper(fn, call)


def remat(fn: Callable, *, prevent_cse: bool = True, static_argnums: int | Sequence[int] = (),
          policy: Callable | None = None) -> Callable:
    """``jax.checkpoint`` over objects."""
    pure = _Pure(fn, arg_names(fn))

    def call(*args: Any, **kwargs: Any) -> Any:
        graph = pure.originals(args, kwargs)
        checkpointed = pure.get((tuple(graph.places),), lambda p: jax.checkpoint(
            p, prevent_cse=prevent_cse, static_argnums=static_argnums, policy=policy))
        out, result = checkpointed(*args, **kwargs)
        graph.write_back(result.updates, result.created)
        return out
    return _wrapper(fn, call)


# --- vmap ---------------------------------------------------------------------------------

def _node_axes(in_axes: Any, args: tuple, kwargs: dict, graph: Graph, what: str) -> list[Any]:
    """The axis of every node (``in_axes`` as JAX broadcasts it, keyword arguments at 0);
    ``TransformError`` when one object is passed at two different axes."""
    prefix = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    if len(prefix) != len(args):
        raise errors.TransformError(
            f"{what}: in_axes has {len(prefix)} entries for {len(args)} arguments.",
            **errors.where(), fix="give one in_axes entry per positional argument")
    per_place: list[Any] = []

    def visit(axis: Any, sub: Any) -> None:
        per_place.extend([axis] * sum(map(is_node, jax.tree.leaves(sub, is_leaf=is_node))))
    for axis, arg in zip(prefix, args):
        jax.tree.map(visit, axis, arg, is_leaf=lambda x: x is None)
    for value in kwargs.values():
        visit(0, value)
    axes: dict[int, Any] = {}
    for node_index, axis in zip(graph.places, per_place):
        if axes.setdefault(node_index, axis) != axis:
            node = graph.nodes[node_index]
            raise errors.InconsistentAliasError(
                f"{what}: one object is passed twice, with in_axes {axes[node_index]} and "
                f"{axis}; it has one value, so it cannot be both.",
                path=node.prefix or None, **errors.where(),
                fix="pass it once, or with the same axis in both places")
    return [axes[i] for i in range(len(graph.nodes))]


def vmap(fn: Callable | None = None, *, in_axes: Any = 0, out_axes: Any = 0,
         axis_size: int | None = None, axis_name: Any = None) -> Any:
    """``jax.vmap`` over objects; an update is stacked along its object's axis."""
    if fn is None:
        return functools.partial(vmap, in_axes=in_axes, out_axes=out_axes,
                                 axis_size=axis_size, axis_name=axis_name)
    pure = _Pure(fn, arg_names(fn))

    def call(*args: Any, **kwargs: Any) -> Any:
        graph = pure.originals(args, kwargs)
        axes = _node_axes(in_axes, args, kwargs, graph, "vj.vmap")
        cell_axes = [axes[graph.nodes.index(node)] for node, _ in graph.cells]
        result_axes = Result(cell_axes, axes, 0)
        vmapped = pure.get((tuple(graph.places), tuple(cell_axes)), lambda p: jax.vmap(
            p, in_axes=tuple(in_axes) if isinstance(in_axes, list) else in_axes,
            out_axes=(out_axes, result_axes), axis_size=axis_size, axis_name=axis_name))
        try:
            out, result = vmapped(*args, **kwargs)
        except ValueError as e:
            if "out_axes" not in str(e) or None not in axes:
                raise
            raise errors.TransformError(
                "vj.vmap: a variable of an object passed with in_axes=None (one copy for every "
                "batch member) was written with a different value per member.",
                **errors.where(),
                fix="pass the object with an axis (in_axes=0) to keep one copy per member, or "
                    "write a value that does not depend on the mapped inputs") from e
        graph.write_back(result.updates, result.created)
        return out
    return _wrapper(fn, call)


# --- grad ---------------------------------------------------------------------------------

def value_and_grad(fn: Callable, *, argnums: int | Sequence[int] = 0,
                   has_aux: bool = False) -> Callable:
    """``jax.value_and_grad`` over objects: every float variable of the ``argnums``
    arguments is differentiated (integer ones get ``float0`` zeros), and the gradient has
    the argument's type (a bound module of cotangents for a bound module)."""
    pure = _Pure(fn, arg_names(fn))

    def call(*args: Any, **kwargs: Any) -> Any:
        graph = pure.originals(args, kwargs)

        def make(p: Callable) -> Callable:
            def loss(*a: Any, **k: Any) -> Any:
                out, result = p(*a, **k)
                value, aux = out if has_aux else (out, None)
                return value, (aux, result)
            return jax.value_and_grad(loss, argnums=argnums, has_aux=True, allow_int=True)
        (value, (aux, result)), grads = pure.get((tuple(graph.places),), make)(*args, **kwargs)
        graph.write_back(result.updates, result.created)
        return ((value, aux) if has_aux else value), grads
    return _wrapper(fn, call)


def grad(fn: Callable, *, argnums: int | Sequence[int] = 0, has_aux: bool = False) -> Callable:
    """``jax.grad`` over objects (see ``value_and_grad``)."""
    both = value_and_grad(fn, argnums=argnums, has_aux=has_aux)

    def call(*args: Any, **kwargs: Any) -> Any:
        out, grads = both(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads
    return _wrapper(fn, call)


# --- custom_vjp ---------------------------------------------------------------------------

class custom_vjp:  # noqa: N801  (named as jax.custom_vjp, which it mirrors)
    """``jax.custom_vjp`` over objects: ``bwd(res, g)`` gets the output cotangent only and
    returns one cotangent per positional argument, shaped like it (a bound module of
    cotangents for a bound module).  A float variable may not be updated inside ``fn``
    (its update would have no derivative rule); integer ones may."""

    def __init__(self, fn: Callable, *, nondiff_argnums: Sequence[int] = ()):
        functools.update_wrapper(self, fn)
        self.fn, self.nondiff_argnums = fn, tuple(nondiff_argnums)
        self.names = arg_names(fn)
        self.fwd: Callable | None = None
        self.bwd: Callable | None = None
        self._graphs = ArgumentGraphs()

    def defvjp(self, fwd: Callable, bwd: Callable) -> None:
        self.fwd, self.bwd = fwd, bwd

    def _checked(self, graph: Graph, result: Result) -> Result:
        for (node, cell), value in zip(graph.cells, result.updates):
            if value is not None and any(jnp.issubdtype(jnp.result_type(x), jnp.inexact)
                                         for x in jax.tree.leaves(value)):
                raise errors.TransformError(
                    f"vj.custom_vjp: float variable {errors.format_path(node.prefix + cell.path)} of "
                    f"collection '{cell.collection}' is updated inside "
                    f"{getattr(self.fn, '__name__', 'the function')}; its update would have "
                    "no derivative rule.", collection=cell.collection,
                    path=node.prefix + cell.path, **errors.where(),
                    fix="update it outside the custom_vjp function, or keep it an integer")
        return result

    @errors.api_boundary
    def __call__(self, *args: Any) -> Any:
        if self.fwd is None or self.bwd is None:
            raise errors.TransformError(
                f"vj.custom_vjp: {getattr(self.fn, '__name__', 'the function')} was called "
                "before defvjp(fwd, bwd).", **errors.where(), fix="call f.defvjp(fwd, bwd) first")
        graph = self._graphs.of(args, {}, lambda: _originals(args, {}, self.fn))
        places = tuple(graph.places)

        def primal(*a: Any) -> tuple[Any, Result]:
            a, _ = _dealias(a, {}, places)
            inside = graph_of(a, {}, self.names)
            out, result = run(self.fn, a, {}, names=self.names, graph=inside)
            return out, self._checked(inside, result)

        def forward(*a: Any) -> tuple[tuple[Any, Result], Any]:
            a, _ = _dealias(a, {}, places)
            inside = graph_of(a, {}, self.names)
            (out, residuals), result = run(self.fwd, a, {}, names=self.names, graph=inside)
            return (out, self._checked(inside, result)), residuals

        def backward(*rest: Any) -> tuple:
            residuals, (g, _) = rest[-2], rest[-1]
            cotangents = tuple(self.bwd(residuals, g))
            return tuple(jax.tree.map(_cotangent, ct, x, is_leaf=lambda c: c is None)
                         for ct, x in zip(cotangents, primal_avals))
        primal_avals = [jax.tree.map(jax.typeof, a) for i, a in enumerate(args)
                        if i not in self.nondiff_argnums]
        f = jax.custom_vjp(primal, nondiff_argnums=self.nondiff_argnums)
        f.defvjp(forward, backward)
        out, result = f(*args)
        graph.write_back(result.updates, result.created)
        return out


def _cotangent(ct: Any, aval: Any) -> Any:
    """A cotangent JAX accepts for a primal of type ``aval``: ``float0`` for integers, and
    None (JAX's zero, for a whole subtree) as it is."""
    if ct is None or jnp.issubdtype(aval.dtype, jnp.inexact):
        return ct
    return jnp.zeros(aval.shape, jax.dtypes.float0)


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


def _run_branch(fn: Callable, args: tuple) -> tuple[Any, Graph, Result]:
    """``fn(*args)`` through the IR, its updates kept on the (copied) argument objects:
    the output, the graph of ``args`` and what the call changed."""
    names = arg_names(fn)
    graph = graph_of(args, {}, names)
    out, result = run(fn, args, {}, names=names, graph=graph)
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
def cond(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any) -> Any:
    """``jax.lax.cond`` over objects: a variable written in either branch is updated."""
    return _switch("vj.cond", jnp.asarray(pred, jnp.int32), [false_fun, true_fun],
                   ["false_fun", "true_fun"], operands)


@errors.api_boundary
def switch(index: Any, branches: Sequence[Callable], *operands: Any) -> Any:
    """``jax.lax.switch`` over objects (see ``_switch``)."""
    return _switch("vj.switch", index, list(branches),
                   [f"branch {i}" for i in range(len(branches))], operands)


def _switch(what: str, index: Any, fns: list[Callable], labels: list[str],
            operands: tuple) -> Any:
    """Each branch returns its output and the operands' objects as it left them, so JAX
    sees the same structure from every branch; a variable the branches leave with
    different types is a ``VariableStructureError`` naming it and the branches."""
    graph, written = Graph.of((operands, {})), set()
    first: list[tuple[str, Graph]] = []      # the first branch traced, to compare with

    def branch(fn: Callable, label: str) -> Callable:
        def run_branch(*ops: Any) -> Any:
            ops = _dealias(ops, {}, tuple(graph.places))[0]
            out, inside, result = _run_branch(fn, ops)
            written.update(i for i, v in enumerate(result.updates) if v is not None)
            if first:
                _same_types(what, graph, first[0], (f"{label} ({_name(fn)})", inside))
            else:
                first.append((f"{label} ({_name(fn)})", inside))
            return out, ops
        return run_branch
    out, final = jax.lax.switch(index, [branch(f, label) for f, label in zip(fns, labels)], *operands)
    after = Graph.of((final, {}))
    for i, ((_, cell), (_, new)) in enumerate(zip(graph.cells, after.cells)):
        if i in written:
            cell.set(new.get())
    return out


def _same_types(what: str, before: Graph, a: tuple[str, Graph], b: tuple[str, Graph]) -> None:
    """Two branches must leave every variable of the operands with one type."""
    for (_, old), (_, cell_a), (node, cell_b) in zip(before.cells, a[1].cells, b[1].cells):
        types = [VarType.of(c.get()) for c in (old, cell_a, cell_b)]
        if types[1] != types[2]:
            path = node.prefix + cell_b.path
            raise errors.VariableStructureError(
                f"{what}: variable {errors.format_path(path)} of collection "
                f"'{cell_b.collection}' is {types[1].describe()} after {a[0]} but "
                f"{types[2].describe()} after {b[0]} (it was {types[0].describe()} before); "
                "JAX needs every branch to leave it with one type.",
                collection=cell_b.collection, path=path, **errors.where(),
                fix="write the variable a value of its own dtype in every branch "
                    "(x.astype(v.value.dtype))")


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

    def __init__(self, what: str, fn: Callable, init: Any, trips: int | None, arg: int):
        self.what, self.fn, self.trips, self.arg = what, fn, trips, arg
        self.names, self.tracked = arg_names(fn), _tracked(fn, arg, what == "vj.scan")
        self.graph = Graph.of((init, {}))
        self.places = tuple(self.graph.places)
        self.written: list[set[int]] = [set() for _ in self.graph.nodes]
        self.moves = tuple(range(len(self.graph.nodes)))

    def step(self, args: tuple) -> tuple[Any, Graph, Result]:
        """One step of the body on ``args`` (its carry at ``arg``): the body's output, the
        graph of its arguments (the carry's nodes first) and what it changed."""
        args = args[:self.arg] + (_dealias((args[self.arg],), {}, self.places)[0][0],) \
            + args[self.arg + 1:]
        inside = graph_of(args, {}, self.names)
        (out, order), result = run(self.tracked, args, {}, names=self.names, graph=inside)
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
def while_loop(cond_fun: Callable, body_fun: Callable, init_val: Any) -> Any:
    """``jax.lax.while_loop`` over objects in the carry: the body's updates are carried;
    ``cond_fun`` may read them only (JAX keeps nothing it writes)."""
    carried = _Carried("vj.while_loop", body_fun, init_val, None, 0)

    def cond(v: Any) -> Any:
        out, inside, result = _run_branch(cond_fun, (_dealias((v,), {}, carried.places)[0][0],))
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
def fori_loop(lower: int, upper: int, body_fun: Callable, init_val: Any) -> Any:
    """``jax.lax.fori_loop`` over objects in the carry."""
    carried = _Carried("vj.fori_loop", body_fun, init_val, _trip_count(lower, upper), 1)
    final = jax.lax.fori_loop(lower, upper, lambda i, v: carried.step((i, v))[0], init_val)
    carried.write_back(final)
    return final


def scan(fn: Callable, *, length: int | None = None, reverse: bool = False,
         unroll: int | bool = 1) -> Callable:
    """``jax.lax.scan`` over objects, as ``(carry, xs) -> (carry, ys)``: objects in the carry
    are carried (updated every step, followed by object: ``_Carried``), objects in ``xs``
    are sliced per step and their updates stacked along axis 0."""
    def call(init: Any, xs: Any) -> Any:
        carried = _Carried("vj.scan", fn, init, _scan_length(length, xs), 0)
        xs_graph = Graph.of((xs, {}))
        n_carry = len(carried.graph.cells)

        def step(carry: Any, x: Any) -> Any:
            (new_carry, y), _, result = carried.step((carry, x))
            return new_carry, (y, result.updates[n_carry:])
        final, (ys, stacked) = jax.lax.scan(step, init, xs, length=length, reverse=reverse,
                                            unroll=unroll)
        for (_, cell), value in zip(xs_graph.cells, stacked):
            if value is not None:
                cell.set(value)
        carried.write_back(final)
        return final, ys
    return _wrapper(fn, call)
