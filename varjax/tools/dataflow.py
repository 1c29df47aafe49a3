"""The variable dataflow graph: which variable reads feed which writes and outputs.

``dataflow(target, *args, variables=...)`` traces ``target`` to its effectful jaxpr (no pass
runs) and interprets it abstractly: every value carries the set of *sources* it is derived
from. A source is a variable's value on entry (``("read", collection, path)``) or an RNG
stream (``("rng", stream)``). Sinks are the variables written (``("write", collection, path)``)
and the output leaves (``("output", i)``). The graph has an edge source -> sink whenever a
value derived from the source reaches the sink, so it is bipartite: transitivity through
variables is resolved during the interpretation, not left to graph paths.

Every node has the attributes ``kind`` (``read``/``write``/``rng``/``output``), ``collection``,
``path`` (a tuple), ``module`` (``path[:-1]`` joined with ``/``; ``""`` at top level) and
``label`` (``params:Dense_0/kernel``, ``rng:dropout``, ``output[0]``). RNG and output nodes
have ``collection=""``; an RNG node's path is ``(stream,)`` and an output's is ``()``. Read
and write nodes of one variable share their label; ``kind`` tells them apart.

Rules:

* **Pure equations**: every output depends on every input (JAX gives no finer facts).
* **Variables** are tracked in a *store*: ``var_get`` yields the variable's current sources,
  which are ``{read node}`` until the variable is written and the written value's sources
  after. So ``v.value += 1`` gives ``read v -> write v``, and a value written and read back
  links its own sources straight to where the read value goes. A read node stands for "the
  value given on entry"; a read that only ever sees an earlier write has no out-edges.
* **Calls** (``jit``, ``closed_call``, ``checkpoint``, the primal of ``custom_jvp_call`` /
  ``custom_vjp_call``): the body is interpreted in place, inputs to outputs, sharing the store.
* **Branches** (``cond`` / ``switch``): each branch starts from the same store; outputs and the
  store afterwards are the union over branches. The index is a *control* source: it is added
  to every branch output and to every value a branch writes (which branch ran decides them).
* **Loops** (``scan``, ``while``): a fixpoint. The carried values and the store entering the
  body are joined with what the body returns until nothing grows, so a value written (or
  carried) in iteration i reaches reads in iteration i + 1. Zero iterations are covered: the
  entry values stay in the join. ``while``'s predicate (computed by ``cond_jaxpr`` from the
  carry, which may read variables too) is a control source of the carry outputs and of
  every write in the body. ``scan``'s length is static, so it adds nothing.
* **Unknown higher-order primitives** with varjax effects: everything inside them feeds
  everything they write and return (a sound over-approximation).

The result over-approximates: it may show an edge the program cannot exercise (all of a
primitive's inputs feed all of its outputs), never miss one that is visible in the jaxpr.

Sharp edges:
  * Rules behind thunks (``custom_jvp``'s JVP rule, ``custom_vjp``'s fwd/bwd) are traced by
    JAX only under differentiation, so the variables they read are not in the graph.
  * ``.jaxpr`` traces the ``apply`` path (``initializing=False``): pass the variables of an
    initialized model. Code that branches on ``vj.is_mutable_collection`` shows the path that
    ``mutable=`` selects.
  * The given variables are recorded as the graph attribute ``given`` (a frozenset of
    ``(collection, path)``); ``unreachable`` uses it to report variables never read at all.

The graph is a ``DataflowGraph``, a networkx ``DiGraph`` with ``to_dot()`` and ``render(path)``
(``varjax.tools.dot``: a picture with a legend, through Graphviz).
"""
from __future__ import annotations

import os
import pathlib
from typing import Any, Callable, Hashable, Iterable

import networkx as nx

from varjax import _jax
from varjax.ir import nested
from varjax.ir.effects import RngEffect
from varjax.ir.primitives import Key, Path, rng_draw_p, var_get_p, var_set_p
from varjax.ir.typing import CollectionFilter, RngsLike, VariableDict
from varjax.passes.framework.analysis import key_of, touches_variables
from varjax.tools.dot import render, to_dot
from varjax.tools.target import as_functionalized
from varjax.trace.variable_dicts import flatten_variables

__all__ = ["DataflowGraph", "dataflow", "dead_params", "graph_of_jaxpr", "render", "to_dot",
           "unreachable"]

Node = tuple[Hashable, ...]
Store = dict[Key, frozenset]   # variable -> sources of its current value; missing: its read node

_NONE: frozenset = frozenset()
_KIND_ORDER = {"rng": 0, "read": 1, "write": 2, "output": 3}


