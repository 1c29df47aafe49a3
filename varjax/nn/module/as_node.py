"""A bound module as an object-mode node, and as a pytree.

A module made by ``bind`` owns variables (``binding.BoundRoot``).  For object mode
(``notes/object-mode.md``) it is a node whose cells are those variables, plus the
streams of an ``Rngs`` it was bound with; inside an object-mode body it is bound to
the trace instead (``ObjectRoot``), so each variable operation is a ``var_get`` /
``var_set`` of that trace at the module's place in the arguments.

Every module class is also a pytree.  A bound module's leaves are its variables'
values (and its ``Rngs``'s), so ``jax.tree.map`` gives a bound module of the same
class and raw ``jax.jit``/``jax.grad`` take one.  Any other module (a template, or one
bound by ``init``/``apply``) has one opaque leaf standing for itself, as a Linen module
is a leaf: raw JAX transforms still reject it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Hashable

import jax

from varjax.functionalization.outputs import Static
from varjax.ir import filters, streams
from varjax.ir.primitives import Key, Path, handing
from varjax.ir.statics import typed
from varjax.nn.binding import BoundRoot, Scope, TraceRoot
from varjax.objects.nodes import Cell, cell_writer, register_kind, rng_state_cells
from varjax.trace import variable_api
from varjax.trace.context import TraceContext
from varjax.trace.rngs import Rngs, RngStream
from varjax.trace.variable_dicts import nested_set, variable_entries


class ObjectRoot(TraceRoot):
    """The root of a module inside an object-mode body: its variables are those of the
    trace at ``prefix`` (its RNG state, Linen's ``rngs`` collection, at the trace's own
    ``rngs`` keys, where draws find it)."""

    def __init__(self, ctx: TraceContext, prefix: Path, mutable: Any, rng_streams: tuple[str, ...],
                 passes: tuple = (), passes_path: Path = ()):
        super().__init__(ctx, None)
        self.ctx, self.prefix, self.mutable, self.rng_streams = ctx, prefix, mutable, rng_streams
        # The bound root's passes: nested object-mode calls run them too, seeing the
        # variables at ``prefix`` at ``passes_path`` (``ModuleKind.passes_path``).
        self.passes, self.passes_path = passes, passes_path


def _is_rng_state(collection: str, path: Path) -> bool:
    return collection == streams.STATE and len(path) == 2


def _object_root(module: Any) -> BoundRoot | ObjectRoot | None:
    sc = module.__dict__.get("scope")
    root = sc.root if sc is not None else None
    return root if isinstance(root, (BoundRoot, ObjectRoot)) else None


@dataclasses.dataclass(frozen=True, eq=False)
class _Template:
    """A module's class and fields, compared by type and value (``statics.typed``) when
    they hash, so equal modules share JAX's caches while ``Fill(1)``, ``Fill(1.0)`` and
    ``Fill(True)`` trace apart; else by identity."""

    module: Any

    def __post_init__(self) -> None:
        try:
            key = typed(self.module)
            hash(key)
        except TypeError:     # an unhashable field (an array): this module only
            key = None
        object.__setattr__(self, "_key", key)

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, _Template):
            return False
        if self.module is other.module:
            return True
        try:
            return self._key is not None and bool(self._key == other._key)
        except Exception:     # noqa: BLE001  (a field whose == is not a bool)
            return False

    def __hash__(self) -> int:
        return hash(self._key) if self._key is not None else id(self.module)


def _passes_path(module: Any) -> Path:
    """Where the module's variables are in the module its passes were given for (see
    ``ModuleKind.passes_path``): its path below its root, after the root's own."""
    root = _object_root(module)
    below = module.scope.path[len(root.prefix):] if isinstance(root, ObjectRoot) else module.scope.path
    return root.passes_path + below


def _template(module: Any) -> _Template:
    found = module.__dict__.get("_varjax_template")
    if found is None:
        found = _Template(module.clone(parent=None, name=module.name))
        object.__setattr__(module, "_varjax_template", found)
    return found


