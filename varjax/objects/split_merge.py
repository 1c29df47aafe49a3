"""``vj.split`` / ``vj.merge`` / ``vj.state``: a node as a static graphdef and states.

A state is a nested dict in the variables-dict layout, ``{collection: {scope:
{name: value}}}``, where the scope is the node's place in the tree followed by the
variable's path inside the node (``params:Dense_0/kernel`` for a bound module given
alone).  A plain variables dict is its own state: its leaves are the variables.
``split`` sorts every variable into the first filter that matches it; ``merge``
builds new objects of the same structure from the values (JAX's unflatten of each
object's treedef, so a bound module comes back as a bound module of the same class).
An object reached twice is stored once and comes back as one object.

``merge`` and ``update`` take only what fits: every given variable must be one of the
node's, of the type it had (``type_checks.mismatch``, as ``apply`` checks a given
variable), or they raise before building or writing anything.  ``merge`` compares with the
types at ``split``, up to axes that only one side has: a state split outside ``vj.vmap`` or
``vj.scan`` and merged inside it (or the reverse) differs by the axis the transform adds.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax

from varjax.ir import errors, filters
from varjax.ir.primitives import Key, VarType
from varjax.ir.typing import Filter, Node, VariableDict
from varjax.objects.graph import Graph
from varjax.trace import type_checks
from varjax.trace.variable_dicts import unflatten_variables, variable_entries

_FIX_TYPE = "pass a state of this model's architecture (what vj.split or vj.state of it returns)"


@dataclasses.dataclass(frozen=True)
class GraphDef:
    """The static half of ``split``; hashable, so it can be a static ``jax.jit`` argument.

    ``outer``: the treedef with every object a leaf; ``parts``: per outer leaf, the
    variable it is (a plain leaf) or the index of the object; ``objects``: per object,
    its own treedef and the ``(variable, number of leaves)`` of each of its cells."""

    outer: jax.tree_util.PyTreeDef
    parts: tuple[tuple[str, Any], ...]
    objects: tuple[tuple[Any, tuple[tuple[Key, int], ...]], ...]
    # Per object, its leaves that are not variables: the keys and call count of a module
    # bound with ``rngs={...}`` (not state: they travel with the graphdef).
    extras: tuple[tuple[Any, ...], ...] = dataclasses.field(default=(), compare=False)
    # Per variable, its type when split (None: a leaf that is no array), which ``merge``
    # checks the values against.  Not compared: it follows from the states' avals, which a
    # jit cache already keys on, and hashing it would cost every call that passes the graphdef.
    types: Mapping[Key, VarType | None] = dataclasses.field(default_factory=dict, compare=False)


def _type_of(value: Any) -> VarType | None:
    """A variable value's type; None for a leaf that is no array (a string), left unchecked."""
    try:
        return VarType.of(value)
    except TypeError:
        return None


def _not_a_variable(what: str, names: tuple[str, ...], leaf: Any) -> errors.TransformError | None:
    """The error for a leaf of the node that cannot be a variable: an unbound module (its
    variables are not in it), or the node itself being one value (it has no collection)."""
    module = getattr(leaf, "module", None)    # an unbound module's one pytree leaf holds it
    if getattr(type(module), "_varjax_module", False):
        place = f" at {errors.format_path(names[:-1])}" if names[:-1] else ""
        return errors.TransformError(
            f"{what}: the {type(module).__name__} module{place} is not bound, and an unbound "
            "module has no variables.", **errors.where(),
            fix="bind it to its variables (model.bind(variables)), or make them with "
                "model.init(key, x)")
    if names:
        return None
    have = _type_of(leaf)
    got = f"a bare array ({have.describe()})" if have is not None else \
        f"a {type(leaf).__name__} ({repr(leaf)[:40]})"
    return errors.TransformError(
        f"{what}: got {got}; a state needs variables, each in a collection.", **errors.where(),
        fix="pass a bound module (model.bind(variables)), a vj.Variable, or a variables dict "
            "{'params': {'x': x}}")


