"""One call of a function over object nodes, as a functionalized trace.

``run(fn, args, kwargs)`` is the heart of object mode.  The nodes in the
arguments become the variables of one ``vj.functionalize`` call, each cell at its
full path (``params:model/Dense_0/kernel``); the function is traced with every
node replaced by the same object bound to that trace (``NodeKind.bind``), so a
read is a ``var_get`` and an update a ``var_set``; the pass pipeline runs as for
any ``apply``, and the discharge signature says which variables were written.
Nothing is compared in Python: an unchanged variable is one the IR never writes.

The result says, per cell, the new value or ``None`` (unchanged), and per node the
variables created under it; ``Graph.write_back`` applies both to the nodes.  The
object-mode transforms call ``run`` inside the JAX transform, on the copies JAX
makes of the argument objects, and ``Graph.write_back`` outside, on the originals.
"""
from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from varjax.functionalization.functionalized import Functionalized
from varjax.functionalization.outputs import reveal
from varjax.ir import axis_metadata, errors, filters, streams
from varjax.ir.caches import LRU
from varjax.ir.primitives import Key, Path
from varjax.ir.statics import Exact
from varjax.objects.aliasing import shared_again
from varjax.objects.graph import Graph
from varjax.objects.layout import argument_prefix
from varjax.passes.framework.base import program_paths
from varjax.passes.framework.pipeline import parse_entries
from varjax.trace import variable_api
from varjax.trace.context import TraceContext, active, current
from varjax.trace.variable import CREATED, Variable, boxed, held, made_in


@dataclasses.dataclass
class Result:
    """What a call changed: ``updates[i]`` is cell i's new value (None: unchanged),
    ``created[j]`` the variables created under node j, ``captured`` what a ``capture``
    collected (``{(collection, path): value}``, paths relative to the captured node)."""

    updates: list[Any]
    created: list[dict[Key, Any]]
    captured: dict[Key, Any]


jax.tree_util.register_dataclass(Result, data_fields=["updates", "created", "captured"],
                                 meta_fields=[])


@dataclasses.dataclass(frozen=True)
class _Made:
    """Stands, in a trace's output, for a Variable the function made (``variable.made_in``):
    a pytree with no children, so its value comes out as the trace's final value of the
    variable (discharged after the passes, ``shard-variables`` included), not as a read."""

    key: Key
    cls: type
    collection: str
    metadata: Any      # statics.Exact of the sorted items
    boxed: bool        # stored in a box of its out_sharding (variable.boxed)

    @classmethod
    def of(cls, v: Variable) -> "_Made":
        return cls(v.key, type(v), v.collection, Exact(tuple(sorted(v._metadata.items()))),
                   v._unbox)

    def held(self, written: Mapping[Key, Any]) -> Variable:
        value = written[self.key]
        return held(self.cls, self.collection,
                    axis_metadata.unbox(value, False) if self.boxed else value,
                    dict(self.metadata.value))


jax.tree_util.register_pytree_node(_Made, lambda m: ((), m), lambda m, _: m)


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Stands for node ``index`` in the arguments a trace is keyed by; ``static`` is the
    node's structure (kind, collection, metadata, module class and fields)."""

    index: int
    static: Any


def arg_names(fn: Callable) -> tuple[str, ...]:
    """Path names for the positional arguments of ``fn`` (``model``, ``opt``...)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def graph_of(args: tuple, kwargs: Mapping[str, Any], names: Sequence[str]) -> Graph:
    """The nodes of a call's arguments; argument i's nodes live under ``names[i]`` (else
    ``args{i}``), a keyword argument's under its name."""
    graph = Graph.of((args, dict(kwargs)))
    for node in graph.nodes:
        node.prefix = argument_prefix(node.prefix, names)
    return graph


_TRACES = LRU()    # (fn, capture, passes) -> Functionalized


def _functionalized(fn: Callable, capture: Any, passes: tuple) -> tuple[Functionalized, dict]:
    key = (fn, capture, passes)
    found = _TRACES.get(key)
    if found is None:
        holder: dict[str, Any] = {}

        def body(stripped: Any) -> Any:
            graph, ctx = holder["graph"], current()
            bound = [n.kind.bind(n.obj, n.prefix, ctx) for n in graph.nodes]
            leaves = [bound[x.index] if isinstance(x, _Slot) else x
                      for x in jax.tree.leaves(stripped, is_leaf=lambda x: isinstance(x, _Slot))]
            args, kwargs = jax.tree.unflatten(graph.treedef, leaves)
            if graph.layout().shares_objects:     # a module held twice is one inside
                args, kwargs = shared_again((args, kwargs), graph.objects)
            with made_in(ctx):      # a Variable made here is a variable of this trace
                out = holder["fn"](*args, **kwargs)
            return jax.tree.map(lambda x: _Made.of(x) if isinstance(x, Variable) and x._local
                                else x, out, is_leaf=lambda x: isinstance(x, Variable))
        body.__name__ = getattr(fn, "__name__", "fn")
        found = _TRACES[key] = (Functionalized(body, passes=passes), holder)
    return found


