"""``vj.Variable`` and its subclasses: one class hierarchy, one registry of collections.

A ``Variable`` is one variable, held or handled (``notes/object-mode.md``, "Variables"):

* *held*: ``vj.Variable(value, collection='params', **metadata)`` keeps its value in
  Python, for object mode, where the variable lives in an object rather than in a
  variables dict;
* a *handle*: ``Variable.at(collection, path)`` names a variable of the running trace and
  holds nothing; each access is a ``var_get``/``var_set`` (``variable_access``).

A subclass names its collection once, for all its instances::

    class Param(vj.Variable, collection="params"): ...
    class Counter(vj.Variable): ...          # collection 'Counter', its class name

The registry maps each subclass to its collection and back (``collection_of``,
``variable_type``): a type filter and a collection name then select the same variables,
as NNX's ``variable_name_from_type`` says.  One collection has one class:

* a class that names its collection (``collection="weights"``) claims it, and a second
  class claiming a taken name raises ``InvalidVariablesError``;
* a class that names none takes its class name, or, when another class already has that
  name (two ``class Count(nnx.Variable)`` in two modules, as NNX allows), its name
  qualified by its module, ``Count@tests.test_b``: two classes are two types, and the
  first keeps the short name;
* a class defined again under the same module and name (a re-run notebook cell) takes the
  place of the first.
``Variable`` itself is in no collection of its own: each instance names one
(``collection=``, ``params`` if not given).

Every subclass is a pytree when it is defined (``__init_subclass__``), with the value as
its one child and its class kept in the treedef, so it comes back as its own class from
``jax.tree.unflatten``, ``vj.merge`` and every object-mode transform.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Hashable, Iterator, Mapping, Protocol

import jax

from varjax import _jax
from varjax.ir import axis_metadata, errors
from varjax.ir.primitives import Key, Path, is_internal
from varjax.ir.statics import Exact
from varjax.ir.typing import PyTree
from varjax.trace import raw_writes
from varjax.trace.context import TraceContext, active, current, site
from varjax.trace.raw_writes import pending
from varjax.trace.variable_access import read_at, read_value, write_value

# Where a Variable made inside an object-mode body lives in its trace: at (collection, n)
# of this collection, which every object-mode call may write and none hands back to an
# object (``objects/run.py`` returns the final values of those its function returns).
CREATED = "<made>"

_BY_NAME: dict[str, type["Variable"]] = {}
_BY_TYPE: dict[type["Variable"], str] = {}


def _check_name(name: Any, owner: str) -> None:
    if not isinstance(name, str) or is_internal(name):
        raise errors.InvalidVariablesError(
            f"{owner}: collection must be a string not starting with '__', got {name!r}.",
            **errors.where(), fix="vj.Variable(value, collection='params'); a subclass: "
                                  "class Param(vj.Variable, collection='params')")


def _same_class(a: type, b: type) -> bool:
    """Whether ``b`` is ``a`` defined again (a re-run cell): the same module and name."""
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def qualified_name(cls: type["Variable"]) -> str:
    """The collection of a class whose class name another class already has: readable
    (its name first) and the same in every run (its module, not an id)."""
    return f"{cls.__qualname__}@{cls.__module__}"


def _register(cls: type["Variable"], collection: str | None) -> None:
    name = cls.__name__ if collection is None else collection
    _check_name(name, f"class {cls.__qualname__}")
    other = _BY_NAME.get(name)
    if other is not None and not _same_class(other, cls):
        if collection is None:
            name = qualified_name(cls)
        else:
            raise errors.InvalidVariablesError(
                f"class {cls.__qualname__} claims collection '{name}', which is already the "
                f"collection of {other.__module__}.{other.__qualname__}; one collection has one "
                "Variable class.", collection=name, **errors.where(),
                fix=f"give {cls.__qualname__} another collection (class {cls.__name__}(..., "
                    "collection='...')), or subclass the class that has it without naming one")
    _BY_NAME[name], _BY_TYPE[cls] = cls, name


def rename_collection(cls: type["Variable"], name: str, *, overwrite: bool = False) -> None:
    """Makes ``name`` the collection of ``cls`` from now on (NNX's
    ``register_variable_name``).  The class that had ``name`` keeps its variables under
    its qualified name (``qualified_name``) when ``overwrite``, else this raises.  A
    Variable's collection is fixed when it is made: rename a class before making any."""
    _check_name(name, "register_variable_name")
    if cls not in _BY_TYPE:
        raise errors.InvalidVariablesError(
            f"register_variable_name: {getattr(cls, '__qualname__', cls)!r} is not a Variable "
            "subclass.", collection=name, **errors.where(),
            fix="register a subclass: class Count(nnx.Variable): ...")
    other = _BY_NAME.get(name)
    if other is cls:
        return
    if other is not None and not overwrite:
        raise errors.InvalidVariablesError(
            f"register_variable_name: collection '{name}' is already the collection of "
            f"{other.__module__}.{other.__qualname__}.", collection=name, **errors.where(),
            fix="pass overwrite=True to move the name to this class, or choose another name")
    old = _BY_TYPE[cls]
    if _BY_NAME.get(old) is cls:
        del _BY_NAME[old]
    if other is not None:
        _BY_NAME[qualified_name(other)] = other
        _BY_TYPE[other] = qualified_name(other)
    _BY_NAME[name], _BY_TYPE[cls] = cls, name