def _split_node(node: Any, what: str) -> tuple[GraphDef, list[tuple[Key, Any]]]:
    graph = Graph.of(node)
    entries: list[tuple[Key, Any]] = []
    parts: list[tuple[str, Any]] = []
    place = iter(graph.places)
    for names, leaf, is_object in zip(graph.paths, graph.leaves, graph.is_object):
        if is_object:
            parts.append(("object", next(place)))
            continue
        error = _not_a_variable(what, names, leaf)
        if error is not None:
            raise error
        key = (names[0], names[1:])
        parts.append(("variable", key))
        entries.append((key, leaf))
    objects, extras = [], []
    for n in graph.nodes:
        cells = []
        for cell in n.cells:
            key, value = (cell.collection, n.prefix + cell.path), cell.get()
            entries.append((key, value))
            cells.append((key, len(jax.tree.leaves(value))))
        leaves, treedef = jax.tree.flatten(n.obj)
        objects.append((treedef, tuple(cells)))
        extras.append(tuple(leaves[sum(count for _, count in cells):]))
    types = {key: _type_of(value) for key, value in entries}
    return GraphDef(graph.treedef, tuple(parts), tuple(objects), tuple(extras), types), entries


def _matches(f: Any, key: Key, value: Any) -> bool:
    """Whether filter ``f`` takes the variable ``key``: a collection name, a list or tuple
    (any), ``True``/``...`` (all), ``False``, ``vj.DenyList``, or ``pred(path, value)``."""
    if f is Ellipsis:
        return True
    if isinstance(f, filters.DenyList):
        return not _matches(f.deny, key, value)
    if isinstance(f, (tuple, list)):
        return any(_matches(x, key, value) for x in f)
    if callable(f):
        return bool(f((key[0], *key[1]), value))
    return filters.matches(f, key[0])


def split(node: Node, *filters_: Filter) -> tuple:
    """``(graphdef, state)``, or ``(graphdef, s1, ..., sn)``: one state per filter, each
    variable in the first filter it matches (``TransformError`` if none)."""
    return _split(node, filters_, "vj.split")


def _split(node: Any, filters_: tuple, what: str) -> tuple:
    graphdef, entries = _split_node(node, what)
    chosen = filters_ or (True,)
    groups: list[list[tuple[Key, Any]]] = [[] for _ in chosen]
    for key, value in entries:
        for group, f in zip(groups, chosen):
            if _matches(f, key, value):
                group.append((key, value))
                break
        else:
            raise errors.TransformError(
                f"vj.split: variable {errors.format_path(key[1])} of collection '{key[0]}' "
                "matches none of the filters.", collection=key[0], path=key[1],
                **errors.where(), fix="add a filter that matches it, or end with ... (the rest)")
    return (graphdef, *(unflatten_variables(dict(g)) for g in groups))


def state(node: Node, *filters_: Filter) -> VariableDict | tuple[VariableDict, ...]:
    """The state of ``node``: one dict, or a tuple of dicts for several filters.  Unlike
    ``split``, a variable that matches no filter is left out (it is not asked for)."""
    if not filters_:
        return _split(node, (), "vj.state")[1]
    _, *states, _ = _split(node, (*filters_, ...), "vj.state")
    return tuple(states) if len(filters_) > 1 else states[0]


def flatten_state(state_: Any, into: dict[Key, Any]) -> dict[Key, Any]:
    """Add a state's variables to ``into`` as ``{(collection, path): value}``."""
    if not isinstance(state_, dict):
        raise errors.InvalidVariablesError(
            f"vj.merge: a state is a dict of collections, got {type(state_).__name__}.",
            **errors.where(), fix="pass the states vj.split returned")
    for (col, path), value in variable_entries(state_):
        if (col, path) in into:
            raise errors.TransformError(
                f"vj.merge: variable {errors.format_path(path)} of collection '{col}' is in "
                "two of the states.", collection=col, path=path, **errors.where(),
                fix="pass each variable in one state, as split returned them")
        into[(col, path)] = value
    return into