def _passes(graph: Graph, enclosing: TraceContext | None) -> tuple:
    """The passes of the call: each bound module's (``bind(passes=...)``) rooted at the
    module's place in the arguments (``Pass.rooted``), so they see its variables -- and
    only its -- by the paths an eager call of it sees; modules bound with equal passes share
    one rooted copy.  With no bound module, the enclosing trace's passes that are for the
    whole program (``apply(passes=...)``), none at top level: rooted ones are about the
    enclosing trace's arguments, which a nested call cannot see.  So a module's passes
    follow it into every transform, nested ones included."""
    groups: list[tuple[tuple, list]] = []     # (passes, roots), equal passes together
    bound = False
    for node in graph.nodes:
        given = node.kind.passes(node.obj)
        if given is None or node.rebased:    # its variables are another node's, and so
            continue                          # are its passes
        bound = True
        parsed = parse_entries(given)
        root = (node.prefix, node.kind.passes_path(node.obj))
        group = next((g for g in groups if g[0] == parsed), None)
        if group is None:
            groups.append((parsed, [root]))
        else:
            group[1].append(root)
    if bound:
        return tuple(p.rooted(roots) for parsed, roots in groups for p in parsed)
    if enclosing is None:
        return ()
    return tuple(p for p in enclosing.passes if not p.roots)


def _hand_up_supplied(passes: tuple, enclosing: TraceContext) -> None:
    """A nested call's passes supply variables of the modules it was given (``tie``'s
    ``dst``, never stored), which the enclosing trace then never reads: the enclosing
    pipeline counts them as asked for (``PassContext.asked``), as it counts those a lifted
    body read, since this call's pipeline checked them.  They are marked for each root of
    the same pass in the enclosing trace: the modules that were handed in."""
    for p in passes:
        if not p.roots:
            continue
        for outer in enclosing.passes:
            if outer.roots and outer.rooted(p.roots) == p:
                enclosing.origin.asked.update(
                    (collection, full) for collection, path in p.supplies()
                    for full in program_paths(outer.roots, p.relative(path)))


# How many nested object-mode calls each trace has handed its keys to (see _handed_keys).
_HANDED: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _handed_keys(enclosing: TraceContext, flat: Mapping[Key, Any]) -> dict[str, Any]:
    """The keys an object-mode call nested in ``enclosing`` draws from: the enclosing
    trace's keys under Linen's convention (a module bound with ``rngs={...}``), handed as
    a lifted body gets them.  The first use of a key in the trace gets it as it is, so a
    nested call draws what the same call un-nested would; the n-th use after it (earlier
    nested calls, and the enclosing trace's own draws) gets ``derive(derive(key, 0), n)``,
    which no call of a bound module uses (its n-th call folds n >= 1 into the key), so
    those draws differ.  A stream whose state the arguments hold (an ``Rngs``) is theirs."""
    wanted = [s for s in enclosing.rng_streams
              if variable_api.hands_as_is(enclosing, s) and (streams.STATE, (s, "key")) not in flat]
    if not wanted:
        return {}
    handed = _HANDED.get(enclosing.origin, 0)
    _HANDED[enclosing.origin] = handed + 1
    drawn = streams.linen_counts(enclosing.origin).counts
    keys = {}
    for s in wanted:
        key = variable_api.hand_key_at(enclosing, s, ())
        n = handed + any(stream == s for stream, _ in drawn)
        keys[s] = key if n == 0 else streams.derive(streams.derive(key, 0), n)
    return keys


def _jax_outputs(what: str, out: Any) -> Any:
    """Object-mode transforms are JAX transforms of ``run``: their outputs are what JAX
    takes (arrays and numbers), not the strings and other values ``init``/``apply`` return
    (``varjax.functionalization.outputs``)."""
    out = reveal(out)
    for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex)):
            raise errors.TransformError(
                f"{what} returned {type(leaf).__name__} {leaf!r} at output "
                f"{jax.tree_util.keystr(path) or '(the whole output)'}; an object-mode "
                "transform returns arrays, as the JAX transform it wraps does.",
                **errors.where(), fix="return arrays, or compute the other value outside "
                                      "the transform")
    return out