class ModuleKind:
    """A bound module as an object-mode node (see the module docstring)."""

    def accepts_type(self, t: type) -> bool:
        return getattr(t, "_varjax_module", False)

    def accepts(self, x: Any) -> bool:
        return _object_root(x) is not None

    def cells(self, module: Any) -> list[Cell]:
        return variable_cells(module) + rng_cells(module)

    def mutable(self, module: Any) -> Any:
        root = _object_root(module)
        held = isinstance(root, BoundRoot) and root.held is not None
        rng = isinstance(root, ObjectRoot) and root.rng_streams
        return (filters.freeze(root.mutable), streams.STATE) if held or rng else filters.freeze(root.mutable)

    def watch(self, module: Any) -> Callable[[], Hashable] | None:
        root = _object_root(module)
        if isinstance(root, ObjectRoot):
            return lambda: root      # inside a trace, where graphs are not kept
        # a held Rngs keeps its streams; getattr through partial: no Python frame per call
        return functools.partial(getattr, root, "layout")

    def reader(self, module: Any) -> Callable[[], tuple]:
        root = _object_root(module)
        if isinstance(root, ObjectRoot):
            return lambda: _children(module, root, variable_cells(module))
        slots = [(c.parent, c.leaf) for c in variable_cells(module)]
        if root.held is not None:
            return lambda: (tuple([p[k] for p, k in slots]), root.held)
        if root.rngs:
            return lambda: (tuple([p[k] for p, k in slots]), (dict(root.rngs), root.calls))
        return lambda: (tuple([p[k] for p, k in slots]), {})

    def trace_key(self, module: Any, cell: Cell, prefix: Path) -> Key:
        if _is_rng_state(cell.collection, cell.path):
            return (cell.collection, cell.path)     # where the trace's draws look for it
        return (cell.collection, prefix + cell.path)

    def explicit_rngs(self, module: Any) -> dict[str, Any]:
        """A module bound with keys draws from the keys of its n-th eager call
        (``BoundRoot``): the keys at call 0, then ``fold_in(key, n)``; n is a leaf of the
        pytree.  The draws fold in the module path, which here starts with the argument's
        name, so they are not the eager call's (``notes/object-mode.md``, sharp edges)."""
        root = _object_root(module)
        if not isinstance(root, BoundRoot) or root.held is not None or not root.rngs:
            return {}
        n = root.calls
        return {s: jax.lax.cond(n == 0, lambda k=k: k, lambda k=k: streams.derive(k, n))
                for s, k in root.rngs.items()}

    def passes(self, module: Any) -> tuple | None:
        return _object_root(module).passes

    def passes_path(self, module: Any) -> Path:
        return _passes_path(module)

    def writer(self, module: Any) -> Callable[[list[Any]], None]:
        root = _object_root(module)
        if isinstance(root, ObjectRoot):
            return cell_writer(self.cells(module))
        slots = [(c.parent, c.leaf) for c in variable_cells(module)]
        rngs_write = cell_writer(rng_cells(module))
        counts_calls = root.held is None and bool(root.rngs)

        def write(updates: list[Any]) -> None:
            changed = False
            for (parent, leaf), value in zip(slots, updates):
                if value is not None:
                    parent[leaf], changed = value, True
            if changed:
                root.version = root.new_version()     # setup attributes read the new values
            rngs_write(updates[len(slots):])
            if counts_calls:
                root.calls += 1
        return write

    def bind(self, module: Any, prefix: Path, ctx: TraceContext) -> Any:
        root = _object_root(module)
        streams_ = tuple(sorted({c.path[0] for c in self.cells(module)
                                 if _is_rng_state(c.collection, c.path)}))
        inner = _template(module).module.clone(
            parent=ObjectRoot(ctx, prefix, root.mutable, streams_, root.passes,
                              _passes_path(module)), name=module.name)
        object.__setattr__(inner, "scope", Scope(inner.scope.root, prefix))
        return inner

    def add(self, module: Any, collection: str, path: Path, value: Any) -> None:
        root = _object_root(module)
        full = module.scope.path + path
        if isinstance(root, ObjectRoot):
            variable_api.write_at(root.ctx, collection, full, value)
            return
        nested_set(root.variables.setdefault(collection, {}), full, value)
        root.version = root.new_version()
        root.layout += 1