def merge(graphdef: GraphDef, *states: VariableDict) -> Node:
    """The node that ``split`` took apart, as new objects holding the states' values."""
    if not isinstance(graphdef, GraphDef):
        raise errors.TransformError(
            f"vj.merge needs the graphdef vj.split returned, got {type(graphdef).__name__}.",
            **errors.where(), fix="call vj.merge(graphdef, *states) with split's first result")
    values: dict[Key, Any] = {}
    for s in states:
        flatten_state(s, values)
    for key in graphdef.types:
        if key not in values:
            raise errors.TransformError(
                f"vj.merge: variable {errors.format_path(key[1])} of collection '{key[0]}' is "
                "in none of the states.", collection=key[0], path=key[1], **errors.where(),
                fix="pass every state that split returned")
    _check_unknown("vj.merge", values, graphdef.types, "the node split (dropping it would lose it)")
    for key, want in graphdef.types.items():
        _check_type("vj.merge", key, values[key], want, lifted=True)
    objects = []
    for (treedef, cells), extra in zip(graphdef.objects, graphdef.extras):
        leaves = [x for key, _ in cells for x in jax.tree.leaves(values[key])]
        objects.append(jax.tree.unflatten(treedef, [*leaves, *extra]))
    outer = [objects[ref] if kind == "object" else values[ref] for kind, ref in graphdef.parts]
    return jax.tree.unflatten(graphdef.outer, outer)


def _check_unknown(what: str, values: Mapping[Key, Any], known: Mapping[Key, Any], of: str) -> None:
    """``TransformError`` naming every given variable that is not in ``known`` (a typo, or
    a bigger model's state): dropping it would lose it silently."""
    unknown = [key for key in values if key not in known]
    if not unknown:
        return
    names = "; ".join(f"{errors.format_path(path)} of collection '{col}'" for col, path in unknown)
    many = len(unknown) > 1
    raise errors.TransformError(
        f"{what}: variable{'s' if many else ''} {names} {'are' if many else 'is'} not in {of}.",
        collection=unknown[0][0], path=unknown[0][1], **errors.where(),
        fix="pass the state of this node (vj.state(node)), paths relative to it, without "
            "variables it does not have")


def _stacked(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether one shape is the other with axes added (as by a lifted vmap or scan)."""
    long, short = (a, b) if len(a) > len(b) else (b, a)
    rest = iter(long)
    return len(long) != len(short) and all(d in rest for d in short)


def _check_type(what: str, key: Key, value: Any, want: VarType | None, lifted: bool = False) -> None:
    """The ``VariableShapeError`` ``apply`` raises, unless ``value`` can stand for a
    variable of type ``want``.  ``lifted``: shapes may differ by stacked axes (``_stacked``)."""
    have = _type_of(value)
    if have is None or want is None:
        return
    like = want
    if lifted and len(have.avals) == len(want.avals):
        like = VarType(want.tree, tuple(w.update(shape=h.shape) if _stacked(h.shape, w.shape) else w
                                        for h, w in zip(have.avals, want.avals)))
    why = type_checks.mismatch(have, like)
    if why is not None:
        raise type_checks.shape_error(key[0], key[1], have, want, f"{why} ({what})",
                                      fix=_FIX_TYPE, **errors.where())


def update(node: Node, *states: VariableDict) -> None:
    """Write the states' values into the variables of ``node``'s objects, in place (NNX's
    ``nnx.update``): the way to put new parameters into a bound module, also inside an
    object-mode transform, where each write is a ``var_set``.  All or nothing: a state
    entry that is no variable of an object in ``node`` raises ``TransformError``, and one
    whose value does not fit its variable ``VariableShapeError``, before anything is written."""
    values: dict[Key, Any] = {}
    for s in states:
        flatten_state(s, values)
    cells = {(cell.collection, n.prefix + cell.path): cell for n in Graph.of(node).nodes
             for cell in n.cells}
    _check_unknown("vj.update", values, cells,
                   "the objects given (a plain dict is not updated in place)")
    for key, value in values.items():
        _check_type("vj.update", key, value, _type_of(cells[key].get()))
    for key, value in values.items():
        cells[key].set(value)
