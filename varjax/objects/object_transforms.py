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
updates under ``vmap``, the aux output of ``grad``.  Branches and loops, whose carries move
objects between places, are ``varjax.objects.control_flow``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax

from varjax.ir import errors
from varjax.objects import inspection
from varjax.objects.graph import ArgumentGraphs, Graph
from varjax.objects.layout import Layout
from varjax.objects.nodes import VariableKind, is_node
from varjax.objects.run import Result, arg_names, graph_of, run
from varjax.passes.framework.pipeline import parse_entries
from varjax.trace.variable import HeldValues


def dealias(args: tuple, kwargs: dict, places: tuple[int, ...]) -> tuple[tuple, dict]:
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


def _originals(args: tuple, kwargs: dict, names: Sequence[str]) -> Graph:
    """The argument objects of one call, to write back into; the only graph the call
    builds.  Inside the transform ``run`` takes JAX's copies apart by its layout
    (``Graph.copies``); JAX copies each place separately, so what the originals share
    (``Graph.shared``) is found here and handed in too."""
    return graph_of(args, kwargs, names)


def _copies(layout: Layout, args: tuple, kwargs: dict) -> Graph:
    return Graph.copies(layout, (args, dict(kwargs)))


class _Pure:
    """``fn`` as the pure function a JAX transform takes: ``(*copies) -> (out, Result)``,
    one per argument structure (``key``: the graph's ``places``, its ``shared`` cells, then
    what the transform adds), cached so JAX's caches see the same function."""

    def __init__(self, fn: Callable, names: Sequence[str], passes: tuple = (),
                 donated: tuple[int | str, ...] = ()):
        self.fn, self.names, self.passes = fn, tuple(names), passes
        self.donated = donated     # arguments (positions, names) whose buffers are donated
        self._made: dict[Any, Callable] = {}
        self.graphs = ArgumentGraphs()

    def run(self, args: tuple, kwargs: dict, graph: Graph, **options: Any) -> tuple[Any, Result]:
        """``run`` of ``fn`` on JAX's copies (``graph`` their nodes); with donated arguments,
        every cell of their nodes comes back as an update (``_donated``)."""
        kept = _donated(graph, self.donated, len(args))
        out, result = run(self.fn, args, kwargs, graph=graph, passes=self.passes, **options)
        if kept:
            updates = list(result.updates)
            for i, value in kept:
                if updates[i] is None:
                    updates[i] = value
            result = Result(updates, result.created, result.captured)
        return out, result

    def originals(self, args: tuple, kwargs: dict) -> Graph:
        """The argument objects of one call (``_originals``), kept across calls."""
        return self.graphs.of(args, kwargs, lambda: _originals(args, kwargs, self.names))

    def get(self, graph: Graph, make: Callable[[Callable], Callable], extra: tuple = (),
            first: Sequence[int] = ()) -> Callable:
        """``make(pure)`` for the argument structure of ``graph``: which places hold one
        object, which cells one variable (``Graph.shared``), whose value each shared
        variable is read from (``Graph.sources`` of the ``first`` nodes), and what the
        transform adds (``extra``)."""
        layout, shared = graph.layout(), graph.shared()
        places = layout.places
        sources = graph.sources(first) if first else shared
        key = (layout, shared, sources, extra)
        found = self._made.get(key)
        if found is None:
            def pure(*args: Any, **kwargs: Any) -> tuple[Any, Result]:
                args, kwargs = dealias(args, kwargs, places)
                return self.run(args, kwargs, _copies(layout, args, kwargs), shared=shared,
                                sources=sources)
            functools.update_wrapper(pure, self.fn)
            found = self._made[key] = make(pure)
        return found

    def flat(self, graph: Graph, make: Callable[[Callable], Callable]) -> Callable:
        """A call ``args -> out`` for a graph kept by ``ArgumentGraphs``, writing back:
        ``make`` of ``pure`` taking each object argument (a node, or a container of nodes
        such as an NNX module) as two flat lists at its position (so ``donate_argnums``
        means what it says): the values of its held Variables, all arguments' read in one
        call (``HeldValues``), and the pytree children of its other leaves (``Rngs``, an
        array attribute), read from the nodes without walking the arguments.  The objects'
        static parts key that function once per graph, instead of JAX hashing them on every
        call, and it returns the ``Result``'s fields as a tuple (JAX unflattens a tuple
        faster than a dataclass)."""
        positions = graph.node_args
        per_arg: dict[int, list[Any]] = {i: [] for i in positions}
        places = iter(graph.places)
        for leaf, path, is_object in zip(graph.leaves, graph.paths, graph.is_object):
            node = graph.nodes[next(places)] if is_object else None
            if path[0] == "0" and int(path[1]) in per_arg:
                per_arg[int(path[1])].append((leaf, node))
        variables: list[Any] = []
        others: list[Callable[[], tuple]] = []
        sources: list[tuple[tuple[bool, int, int], ...]] = []    # per argument, per leaf
        spans: list[tuple[int, int, int, int, int]] = []    # per argument: where its values are
        size = 0    # of the other leaves' children
        for i in positions:
            v0, c0, mine = len(variables), size, []
            for leaf, n in per_arg[i]:
                if n is not None and isinstance(n.kind, VariableKind):
                    mine.append((True, len(variables) - v0, 0))
                    variables.append(n.obj)
                else:
                    reader = n.kind.reader(n.obj) if n is not None else _constant(leaf)
                    mine.append((False, size - c0, size - c0 + len(reader())))
                    others.append(reader)
                    size += len(reader())
            sources.append(tuple(mine))
            spans.append((i, v0, len(variables), c0, size))
        held = HeldValues.of(variables)
        read_held = held.read if held is not None else lambda: [v.value for v in variables]
        arg_defs = graph.treedef.children()[0].children()   # (args, kwargs): nodes as leaves
        defs = tuple((arg_defs[i], tuple(_one_level(leaf) for leaf, _ in per_arg[i]))
                     for i in positions)
        layout, shared = graph.layout(), graph.shared()
        key = ("flat", layout, shared, positions, defs, tuple(sources))
        jitted = self._made.get(key)
        if jitted is None:
            def pure(*flat_args: Any) -> tuple:
                args = list(flat_args)
                for i, (outer, inner), mine in zip(positions, defs, sources):
                    values, children = args[i]
                    args[i] = outer.unflatten([
                        d.unflatten((values[a],) if is_held else tuple(children[a:b]))
                        for d, (is_held, a, b) in zip(inner, mine)])
                args, _ = dealias(tuple(args), {}, layout.places)
                out, result = self.run(args, {}, _copies(layout, args, {}), shared=shared)
                # No variable created (the usual step): no per-node dicts for JAX to build.
                created = result.created if any(result.created) else ()
                return out, result.updates, created, result.captured
            functools.update_wrapper(pure, self.fn)
            jitted = self._made[key] = make(pure)

        write_back = graph.write_back

        def call(args: tuple) -> Any:
            flat_args = list(args)
            values = read_held()
            children = [c for read in others for c in read()] if others else []
            for i, v0, v1, c0, c1 in spans:
                flat_args[i] = (values[v0:v1], children[c0:c1])
            out, updates, created, _ = jitted(*flat_args)
            write_back(updates, created)
            return out
        return call