def collection_of(cls: type["Variable"]) -> str | None:
    """The collection of a registered ``Variable`` subclass; None for ``Variable`` itself,
    whose instances each name their own."""
    return _BY_TYPE.get(cls)


def variable_type(collection: str) -> type["Variable"]:
    """The ``Variable`` subclass registered for ``collection``; ``Variable`` if none is."""
    return _BY_NAME.get(collection, Variable)


@dataclasses.dataclass
class _Making:
    origin: Any
    count: int = 0


_MAKING: contextvars.ContextVar[_Making | None] = contextvars.ContextVar("making", default=None)


@contextlib.contextmanager
def made_in(ctx: TraceContext) -> Iterator[None]:
    """While the block runs, a ``Variable`` made under ``ctx`` (the trace of an object-mode
    body, not of an ``init``/``apply`` inside it) is a variable of that trace: its creation
    and every update are IR equations that the passes see (``shard-variables`` places it),
    and returned, it comes back to the caller as a new Variable of its class."""
    token = _MAKING.set(_Making(ctx.origin))
    try:
        yield
    finally:
        _MAKING.reset(token)


def sharded(metadata: Mapping[str, Any], value: Any) -> bool:
    """Whether a Variable with ``metadata`` and ``value`` is placed by the IR:
    ``out_sharding`` names one mesh axis (or None) per axis of the value.  Inside a
    ``vj.vmap`` a variable has an axis fewer than its names, and is left alone there."""
    names = metadata.get("out_sharding")
    return isinstance(names, (tuple, list)) and all(n is None or isinstance(n, str) for n in names) \
        and not axis_metadata.is_axis_metadata(value) and len(names) == jax.numpy.ndim(value)


def boxed(value: Any, metadata: Mapping[str, Any]) -> Any:
    """``value`` as a variable of the IR carries it: ``sharded``, in a ``Partitioned`` box
    of its mesh axes, so the names are in its equations' treedef, where ``shard-variables``
    reads Linen's boxes; else as it is.  A handle on it reads and writes through the box
    (``Variable.at(..., unbox=True)``)."""
    if sharded(metadata, value):
        return axis_metadata.Partitioned(value, tuple(metadata["out_sharding"]))
    return value


class VariableStore(Protocol):
    """What holds the variables a ``Variable.backed`` view reads outside any trace (the
    root of a module made by ``bind``)."""

    def read(self, collection: str, path: Path) -> Any:
        """The value of variable ``path`` of ``collection``."""
        ...