class DataflowGraph(nx.DiGraph):
    """The networkx ``DiGraph`` that ``dataflow`` returns, with its pictures as methods."""

    def to_dot(self, name: str = "dataflow", legend: bool = True) -> str:
        """Graphviz DOT text (``varjax.tools.dot.to_dot``)."""
        return to_dot(self, name=name, legend=legend)

    def render(self, path: str | os.PathLike, format: str | None = None, name: str = "dataflow",
               legend: bool = True) -> pathlib.Path:
        """Draw the graph to ``path`` in ``format``, by default the one its suffix names
        (``.svg``, ``.png``, ``.pdf``, ``.dot``...), through Graphviz (``varjax.tools.dot.render``:
        ``MissingDependencyError`` without it); returns the path written."""
        return render(self, path, format=format, name=name, legend=legend)


def dataflow(target: Callable[..., Any], *args: Any, variables: VariableDict | None = None,
             rngs: RngsLike | None = None, mutable: CollectionFilter = False,
             **kwargs: Any) -> DataflowGraph:
    """The variable dataflow graph of ``target`` called on ``args`` (see the module docstring).

    ``target`` is anything ``varjax.tools.target.as_functionalized`` accepts: a function, a
    ``vj.functionalize``-d function, a ``Module`` or a bound method of one.
    """
    fz = as_functionalized(target)
    closed = fz.jaxpr(*args, variables=variables, rngs=rngs, mutable=mutable, **kwargs)
    given = frozenset(flatten_variables(variables or {}))
    return graph_of_jaxpr(closed, given=given)


def graph_of_jaxpr(closed: _jax.ClosedJaxpr | _jax.Jaxpr,
                   given: Iterable[Key] = ()) -> DataflowGraph:
    """The dataflow graph of an effectful jaxpr; ``given`` lists the variables passed in."""
    flow = _Flow()
    jaxpr = nested.open_jaxpr(closed)
    outs, _ = flow.run(jaxpr, [_NONE] * len(jaxpr.invars), {}, _NONE)
    for i, sources in enumerate(outs):
        flow.sink(("output", i), sources)
    graph = DataflowGraph(given=frozenset(given))
    for node in sorted(flow.nodes, key=_order):
        graph.add_node(node, **_attributes(node))
    for sink, sources in flow.edges.items():
        graph.add_edges_from((s, sink) for s in sources)
    return graph


class _Flow:
    """The abstract interpreter: values -> sources, plus the nodes and edges it records."""

    def __init__(self) -> None:
        self.nodes: set[Node] = set()
        self.edges: dict[Node, set[Node]] = {}

    def sink(self, node: Node, sources: frozenset) -> None:
        self.nodes.add(node)
        self.edges.setdefault(node, set()).update(sources)

    def run(self, jaxpr: _jax.Jaxpr, ins: list[frozenset], store: Store,
            control: frozenset) -> tuple[list[frozenset], Store]:
        """Sources of ``jaxpr``'s outputs given its inputs' sources, and the store after it.

        ``control`` holds the sources that decide whether this code runs at all; they are
        added to every value written here (the caller adds them to the outputs it returns).
        """
        env: dict[Any, frozenset] = dict(zip(jaxpr.invars, ins))
        store = dict(store)

        def read(atom: Any) -> frozenset:
            return _NONE if isinstance(atom, _jax.Literal) else env.get(atom, _NONE)

        for eqn in jaxpr.eqns:
            ins_ = [read(a) for a in eqn.invars]
            if eqn.primitive is var_get_p:
                key = key_of(eqn)
                self.nodes.add(("read", *key))
                outs = [_current(store, key)] * len(eqn.outvars)
            elif eqn.primitive is var_set_p:
                key = key_of(eqn)
                value = _union(ins_) | control
                self.sink(("write", *key), value)
                store[key] = value
                outs = []
            elif eqn.primitive is rng_draw_p:
                node = ("rng", eqn.params["stream"])
                self.nodes.add(node)
                outs = [frozenset({node})] * len(eqn.outvars)
            elif _effectful(eqn):
                outs, store = self.higher_order(eqn, ins_, store, control)
            else:
                outs = [_union(ins_)] * len(eqn.outvars)
            env.update(zip(eqn.outvars, outs))
        return [read(a) for a in jaxpr.outvars], store

    def higher_order(self, eqn: _jax.JaxprEqn, ins: list[frozenset], store: Store,
                     control: frozenset) -> tuple[list[frozenset], Store]:
        spec = nested.TABLE.get(eqn.primitive)
        bodies = [nested.open_jaxpr(b) for b in nested.bodies(eqn)]
        if spec is None or (spec.kind == "call" and len(bodies[0].invars) != len(ins)):
            return self.opaque(eqn, ins, store, control)
        if spec.kind == "call":
            return self.run(bodies[0], ins, store, control)
        if spec.kind == "branch":
            index, ops = ins[0], ins[1:]
            results = [self.run(b, ops, store, control | index) for b in bodies]
            outs = [_union(o) | index for o in zip(*(r[0] for r in results))]
            return outs, _join(*(r[1] for r in results))
        if eqn.primitive is _jax.scan_p:
            return self.scan(bodies[0], eqn.params, ins, store, control)
        if eqn.primitive is _jax.while_p:
            return self.while_loop(bodies[0], bodies[1], eqn.params, ins, store, control)
        return self.opaque(eqn, ins, store, control)

    def scan(self, body: _jax.Jaxpr, params: dict, ins: list[frozenset], store: Store,
             control: frozenset) -> tuple[list[frozenset], Store]:
        n_consts, n_carry = params["num_consts"], params["num_carry"]
        consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
        while True:
            outs, after = self.run(body, consts + carry + xs, store, control)
            new_carry = [c | o for c, o in zip(carry, outs[:n_carry])]
            new_store = _join(store, after)
            if new_carry == carry and new_store == store:
                return carry + outs[n_carry:], store
            carry, store = new_carry, new_store

    def while_loop(self, cond: _jax.Jaxpr, body: _jax.Jaxpr, params: dict, ins: list[frozenset],
                   store: Store, control: frozenset) -> tuple[list[frozenset], Store]:
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond_consts, body_consts, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
        while True:
            (pred, *_), tested = self.run(cond, cond_consts + carry, store, control)
            outs, after = self.run(body, body_consts + carry, tested, control | pred)
            new_carry = [c | o | pred for c, o in zip(carry, outs)]
            new_store = _join(store, tested, after)
            if new_carry == carry and new_store == store:
                return carry, store
            carry, store = new_carry, new_store

    def opaque(self, eqn: _jax.JaxprEqn, ins: list[frozenset], store: Store,
               control: frozenset) -> tuple[list[frozenset], Store]:
        """An equation whose bodies we cannot follow: all it sees feeds all it writes/returns."""
        store = dict(store)
        everything = _union(ins) | control
        written: set[Key] = set()
        inner_eqns = (inner for sub in nested.subjaxprs(eqn) for inner, _ in nested.walk_eqns(sub))
        for inner in inner_eqns:
            if inner.primitive is var_get_p:
                self.nodes.add(("read", *key_of(inner)))
                everything |= _current(store, key_of(inner))
            elif inner.primitive is rng_draw_p:
                node = ("rng", inner.params["stream"])
                self.nodes.add(node)
                everything |= {node}
            elif inner.primitive is var_set_p:
                written.add(key_of(inner))
        for key in written:
            self.sink(("write", *key), everything)
            store[key] = everything | _current(store, key)
        return [everything] * len(eqn.outvars), store