def _explicit_rngs(graph: Graph, what: str) -> dict[str, Any]:
    """The keys the argument nodes hand to the call (modules bound with ``rngs={...}``).
    A call draws from one key per stream, so two modules bound with keys of one stream
    would draw from one module's keys, silently: an error instead."""
    rngs: dict[str, Any] = {}
    owner: dict[str, Path] = {}
    for node in graph.nodes:
        if node.rebased:       # a submodule passed beside its module: the module's keys
            continue
        for stream, key in node.kind.explicit_rngs(node.obj).items():
            if stream in owner:
                raise errors.TransformError(
                    f"{what}: the modules at {errors.format_path(owner[stream])} and "
                    f"{errors.format_path(node.prefix)} were both bound with a key for stream "
                    f"'{stream}'; one call draws from one key per stream, so one of them would "
                    "draw from the other's key.", collection="rngs", path=(stream,),
                    **errors.where(),
                    fix="bind one of the modules without rngs, or pass one module per call "
                        "(as for two modules bound with vj.Rngs)")
            owner[stream], rngs[stream] = node.prefix, key
    return rngs


def _rebase(graph: Graph, keys: list[Key], shared: Sequence[int], what: str) -> list[Key]:
    """Each cell's key, a shared variable's (``Graph.shared``) being the key of the cell that
    stands for it.  A node reaching only variables other nodes hold (a submodule passed
    beside its module, an ``Rngs`` beside a module bound with it) is bound where they are:
    its prefix becomes the one under which its own keys are theirs (``model/encoder`` for
    ``model.encoder``).  A node holding both its own and such variables, at other keys,
    cannot be bound to both places: ``TransformError``."""
    start = 0
    for node in graph.nodes:
        stop = start + len(node.cells)
        want = [keys[shared[i]] for i in range(start, stop)]
        if want != keys[start:stop]:
            cell, path = node.cells[0], want[0][1]
            prefix = path[:len(path) - len(cell.path)]
            if all(shared[i] != i for i in range(start, stop)) \
                    and all(node.kind.trace_key(node.obj, c, prefix) == k
                            for c, k in zip(node.cells, want)):
                node.prefix, node.rebased = prefix, True
            else:
                i = next(i for i in range(start, stop) if keys[shared[i]] != keys[i])
                raise errors.TransformError(
                    f"{what}: variable {errors.format_path(keys[shared[i]][1])} of collection "
                    f"'{keys[i][0]}' is reached through two different objects, "
                    f"{errors.format_path(keys[shared[i]][1])} and "
                    f"{errors.format_path(keys[i][1])}, and the second holds other "
                    "variables too.", collection=keys[i][0], path=keys[i][1], **errors.where(),
                    fix="pass the object that holds all of them once (the root module made "
                        "by bind), or pass the other object alone")
        start = stop
    return [keys[i] for i in shared]