def variable_cells(module: Any) -> list[Cell]:
    """The cells of the variables at or below the module's path."""
    root, base = _object_root(module), module.scope.path
    if isinstance(root, ObjectRoot):
        ctx = root.ctx
        keys = sorted(k for k in ctx.variables if k[1][:len(base)] == base and len(k[1]) > len(base)
                      and not (k[0] == streams.STATE and k[1][:1] in {(s,) for s in root.rng_streams}))
        return [_traced_cell(ctx, col, path, base) for col, path in keys]
    layout, cells = root.cells.get(base, (-1, None))
    if layout != root.layout:
        # Not checked as a given dict is: JAX flattens a bound module whose leaves are
        # avals or placeholders too (``jax.tree.map(jax.typeof, model)``).
        keys = sorted(k for k, _ in variable_entries(root.variables)
                      if k[1][:len(base)] == base and len(k[1]) > len(base))
        cells = [_bound_cell(root, col, path, base) for col, path in keys]
        root.cells[base] = (root.layout, cells)
    return cells


def rng_cells(module: Any) -> list[Cell]:
    """The cells of the ``Rngs`` the module was bound with (inside a body: of the trace's
    ``rngs`` state it draws from)."""
    root = _object_root(module)
    if isinstance(root, ObjectRoot):
        return [_traced_cell(root.ctx, streams.STATE, (s, part), ())
                for s in root.rng_streams for part in ("key", "count")]
    return rng_state_cells(root.held) if root.held is not None else []


@dataclasses.dataclass(eq=False)
class _BoundCell(Cell):
    """A variable of a bind root, at ``parent[leaf]`` in the dicts the root keeps: the root
    replaces those dicts only when its layout moves on, which makes new cells.  The reader
    and writer of a module use the slot directly."""

    parent: dict = dataclasses.field(default_factory=dict)
    leaf: str = ""


def _bound_cell(root: BoundRoot, collection: str, path: Path, base: Path,
                parent: dict | None = None) -> Cell:
    """The cell of variable ``path`` of ``collection`` for the module at ``base``; ``parent``:
    the dict holding it, when the caller has it."""
    if parent is None:
        parent = root.variables[collection]
        for name in path[:-1]:
            parent = parent[name]
    leaf = path[-1]

    def set_(value: Any) -> None:
        parent[leaf] = value
        root.version = root.new_version()     # setup attributes read the new values
    return _BoundCell((id(root), collection, path), collection, path[len(base):],
                      lambda: parent[leaf], set_, parent, leaf)


# What the reads and writes of a module's cells inside a trace carry as ``lift``: the
# cells are read only to hand the module to a nested object-mode call (or to flatten it),
# whose own pipeline runs the module's passes on the module code's reads.  The enclosing
# pipeline leaves them alone, as it leaves a lifted transform's boundary (``handing``):
# otherwise it would run the passes a second time, on the whole stacked kernel of a scan.
_HANDED_TO = "object-mode call"


def _traced_cell(ctx: TraceContext, collection: str, path: Path, base: Path) -> Cell:
    def get() -> Any:
        with handing(_HANDED_TO):
            return variable_api.read_at(ctx, collection, path)

    def set_(value: Any) -> None:
        with handing(_HANDED_TO):
            variable_api.write_at(ctx, collection, path, value)
    return Cell((id(ctx.origin), collection, path), collection, path[len(base):], get, set_)


register_kind(ModuleKind())


# --- pytree ------------------------------------------------------------------------------

class _Opaque:
    """The one leaf of a module that holds no variables of its own (a template, or one bound
    by ``init``/``apply``): the module itself, as Linen has it -- a static Python object,
    which raw JAX transforms reject as an argument ("not a valid JAX type")."""

    __slots__ = ("module",)

    def __init__(self, module: Any):
        self.module = module

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Opaque) and self.module == other.module

    def __hash__(self) -> int:
        return hash(self.module)

    def __repr__(self) -> str:
        return repr(self.module)