def _effectful(eqn: _jax.JaxprEqn) -> bool:
    return touches_variables(eqn.effects) or any(type(e) is RngEffect for e in eqn.effects)


def _current(store: Store, key: Key) -> frozenset:
    return store.get(key, frozenset({("read", *key)}))


def _union(sets: Iterable[frozenset]) -> frozenset:
    return frozenset().union(*sets)


def _join(*stores: Store) -> Store:
    """The store after one of ``stores`` (a missing key keeps its read node as its value)."""
    keys = set().union(*stores)
    return {k: _union(_current(s, k) for s in stores) for k in keys}


# -- node attributes ---------------------------------------------------------------------

def _attributes(node: Node) -> dict[str, Any]:
    kind = node[0]
    if kind in ("read", "write"):
        collection, path = node[1], node[2]
        return dict(kind=kind, collection=collection, path=path, module="/".join(path[:-1]),
                    label=f"{collection}:{'/'.join(path)}")
    if kind == "rng":
        return dict(kind=kind, collection="", path=(node[1],), module="", label=f"rng:{node[1]}")
    return dict(kind=kind, collection="", path=(), module="", label=f"output[{node[1]}]")


def _order(node: Node) -> tuple:
    return (_KIND_ORDER[node[0]], *map(str, node[1:])) if node[0] != "output" else (3, node[1])


# -- analyses ----------------------------------------------------------------------------

def unreachable(graph: nx.DiGraph, collection: str = "params") -> list[Path]:
    """Paths of ``collection`` whose given value can affect nothing the call produces.

    These are the variables that are read but reach no output and no write (for example,
    params of a layer built in ``setup`` but never called on the loss path), plus the
    variables recorded as given (graph attribute ``given``) that are never read at all.
    """
    sinks = {n for n, kind in graph.nodes(data="kind") if kind in ("write", "output")}
    dead = {graph.nodes[n]["path"] for n, data in graph.nodes(data=True)
            if data["kind"] == "read" and data["collection"] == collection
            and not (nx.descendants(graph, n) & sinks)}
    read = {graph.nodes[n]["path"] for n, kind in graph.nodes(data="kind") if kind == "read"
            and graph.nodes[n]["collection"] == collection}
    dead |= {path for col, path in graph.graph.get("given", ()) if col == collection} - read
    return sorted(dead)


def dead_params(target: Callable[..., Any], *args: Any, variables: VariableDict,
                rngs: RngsLike | None = None, mutable: CollectionFilter = False,
                **kwargs: Any) -> list[Path]:
    """``unreachable(dataflow(...), "params")``: the params that cannot affect the result."""
    graph = dataflow(target, *args, variables=variables, rngs=rngs, mutable=mutable, **kwargs)
    return unreachable(graph, "params")