def run(fn: Callable, args: tuple, kwargs: Mapping[str, Any], *, names: Sequence[str] = (),
        capture: Any = False, given: Mapping[Key, Any] | None = None,
        capture_root: Path = (), graph: Graph | None = None,
        shared: Sequence[int] | None = None,
        sources: Sequence[int] | None = None, passes: tuple = (),
        inspect: Callable[[Functionalized, tuple], Any] | None = None) -> Any:
    """``fn(*args, **kwargs)`` through the IR (see the module docstring).

    ``capture``: a collection filter whose variables start empty and whose writes are
    collected, not written back (paths relative to ``capture_root``); ``given``: starting
    values for captured variables (``vj.capture(..., init=)``), relative to ``capture_root``;
    ``graph``: ``graph_of(args, kwargs, names)`` when the caller already has it (to write
    back into the same objects); ``shared``: per cell, the cell standing for its variable
    (``Graph.shared`` of the objects the caller was given: ``args`` are JAX's copies, which
    share nothing), the cells past its end standing for themselves; None: ``graph``'s own.
    A shared variable gets one key, one input, and its update is the standing cell's;
    ``sources`` (as ``shared``; ``Graph.sources``) says which cell's value that input is;
    ``passes``: parsed passes of the call itself (``vj.jit(fn, passes=...)``), run after
    those of the bound modules, on every variable of the call; ``inspect``: called with the
    call's ``Functionalized`` and the arguments of its ``_call`` instead of running it, its
    result returned (``varjax.objects.inspection``: the IR of a step, for ``vj.dump``)."""
    graph = graph if graph is not None else graph_of(args, kwargs, names)
    what = f"vj.{getattr(fn, '__name__', 'fn')}"
    cells = graph.cells
    shared = graph.shared() if shared is None else \
        tuple(shared) + tuple(range(len(shared), len(cells)))
    keys = [node.kind.trace_key(node.obj, cell, node.prefix) for node, cell in cells]
    if any(i != s for i, s in enumerate(shared)):
        keys = _rebase(graph, keys, shared, what)
    sources = shared if sources is None else tuple(sources) + shared[len(sources):]
    flat: dict[Key, tuple[Any, list]] = {}
    in_boxes: set[int] = set()      # cells given in a box of their out_sharding
    for i, (key, (node, cell)) in enumerate(zip(keys, cells)):
        if shared[i] != i:
            continue          # the standing cell gives the value
        if capture is not False and filters.matches(capture, cell.collection):
            continue          # a captured collection starts empty (or from ``given``)
        if key in flat:
            raise errors.TransformError(
                f"{what}: two arguments hold variable {errors.format_path(key[1])} of "
                f"collection '{key[0]}' (RNG state of two bound modules).",
                collection=key[0], path=key[1], **errors.where(),
                fix="bind one of the modules without an Rngs, or pass one module per call")
        value = cells[sources[i]][1].get()
        given_ = boxed(value, cell.metadata)
        if given_ is not value:
            in_boxes.add(i)
        leaves, tree = jax.tree.flatten(given_)
        flat[key] = (tree, leaves)
    for (col, path), value in (given or {}).items():
        leaves, tree = jax.tree.flatten(value)
        flat[(col, capture_root + path)] = (tree, leaves)
    mutable = tuple(filters.freeze(n.kind.mutable(n.obj)) for n in graph.nodes)
    enclosing = active()
    if enclosing is not None:   # nested: may write what the enclosing trace may (a capture's)
        mutable += (filters.freeze(enclosing.mutable),)
    if capture is not False:
        mutable += (filters.freeze(capture),)
    mutable += (CREATED,)
    rngs: dict[str, Any] = _handed_keys(enclosing, flat) if enclosing is not None else {}
    rngs.update(_explicit_rngs(graph, what))

    passes = _passes(graph, enclosing) + passes
    functionalized, holder = _functionalized(fn, capture, passes)
    slots = {id(n.obj): _Slot(i, static) for i, (n, static)
             in enumerate(zip(graph.nodes, graph.layout().statics))}
    stripped = jax.tree.unflatten(graph.treedef, [slots[id(x)] if obj else x
                                                  for x, obj in zip(graph.leaves, graph.is_object)])
    holder.update(graph=graph, fn=fn)
    # A collection is immutable here because a bound module's bind(mutable=) left it out.
    bound = any(n.kind.passes(n.obj) is not None for n in graph.nodes)
    call = (flat, (stripped,), {}, rngs, mutable, False)
    with errors.mutability_given_by("bind" if bound else "apply"):
        if inspect is not None:
            return inspect(functionalized, call)
        out, written, _ = functionalized._call(*call)
    out = jax.tree.map(lambda x: x.held(written) if isinstance(x, _Made) else x, out,
                       is_leaf=lambda x: isinstance(x, _Made))
    if functionalized.static_outputs.seen:
        out = _jax_outputs(what, out)
    if enclosing is not None:
        _hand_up_supplied(passes, enclosing)

    updates = [None] * len(cells)
    position = {keys[i]: i for i, s in enumerate(shared) if i == s}
    created: list[dict[Key, Any]] = [{} for _ in graph.nodes]
    captured: dict[Key, Any] = {}
    for (col, path), value in written.items():
        if col == CREATED:
            continue          # made by the function: returned (``_Made``) or dropped
        if capture is not False and filters.matches(capture, col):
            if path[:len(capture_root)] == capture_root:
                captured[(col, path[len(capture_root):])] = value
            continue
        if (col, path) in position:
            i = position[(col, path)]
            updates[i] = axis_metadata.unbox(value, False) if i in in_boxes else value
            continue
        owner = max((j for j, n in enumerate(graph.nodes) if path[:len(n.prefix)] == n.prefix),
                    key=lambda j: len(graph.nodes[j].prefix), default=None)
        if owner is None:
            raise errors.TransformError(
                f"{what}: variable {errors.format_path(path)} of collection '{col}' was "
                "created outside every argument object, so there is nothing to keep it in.",
                collection=col, path=path, **errors.where(),
                fix="create variables inside a bound module passed as an argument, or return "
                    "the value instead")
        created[owner][(col, path[len(graph.nodes[owner].prefix):])] = value
    return out, Result(updates, created, captured)