@dataclasses.dataclass(frozen=True, eq=False)
class _BoundDef:
    """The static half of a bound module's pytree: which variables its children are (each
    child is one variable's value; JAX's treedef holds the value's own structure).

    JAX hashes and compares it on every ``jax.jit`` dispatch, so the hash is computed once
    and the same object (kept per layout by ``_bound_def``) compares by identity first."""

    template: _Template
    keys: tuple[tuple[str, Path], ...]
    mutable: Any
    passes: tuple = ()      # bind(passes=...): the calls of the rebuilt module run them
    passes_path: Path = ()  # and see its variables there (``ModuleKind.passes_path``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.template, self.keys, self.mutable, self.passes,
                                                self.passes_path)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        return self is other or (isinstance(other, _BoundDef) and self._hash == other._hash
                                 and (self.template, self.keys, self.mutable, self.passes,
                                      self.passes_path)
                                 == (other.template, other.keys, other.mutable, other.passes,
                                     other.passes_path))


def _bound_def(module: Any, root: Any, cells: list[Cell]) -> _BoundDef:
    """The module's ``_BoundDef``, kept per layout of a ``BoundRoot`` (the same object
    every call: cheap to compare in JAX's jit cache)."""
    base = module.scope.path
    if isinstance(root, BoundRoot):
        found = root.defs.get(base)
        if found is not None and found[0] == root.layout:
            return found[1]
    made = _BoundDef(_template(module), tuple((c.collection, c.path) for c in cells),
                     filters.freeze(root.mutable), getattr(root, "passes", ()),
                     _passes_path(module))
    if isinstance(root, BoundRoot):
        root.defs[base] = (root.layout, made)
    return made


def _children(module: Any, root: Any, cells: list[Cell]) -> tuple:
    values = tuple([c.get() for c in cells])
    if isinstance(root, ObjectRoot):
        state = {c.path: c.get() for c in rng_cells(module)}
        rng_part: Any = Rngs(**{s: RngStream(state[(s, "key")], state[(s, "count")], tag=s)
                                for s in root.rng_streams}) if root.rng_streams else {}
    else:
        rng_part = root.rng_children()
    return values, rng_part


def flatten_module(module: Any) -> tuple[tuple, Any]:
    root = _object_root(module)
    if root is None:
        return (_Opaque(module),), None
    cells = variable_cells(module)
    return _children(module, root, cells), _bound_def(module, root, cells)


def unflatten_module(aux: Any, children: tuple) -> Any:
    if aux is None:
        leaf = children[0]
        if isinstance(leaf, Static) and isinstance(leaf.value, _Opaque):
            # a module a traced method returns, hidden as a static output
            # (``outputs.hide``): it comes back as the module (``outputs.reveal``)
            return Static(leaf.value.module)
        return leaf.module if isinstance(leaf, _Opaque) else leaf
    values, rng_part = children
    variables: dict[str, Any] = {}
    parents = []
    for (col, path), value in zip(aux.keys, values):
        parent = variables.setdefault(col, {})
        for name in path[:-1]:
            parent = parent.setdefault(name, {})
        parent[path[-1]] = value
        parents.append(parent)
    root = BoundRoot.restore(variables, rng_part, aux.mutable, aux.passes, aux.passes_path)
    # Its cells and static half are ``aux``'s, made as the dicts are: an object-mode trace
    # takes the copies JAX makes apart without walking their dicts back into keys.  Not when
    # a tree map put a dict where a value was: the module has the variables inside it.
    if not any(isinstance(v, dict) for v in values):
        root.cells[()] = (root.layout, [_bound_cell(root, col, path, (), parent)
                                        for (col, path), parent in zip(aux.keys, parents)])
        root.defs[()] = (root.layout, aux)
    return aux.template.module.clone(parent=root, name=aux.template.module.name)


def register_pytree(cls: type) -> None:
    jax.tree_util.register_pytree_node(cls, flatten_module, unflatten_module)