def _donated(graph: Graph, donated: tuple[int | str, ...], count: int) -> list[tuple[int, Any]]:
    """``(cell index, value)`` of every cell of the nodes of the ``donated`` arguments (a
    position among ``count``, or a keyword), read from JAX's copies before the call.  ``jax.jit`` deletes a
    donated argument's buffers, so a variable the call did not write must come back as an
    output too, or its object would be left holding a deleted array (flax.nnx returns every
    Variable of an argument)."""
    if not donated:
        return []
    wanted = {("0", str(i % count)) if isinstance(i, int) else ("1", i) for i in donated}
    nodes: set[int] = set()
    places = iter(graph.places)
    for path, is_object in zip(graph.paths, graph.is_object):
        if is_object:
            j = next(places)
            if tuple(path[:2]) in wanted:
                nodes.add(j)
    found: list[tuple[int, Any]] = []
    start = 0
    for j, node in enumerate(graph.nodes):
        if j in nodes:
            found += [(start + c, cell.get()) for c, cell in enumerate(node.cells)]
        start += len(node.cells)
    return found


def _constant(value: Any) -> Callable[[], tuple]:
    """The reader of a leaf of an object argument that is not a node (an array attribute of
    a module): the watch of its container says it is the same object."""
    return lambda: (value,)