class Variable:
    """A variable: ``.value`` reads it, ``.value = x`` writes it (see the module docstring).

    * ``vj.Variable(value, collection='params', **metadata)`` holds its value: object mode
      (``notes/object-mode.md``).  Metadata become attributes and ``get_metadata()``.
    * ``vj.variable(...)`` / ``Module.variable(...)`` return a *handle* on a variable of the
      running trace (``Variable.at``); so does an object-mode transform for each ``Variable``
      it is given, inside its body, of the same class.  A handle holds no value: every access
      goes through the IR (``var_get``/``var_set``), so a read after a write inside a
      ``lax.scan`` body sees the carried value, not a Python-side cache.

    A ``Variable`` is a pytree with one child, its value (a handle's flatten reads it), so
    ``jax.tree.*`` and raw JAX transforms see the array; unflattening gives a held one of
    the same class.

    A handle made with ``unbox`` (``Module.variable``'s, as Linen's) reads a boxed value
    (``nn.Partitioned``) without its boxes, and a write of a value shaped like the unboxed
    one keeps the boxes (Linen's ``Variable.value``).
    """

    __slots__ = ("collection", "path", "_value", "_metadata", "_origin", "_unbox", "_local",
                 "_store", "_made", "_source", "__weakref__")

    def __init_subclass__(cls, *, collection: str | None = None, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        _register(cls, collection)
        jax.tree_util.register_pytree_with_keys(cls, _flatten_with_keys, functools.partial(_unflatten, cls),
                                                _flatten)

    def __init__(self, value: PyTree, *, collection: str | None = None, **metadata: Any):
        own = collection_of(type(self))
        if own is not None and collection not in (None, own):
            raise errors.InvalidVariablesError(
                f"{type(self).__name__}: its collection is '{own}', got collection="
                f"{collection!r}.", collection=collection, **errors.where(),
                fix=f"leave collection out for a {type(self).__name__}, or use vj.Variable")
        collection = own or (collection if collection is not None else "params")
        if not isinstance(collection, str):
            raise errors.InvalidVariablesError(
                f"vj.Variable: collection must be a string, got {collection!r}.",
                **errors.where(), fix="vj.Variable(value, collection='params'); a handle on a "
                                      "variable of a trace is Variable.at(collection, path)")
        self.collection, self.path, self._local, self._store = collection, None, None, None
        self._value, self._metadata, self._origin, self._unbox = value, metadata, None, False
        self._made, self._source = _jax.trace_ref(), None
        making = _MAKING.get()
        if making is not None:
            ctx = active()
            if ctx is not None and ctx.origin is making.origin:
                self._make_in(ctx, making)

    def _make_in(self, ctx: TraceContext, making: _Making) -> None:
        """Become a handle on a new variable of ``ctx`` holding the value (``made_in``)."""
        value, self._value = self._value, None
        self.path, self._local, self._origin = (self.collection, str(making.count)), CREATED, ctx.origin
        making.count += 1
        stored = boxed(value, self._metadata)
        self._unbox = stored is not value
        write_value(ctx, CREATED, self.path, stored)

    @property
    def key(self) -> Key | None:
        """Where a handle's variable is in its trace (None for a held Variable)."""
        return None if self.path is None else (self._local or self.collection, self.path)

    @classmethod
    def at(cls, collection: str, path: Path, metadata: Mapping[str, Any] | None = None,
           origin: TraceContext | None = None, unbox: bool = False) -> "Variable":
        """A handle on variable ``path`` of ``collection`` in the active trace (``origin``:
        the trace it must be used under, ``None`` for whichever is active)."""
        handle = object.__new__(cls)
        handle.collection, handle.path = collection, tuple(path)
        handle._value, handle._metadata, handle._origin = None, dict(metadata or {}), origin
        handle._unbox, handle._local, handle._store = unbox, None, None
        handle._made, handle._source = None, None
        return handle

    @classmethod
    def backed(cls, store: VariableStore, collection: str, path: Path,
               unbox: bool = False) -> "Variable":
        """A read-only view of variable ``path`` of ``collection`` held by ``store`` (an
        object with ``read(collection, path)``: the root of a module made by ``bind``, whose
        ``Module.variable`` returns one outside any trace)."""
        view = cls.at(collection, path, unbox=unbox)
        view._store = store
        return view

    def _ctx(self, api: str) -> TraceContext:
        ctx = active() if self._origin is not None else current(api)
        if self._origin is not None and (ctx is None or ctx.origin is not self._origin):
            raise errors.InvalidScopeError(
                f"variable {errors.format_path(self.path)} of collection '{self.collection}' "
                "was used after the object-mode transform that made its handle had returned.",
                collection=self.collection, path=self.path, **(site(ctx) if ctx else errors.where()),
                fix="return values out of the transformed function instead of keeping "
                    "the Variable objects it was given")
        return ctx

    @property
    def value(self) -> Any:
        if self.path is None:
            if pending:
                raw_writes.check_used(self)
            return self._value
        value = read_at(self._ctx("Variable.value"), *self.key) if self._store is None \
            else self._store.read(self.collection, self.path)
        return axis_metadata.unbox(value, apply_constraint=False) if self._unbox else value

    @value.setter
    def value(self, new: Any) -> None:
        if self.path is None:
            if pending:
                raw_writes.check_used(self)
            if self._made is not _jax.trace_ref():
                raw_writes.check_write(self, self._made)
            elif self._source is not None:
                raw_writes.written(self, self._source)
            self._value = new
            return
        if self._store is not None:
            raise AttributeError(
                f"variable {errors.format_path(self.path)} of collection '{self.collection}' of "
                "a bound module is read-only outside its calls; write it inside a method, or "
                "with vj.update(module, state)")
        ctx, key = self._ctx("Variable.value"), self.key
        if self._unbox:    # boxes read off the variable's type: nothing is read in the IR
            vt = ctx.variables.get(key)
            new = axis_metadata.rebox(jax.tree.unflatten(vt.tree, vt.avals) if vt is not None
                                      else read_value(ctx, *key), new)
        write_value(ctx, *key, new)

    def __getitem__(self, index: Any) -> Any:
        return self.value[index]

    def value_type(self) -> PyTree:
        """The value, or for a handle its type (``ShapedArray``s in the value's structure)
        where the trace knows it, read off the variable's type with no read in the IR: what
        a write that depends only on the old value's shape and dtype needs."""
        if self.path is None:
            return self.value
        vt = self._ctx("Variable.value_type").variables.get(self.key)
        return self.value if vt is None else jax.tree.unflatten(vt.tree, vt.avals)

    def __setitem__(self, index: Any, new: Any) -> None:
        self.value = new if index is Ellipsis else self.value.at[index].set(new)

    def __jax_array__(self) -> Any:
        return self.value

    def __reduce__(self) -> tuple:
        """Pickled as a held Variable of its class holding its value and metadata (the
        trace it was made in is not data: the copy belongs to the trace that loads it);
        a handle, a name of a running trace's variable, has nothing to pickle."""
        if self.path is not None:
            raise errors.TransformError(
                f"a {type(self).__name__} handle of a running trace ({self.collection}:"
                f"{'/'.join(map(str, self.path))}) cannot be pickled.", collection=self.collection,
                path=self.path, **errors.where(), fix="pickle the module outside the transform")
        return held, (self._varjax_pickled_type(), self.collection, self.value, self._metadata)

    def _varjax_pickled_type(self) -> type["Variable"]:
        """The class a pickled copy is made as: its own (NNX's stream views say theirs)."""
        return type(self)

    def _varjax_identity(self) -> Hashable:
        """What makes two held objects one variable for a transform's graph (the cells of
        one variable are read once and written once): the Variable itself.  A Variable
        that stands for another's storage (NNX's views of an RNG stream) says so."""
        return id(self)

    def get_metadata(self) -> dict[str, Any]:
        """The metadata given at construction (``out_sharding=...`` and the like)."""
        return dict(self._metadata)

    def add_axis(self, axis_index: int, axis_name: str | None) -> None:
        """Called by ``vj.transform_metadata`` after it named a new axis ``axis_index`` of
        the variable (a transform stacked it): a hook point that does nothing here, where
        NNX's Variables run their ``on_add_axis`` hooks."""

    def remove_axis(self, axis_index: int, axis_name: str | None) -> None:
        """As ``add_axis``, when ``vj.transform_metadata`` took axis ``axis_index`` away
        (the transform's body sees one member): NNX's ``on_remove_axis`` hooks."""

    def __getattr__(self, name: str) -> Any:
        # Only for names not found normally: metadata, then the value's (shape, dtype...).
        if name.startswith("_"):
            raise AttributeError(name)
        metadata = object.__getattribute__(self, "_metadata")
        if name in metadata:
            return metadata[name]
        return getattr(self.value, name)

    def __repr__(self) -> str:
        name = type(self).__name__
        if self.path is not None:
            return f"{name}({self.collection}:{errors.format_path(self.path)})"
        extra = "".join(f", {k}={v!r}" for k, v in self._metadata.items())
        if collection_of(type(self)) is not None:
            return f"{name}({self._value!r}{extra})"
        return f"{name}({self._value!r}, collection={self.collection!r}{extra})"


def _flatten(v: Variable) -> tuple[tuple, tuple]:
    # Metadata keys JAX's caches by type and value (``tag=1`` and ``tag=1.0`` trace apart).
    # A held Variable's aux names it (``raw_writes.Origin``), so a copy JAX makes under a
    # transform can report a lost write; a copy flattened (returned) is not lost.
    if v._source is not None:
        raw_writes.returned(v._source)
    origin = raw_writes.NOWHERE if v.path is not None else raw_writes.Origin(v)
    return (v.value,), (v.collection, Exact(tuple(sorted(v._metadata.items()))), origin)


def _flatten_with_keys(v: Variable) -> tuple[tuple, tuple]:
    # The value's key is ``.value``, as flax.nnx's: a checkpoint names a leaf
    # ``kernel.value`` in both libraries, so one restores the other's.
    (value,), aux = _flatten(v)
    return ((jax.tree_util.GetAttrKey("value"), value),), aux


def held(cls: type[Variable], collection: str, value: Any, metadata: Mapping[str, Any]) -> Variable:
    """A new held ``cls`` (its ``__init__`` not run, as JAX's unflatten makes one)."""
    aux = (collection, Exact(tuple(sorted(metadata.items()))), raw_writes.NOWHERE)
    return _unflatten(cls, aux, (value,))


def _unflatten(cls: type[Variable], aux: tuple, children: tuple) -> Variable:
    held = object.__new__(cls)
    held.collection, held.path, held._origin, held._unbox = aux[0], None, None, False
    held._local, held._store, held._made = None, None, _jax.trace_ref()
    held._source = raw_writes.source_of(aux[2])
    held._value, held._metadata = children[0], dict(aux[1].value)
    return held


jax.tree_util.register_pytree_with_keys(Variable, _flatten_with_keys, functools.partial(_unflatten, Variable),
                                        _flatten)


class HeldValues:
    """Held Variables whose values are read and written together, in one call each: a kept
    train step (``objects.graph.ArgumentGraphs``) reads and writes the same Variables on
    every call, and their ``value`` property, one Python call per Variable, costs more
    than the bookkeeping around JAX's dispatch.  The checks the property makes per access
    are made once here: which Variables are plain held ones (``of``: no handle, no copy of
    another, the class keeping ``Variable.value``, all made under one trace; fixed when a
    Variable is made) and, per call, that no lost update is pending and the trace is the
    one they were made in; otherwise each is read and written by its property."""

    __slots__ = ("variables", "made")

    def __init__(self, variables: list[Variable], made: Any):
        self.variables, self.made = variables, made

    @classmethod
    def of(cls, variables: list[Variable]) -> "HeldValues | None":
        """The bulk access of ``variables``, or None when one of them needs its property."""
        made = variables[0]._made if variables else None
        for v in variables:
            if (v.path is not None or v._source is not None or v._made is not made
                    or type(v).value is not Variable.value):
                return None
        return cls(variables, made)

    def read(self) -> list[Any]:
        """Each Variable's value, in order."""
        if pending:
            return [v.value for v in self.variables]
        return [v._value for v in self.variables]

    def write(self, values: list[Any]) -> None:
        """Sets each Variable whose new value is not None."""
        if pending or self.made is not _jax.trace_ref():
            for v, new in zip(self.variables, values):
                if new is not None:
                    v.value = new
            return
        for v, new in zip(self.variables, values):
            if new is not None:
                v._value = new