def _one_level(node: Any) -> Any:
    """The treedef of ``node`` with its children as leaves."""
    return jax.tree.structure(node, is_leaf=lambda x: x is not node)


def wrapper(fn: Callable, call: Callable[..., Any]) -> Callable:
    """``call`` as the transformed ``fn``: a public entry point, whose varjax errors leave
    without varjax's frames (``errors.api_boundary``), as Linen-mode ones do."""
    return functools.wraps(fn)(errors.api_boundary(call))


# --- jit, remat ---------------------------------------------------------------------------

def jit(fn: Callable, *, static_argnums: int | Sequence[int] = (),
        static_argnames: Sequence[str] = (), donate_argnums: int | Sequence[int] = (),
        donate_argnames: str | Sequence[str] = (),
        in_shardings: Callable[[tuple], Any] | None = None, out_shardings: Any = None,
        keep_unused: bool = False, device: jax.Device | None = None,
        backend: str | None = None, inline: bool = False, passes: Any = ()) -> Callable:
    """``jax.jit`` over objects: their variables are traced inputs; updates come back.
    ``passes`` (instances or pipeline strings) run on the call's IR, on every variable of
    its objects, as ``apply(passes=...)`` runs them on a model's: an NNX train step with
    ``stop-gradient{collection=params}`` or ``fake-quant``.  The call returned is marked
    (``inspection.mark``), so ``vj.dump`` of it shows the IR it runs.

    ``in_shardings(args)`` gives the call's prefix of shardings over every positional
    argument (static ones included, as None), an object's entry a sharding of all its
    variables or a tree of them; each variable's update comes back with its object's
    sharding, so a sharded parameter stays sharded across train steps, as in flax.nnx.
    ``out_shardings`` is ``jax.jit``'s, over ``fn``'s output.

    ``donate_argnums``/``donate_argnames``: an object argument's variables are donated, and
    every one of them comes back as an output (``_donated``), written or not.
    ``keep_unused``, ``device``, ``backend`` and ``inline`` are ``jax.jit``'s."""
    parsed = parse_entries(passes)
    donated = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    names = (donate_argnames,) if isinstance(donate_argnames, str) else tuple(donate_argnames)
    pure = _Pure(fn, arg_names(fn), parsed, donated + names)
    statics = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    sharded = in_shardings is not None or out_shardings is not None

    def make(p: Callable, dynamic_in: Any = None, result: Any = None) -> Callable:
        return jax.jit(p, static_argnums=static_argnums, static_argnames=static_argnames,
                       donate_argnums=donate_argnums, donate_argnames=donate_argnames,
                       in_shardings=dynamic_in,
                       out_shardings=None if not sharded else (out_shardings, result),
                       keep_unused=keep_unused, device=device, backend=backend, inline=inline)

    def call(*args: Any, **kwargs: Any) -> Any:
        graph = pure.originals(args, kwargs)
        if graph.node_args is not None and not sharded:
            flat = graph.memo.get("jit")
            if flat is None:     # a static object argument is hashed whole: no flat call
                static = {i % len(args) for i in statics} & set(graph.node_args)
                flat = graph.memo["jit"] = False if static else pure.flat(graph, make)
            if flat:
                return flat(args)
        if not sharded:
            out, result = pure.get(graph, make)(*args, **kwargs)
        else:
            out, result = _sharded(pure, graph, make, in_shardings, statics, args, kwargs)
        graph.write_back(result.updates, result.created)
        return out
    return inspection.mark(wrapper(fn, call), fn, parsed)


def _sharded(pure: _Pure, graph: Graph, make: Callable, in_shardings: Callable | None,
             statics: tuple[int, ...], args: tuple, kwargs: dict) -> tuple[Any, Result]:
    """A ``jit`` call with shardings: ``jax.jit`` of the call's structure and shardings
    (its arguments' entries without the static ones, as ``jax.jit`` takes them; each
    update with its object's sharding, ``_node_axes`` as ``vmap`` places its axes).  Every
    variable of a sharded object is placed on its sharding first (``_place``)."""
    prefix = None if in_shardings is None else in_shardings(args)
    entries = tuple(prefix) if isinstance(prefix, (tuple, list)) else (prefix,) * len(args)
    nodes = _node_axes(entries, args, kwargs, graph, "jit", "in_shardings", None)
    cells = _cell_axes(graph, nodes, "jit", "in_shardings")
    static = {i % len(args) for i in statics} if args else set()
    dynamic = (prefix if not isinstance(prefix, (tuple, list))
               else tuple(e for i, e in enumerate(entries) if i not in static))
    _place(graph, cells)
    result = Result(cells, None, None)
    jitted = pure.get(graph, lambda p: make(p, dynamic, result),
                      (tuple(cells), _hashable(dynamic)))
    return jitted(*args, **kwargs)


def _place(graph: Graph, shardings: list[Any]) -> None:
    """Each variable's value put on its cell's sharding, where it is not: ``jax.jit`` would
    copy it there on every call, and flax.nnx gives back every variable of a sharded
    argument on it, read or written; a value being traced is left to ``jax.jit``."""
    for (_, cell), sharding in zip(graph.cells, shardings):
        value = cell.get() if sharding is not None else None
        if (isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)
                and not value.sharding.is_equivalent_to(sharding, value.ndim)):
            cell.set(jax.device_put(value, sharding))


def _hashable(tree: Any) -> tuple:
    """A cache key of a prefix of shardings: its structure and its (hashable) shardings."""
    leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: x is None)
    return treedef, tuple(leaves)


def remat(fn: Callable, *, prevent_cse: bool = True, static_argnums: int | Sequence[int] = (),
          policy: Callable | None = None, passes: Any = ()) -> Callable:
    """``jax.checkpoint`` over objects (``passes`` as ``jit``'s)."""
    pure = _Pure(fn, arg_names(fn), parse_entries(passes))

    def call(*args: Any, **kwargs: Any) -> Any:
        graph = pure.originals(args, kwargs)
        checkpointed = pure.get(graph, lambda p: jax.checkpoint(
            p, prevent_cse=prevent_cse, static_argnums=static_argnums, policy=policy))
        out, result = checkpointed(*args, **kwargs)
        graph.write_back(result.updates, result.created)
        return out
    return wrapper(fn, call)


# --- vmap ---------------------------------------------------------------------------------

def _node_axes(in_axes: Any, args: tuple, kwargs: dict, graph: Graph, what: str,
               name: str = "in_axes", at_keyword: Any = 0) -> list[Any]:
    """The axis of every node (``in_axes`` as JAX broadcasts it, keyword arguments at
    ``at_keyword``); ``TransformError`` when one object is passed at two different axes.
    ``jit`` places its shardings the same way (``name``: the option's name)."""
    prefix = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    if len(prefix) != len(args):
        raise errors.TransformError(
            f"{what}: {name} has {len(prefix)} entries for {len(args)} arguments.",
            **errors.where(), fix=f"give one {name} entry per positional argument")
    per_place: list[Any] = []

    def visit(axis: Any, sub: Any) -> None:
        per_place.extend([axis] * sum(map(is_node, jax.tree.leaves(sub, is_leaf=is_node))))
    for axis, arg in zip(prefix, args):
        jax.tree.map(visit, axis, arg, is_leaf=lambda x: x is None)
    for value in kwargs.values():
        visit(at_keyword, value)
    axes: dict[int, Any] = {}
    for node_index, axis in zip(graph.places, per_place):
        if axes.setdefault(node_index, axis) != axis:
            node = graph.nodes[node_index]
            raise errors.InconsistentAliasError(
                f"{what}: one object is passed twice, with {name} {axes[node_index]} and "
                f"{axis}; it has one value, so it cannot be both.",
                path=node.prefix or None, **errors.where(),
                fix=f"pass it once, or with the same {name} entry in both places")
    return [axes[i] for i in range(len(graph.nodes))]


def _cell_axes(graph: Graph, axes: list[Any], what: str, name: str = "in_axes") -> list[Any]:
    """Per cell, its node's axis; ``InconsistentAliasError`` naming the variable when one
    variable is reached through two objects at different axes (a module at 0 and its
    submodule at None): it has one value, so it cannot be both."""
    cell_axes = [axes[graph.nodes.index(node)] for node, _ in graph.cells]
    for i, s in enumerate(graph.shared()):
        if cell_axes[i] != cell_axes[s]:
            cell = graph.cells[s][1]      # named as in the object holding the most
            raise errors.InconsistentAliasError(
                f"{what}: variable {errors.format_path(cell.path)} of collection "
                f"'{cell.collection}' is reached through two objects, with {name} "
                f"{cell_axes[s]} and {cell_axes[i]}; it has one value, so it cannot be both.",
                collection=cell.collection, path=cell.path, **errors.where(),
                fix=f"pass the objects that share it with the same {name} entry, or one of "
                    "them only")
    return cell_axes


def vmap(fn: Callable | None = None, *, in_axes: Any = 0, out_axes: Any = 0,
         axis_size: int | None = None, axis_name: Any = None, spmd_axis_name: Any = None,
         passes: Any = ()) -> Any:
    """``jax.vmap`` over objects; an update is stacked along its object's axis.  ``passes``
    (as ``jit``'s) run on the body's IR, once, before JAX batches it; ``spmd_axis_name`` is
    ``jax.vmap``'s (the mesh axes the mapped axis is sharded over)."""
    if fn is None:
        return functools.partial(vmap, in_axes=in_axes, out_axes=out_axes,
                                 axis_size=axis_size, axis_name=axis_name,
                                 spmd_axis_name=spmd_axis_name, passes=passes)
    pure = _Pure(fn, arg_names(fn), parse_entries(passes))

    def call(*args: Any, **kwargs: Any) -> Any:
        graph = pure.originals(args, kwargs)
        axes = _node_axes(in_axes, args, kwargs, graph, "vj.vmap")
        cell_axes = _cell_axes(graph, axes, "vj.vmap")
        result_axes = Result(cell_axes, axes, 0)
        vmapped = pure.get(graph, lambda p: jax.vmap(
            p, in_axes=tuple(in_axes) if isinstance(in_axes, list) else in_axes,
            out_axes=(out_axes, result_axes), axis_size=axis_size, axis_name=axis_name,
            spmd_axis_name=spmd_axis_name),
            (tuple(cell_axes),))
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
    return wrapper(fn, call)


# --- grad ---------------------------------------------------------------------------------

def value_and_grad(fn: Callable, *, argnums: int | Sequence[int] = 0,
                   has_aux: bool = False, holomorphic: bool = False,
                   passes: Any = ()) -> Callable:
    """``jax.value_and_grad`` over objects: every float variable of the ``argnums``
    arguments is differentiated (integer ones get ``float0`` zeros), and the gradient has
    the argument's type (a bound module of cotangents for a bound module).  ``passes`` (as
    ``jit``'s) run on the function's IR before JAX differentiates it: with
    ``stop-gradient{collection=params}`` the params' gradient is zero.  ``holomorphic``:
    ``jax.value_and_grad``'s (every differentiated variable and the value complex)."""
    pure = _Pure(fn, arg_names(fn), parse_entries(passes))

    def call(*args: Any, **kwargs: Any) -> Any:
        graph = pure.originals(args, kwargs)

        def make(p: Callable) -> Callable:
            def loss(*a: Any, **k: Any) -> Any:
                out, result = p(*a, **k)
                value, aux = out if has_aux else (out, None)
                return value, (aux, result)
            return jax.value_and_grad(loss, argnums=argnums, has_aux=True,
                                      holomorphic=holomorphic, allow_int=True)
        shared = graph.shared()
        first = _nodes_of(args, graph, argnums) if shared != tuple(range(len(shared))) else ()
        (value, (aux, result)), grads = pure.get(graph, make, first=first)(*args, **kwargs)
        graph.write_back(result.updates, result.created)
        return ((value, aux) if has_aux else value), grads
    return wrapper(fn, call)


def _nodes_of(args: tuple, graph: Graph, argnums: int | Sequence[int]) -> tuple[int, ...]:
    """The nodes of the ``argnums`` arguments, in order: a variable they share with another
    argument is read from them, so its whole gradient is theirs."""
    wanted = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    places = iter(graph.places)
    found: list[int] = []
    for i, arg in enumerate(args):
        for leaf in jax.tree.leaves(arg, is_leaf=is_node):
            if is_node(leaf):
                j = next(places)
                if i in wanted and j not in found:
                    found.append(j)
    return tuple(found)


def grad(fn: Callable, *, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         holomorphic: bool = False, passes: Any = ()) -> Callable:
    """``jax.grad`` over objects (see ``value_and_grad``)."""
    both = value_and_grad(fn, argnums=argnums, has_aux=has_aux, holomorphic=holomorphic,
                          passes=passes)

    def call(*args: Any, **kwargs: Any) -> Any:
        out, grads = both(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads
    return wrapper(fn, call)
