"""NNX's eager objects as pytrees: ``Pytree``/``Object``, ``data``/``static``, ``List``/``Dict``.

An NNX object is a plain Python object built in ``__init__``.  Its *data* attributes --
Variables, other NNX objects, ``Rngs``, arrays, or anything marked ``nnx.data(...)`` -- are
its pytree children, in attribute-name order, and everything else is static (the treedef).
So a module is a tree whose leaves are Variables (object-mode nodes, ``varjax.objects``),
and every object-mode transform (``vj.jit``, ``vj.grad``...) takes it as it is: inside,
each Variable access is a ``var_get``/``var_set`` of one trace, and updates come back
through the discharge signature (``notes/nnx.md``).

A static attribute holding data inside a plain container (a Python list of layers) would be
invisible to a transform, so assigning one is an error (``StaticDataError``), as in NNX:
use ``nnx.List``/``nnx.Dict`` or ``nnx.data``.  A class can fix an attribute's kind for
every instance (``nnx.Data``/``nnx.Static`` annotations, ``nnx.dataclass`` fields made by
``nnx.data()``/``nnx.static()``), and ``register_data_type`` makes a type data.

``children`` is the one walk of an object's children (flax.nnx's order: keys sorted,
indices before names; a stream's ``count`` before its ``key``) that every graph function
goes through.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import (
    Annotated,
    Any,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
    MutableSequence,
    TypeVar,
)

import jax
import numpy as np

from varjax.ir import errors
from varjax.ir.typing import PyTree
from varjax.nnx.rng_variables import stream_children
from varjax.objects.graph import structure_changed
from varjax.trace.rngs import Rngs, RngStream
from varjax.trace.variable import Variable

__all__ = ["Pytree", "Object", "data", "static", "is_data", "has_data", "register_data_type",
           "check_pytree", "Data", "Static", "dataclass", "List", "Dict", "is_node",
           "flatten_node", "children", "in_order"]

_DATA_NAMES = "_nnx_data"    # the instance's set of data attribute names
_CLASS_STATUS = "_nnx_class_status"    # a class's {attribute: is data} from its annotations
_MISSING: Any = dataclasses.MISSING
A = TypeVar("A")
T = TypeVar("T", bound=type)

Data = Annotated[A, "__data__"]
"""``x: nnx.Data[T]`` in a class body: attribute ``x`` of every instance is data."""
Static = Annotated[A, "__static__"]
"""``x: nnx.Static[T]`` in a class body: attribute ``x`` of every instance is static."""

_DATA_TYPES: set[type] = set()


class _Marked:
    """What ``nnx.data``/``nnx.static`` return: a value with its classification, which the
    assignment unwraps."""

    __slots__ = ("value", "data")

    def __init__(self, value: Any, data: bool):
        self.value, self.data = value, data


def data(value: A = _MISSING, /, **field: Any) -> A:
    """Marks ``value`` as data for the attribute it is assigned to (a pytree child).
    Without a value, a ``dataclasses.field(**field)`` marking a class attribute (in an
    ``nnx.dataclass``) data for every instance, as in flax.nnx."""
    return _mark(value, True, field)


def static(value: A = _MISSING, /, **field: Any) -> A:
    """Marks ``value`` as static for the attribute it is assigned to (part of the treedef);
    without a value, a dataclass field marking the class attribute static."""
    return _mark(value, False, field)


def _mark(value: Any, is_data_: bool, field: dict) -> Any:
    name = "data" if is_data_ else "static"
    if value is not _MISSING and field:
        raise errors.ConfigError(
            f"nnx.{name}() takes a value or dataclass field arguments, not both.",
            **errors.where(), fix=f"nnx.{name}(value), or field: T = nnx.{name}(default=...)")
    if value is not _MISSING:
        return _Marked(value, is_data_)
    metadata = dict(field.pop("metadata", None) or {})
    if "static" in metadata:
        raise errors.ConfigError(f"nnx.{name}(): 'static' is its own metadata key.",
                                 **errors.where(), fix="use another key")
    return dataclasses.field(**field, metadata={**metadata, "static": not is_data_})


def register_data_type(type_: T, /) -> T:
    """Makes values of ``type_`` data when assigned to an NNX object's attribute (a pytree
    child without ``nnx.data``).  Usable as a class decorator."""
    _DATA_TYPES.add(type_)
    return type_


def is_data(x: object, /) -> bool:
    """Whether ``x`` is data by its type: a Variable, an NNX object, RNG state, an array,
    or a registered data type."""
    return (isinstance(x, (Variable, Pytree, Rngs, RngStream, jax.Array, np.ndarray))
            or type(x) in _DATA_TYPES)


def has_data(value: PyTree, /) -> list[Any]:
    """The data values inside ``value`` (a pytree), each once: what makes it data."""
    seen: set[int] = set()

    def stop(x: Any) -> bool:
        again = id(x) in seen
        seen.add(id(x))
        return again or is_data(x)
    return [leaf for leaf in jax.tree.leaves(value, is_leaf=stop) if is_data(leaf)]


def check_pytree(pytree: Pytree) -> None:
    """Checks every attribute of ``pytree`` as assignment does: a static attribute holding
    data (put there bypassing ``__setattr__``) is a ``StaticDataError``."""
    if not isinstance(pytree, Pytree):
        raise errors.InvalidVariablesError(
            f"check_pytree takes an NNX object, got {type(pytree).__name__}.",
            **errors.where(), fix="pass an nnx.Pytree or nnx.Module")
    for name, value in _statics(pytree):
        _check_static(pytree, name, value)


def dataclass(cls: T | None = None, /, **options: Any) -> T | Callable[[T], T]:
    """``dataclasses.dataclass`` for an NNX object (its repr left to the object), whose
    fields take ``nnx.data()``/``nnx.static()``; a field's value is classified on
    assignment in the generated ``__init__``, as any attribute is."""
    options["repr"] = False
    return dataclasses.dataclass(**options) if cls is None else dataclasses.dataclass(cls, **options)


def _class_status(cls: type) -> dict[str, bool]:
    """``{attribute: is data}`` that ``cls``'s annotations (``nnx.Data``/``nnx.Static``) and
    dataclass fields (``nnx.data()``/``nnx.static()``) fix for every instance, its bases'
    first."""
    status: dict[str, bool] = {}
    for base in reversed(cls.__mro__[1:]):
        status.update(base.__dict__.get(_CLASS_STATUS, {}))
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except (NameError, TypeError):
        hints = dict(cls.__dict__.get("__annotations__", {}))
    for name, hint in hints.items():
        marks = getattr(hint, "__metadata__", ())
        text = hint if isinstance(hint, str) else ""
        if "__data__" in marks or text.startswith("nnx.Data"):
            status[name] = True
        elif "__static__" in marks or text.startswith("nnx.Static"):
            status[name] = False
    for name, value in vars(cls).items():
        if isinstance(value, dataclasses.Field) and "static" in value.metadata:
            status[name] = not value.metadata["static"]
    return status


def _check_static(owner: Any, name: str, value: Any) -> None:
    if any(is_data(leaf) for leaf in jax.tree.leaves(value, is_leaf=is_data)):
        why = ("marked nnx.static, or put in its __dict__ without assignment" if is_data(value)
               else f"a {type(value).__name__} is not data by its type")
        raise errors.StaticDataError(
            f"attribute '{name}' of {type(owner).__name__} is static ({why}) but holds data "
            "(a Variable, an NNX object or an array), which a transform would not see.",
            path=(name,), **errors.where(),
            fix=f"use nnx.List/nnx.Dict for containers of layers, or mark it: "
                f"self.{name} = nnx.data(...)")


def _assign(obj: Any, name: str, value: Any) -> None:
    names = obj.__dict__.setdefault(_DATA_NAMES, set())
    fixed = type(obj).__dict__.get(_CLASS_STATUS, {})
    if isinstance(value, _Marked):
        is_data_, value = value.data, value.value
        if not is_data_:
            _check_static(obj, name, value)
    elif name in fixed:
        is_data_ = fixed[name]
        if not is_data_:
            _check_static(obj, name, value)
    else:
        is_data_ = is_data(value) or name in names
        if not is_data_:
            _check_static(obj, name, value)
    (names.add if is_data_ else names.discard)(name)
    obj.__dict__[name] = value
    structure_changed()


def _flatten_with_keys(obj: Any) -> tuple[list, tuple]:
    names = sorted(obj.__dict__.get(_DATA_NAMES, ()))
    statics = tuple(sorted((k, v) for k, v in obj.__dict__.items()
                           if k != _DATA_NAMES and k not in names))
    return [(jax.tree_util.GetAttrKey(n), obj.__dict__[n]) for n in names], (tuple(names), statics)


def _flatten(obj: Any) -> tuple[list, tuple]:
    return _strip_keys(_flatten_with_keys(obj))


def _unflatten(cls: type, aux: tuple, children: Any) -> Any:
    names, statics = aux
    obj = object.__new__(cls)
    obj.__dict__.update(statics)
    obj.__dict__.update(zip(names, children))
    obj.__dict__[_DATA_NAMES] = set(names)
    return obj


class Pytree:
    """An eager object whose data attributes are its pytree children (module docstring)."""

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        setattr(cls, _CLASS_STATUS, _class_status(cls))
        cls._register()

    @classmethod
    def _register(cls) -> None:
        jax.tree_util.register_pytree_with_keys(
            cls, _flatten_with_keys, lambda aux, children: _unflatten(cls, aux, children), _flatten)

    def __setattr__(self, name: str, value: Any) -> None:
        _assign(self, name, value)

    def __delattr__(self, name: str) -> None:
        self.__dict__.get(_DATA_NAMES, set()).discard(name)
        del self.__dict__[name]
        structure_changed()


Object = Pytree


def _element_key(key: Any) -> Any:
    return jax.tree_util.SequenceKey(key) if isinstance(key, int) else jax.tree_util.DictKey(key)


def _strip_keys(flat: tuple[list, tuple]) -> tuple[list, tuple]:
    return [v for _, v in flat[0]], flat[1]


def _container_flatten(obj: _Container) -> tuple[list, tuple]:
    data = obj._data_keys()
    items = obj._items()
    kids = [(_element_key(k), v) for k, v in items if k in data]
    aux = tuple((k, k in data, None if k in data else v) for k, v in items)
    return kids, aux


def _container_unflatten(cls: type, aux: tuple, children: Any) -> Any:
    it = iter(children)
    items = [(k, next(it) if data_ else value, data_) for k, data_, value in aux]
    obj = object.__new__(cls)
    if issubclass(cls, List):
        obj.__dict__.update(_list=[v for _, v, _ in items], _data=[d for _, _, d in items])
    else:
        obj.__dict__.update(_dict={k: v for k, v, _ in items},
                            _data={k for k, _, d in items if d})
    return obj


class _Container(Pytree):
    """``List``/``Dict``: each element classified when it is put in, as an attribute is on
    assignment (data by its type or by ``nnx.data``, else static), and the classification
    kept with the element.  So flattening never re-decides it: an object-mode transform,
    which flattens a module, swaps its Variables for placeholders and flattens that again,
    finds the same children (a bare Variable held in an ``nnx.List`` included)."""

    @classmethod
    def _register(cls) -> None:
        jax.tree_util.register_pytree_with_keys(
            cls, _container_flatten, lambda aux, children: _container_unflatten(cls, aux, children),
            lambda o: _strip_keys(_container_flatten(o)))

    def _items(self) -> list[tuple[Any, Any]]:
        raise NotImplementedError

    def _data_keys(self) -> set:
        """The keys (indices) of the elements that are data."""
        raise NotImplementedError

    def _classify(self, key: Any, value: Any) -> tuple[Any, bool]:
        """``(value, is data)`` of an element put in at ``key``."""
        if isinstance(value, _Marked):
            if not value.data:
                _check_static(self, str(key), value.value)
            return value.value, value.data
        if not is_data(value):
            _check_static(self, str(key), value)
        return value, is_data(value)


class List(_Container, MutableSequence):
    """A list of layers (or values) that is a pytree: its data elements are children."""

    def __init__(self, items: Iterable[Any] = ()):
        pairs = [self._classify(i, v) for i, v in enumerate(items)]
        self.__dict__.update(_list=[v for v, _ in pairs], _data=[d for _, d in pairs])

    def _items(self) -> list[tuple[Any, Any]]:
        return list(enumerate(self._list))

    def _data_keys(self) -> set:
        return {i for i, d in enumerate(self._data) if d}

    def __getitem__(self, i: Any) -> Any:
        return self._list[i]

    def __setitem__(self, i: Any, value: Any) -> None:
        self._list[i], self._data[i] = self._classify(i, value)
        structure_changed()

    def __delitem__(self, i: Any) -> None:
        del self._list[i]
        del self._data[i]
        structure_changed()

    def __len__(self) -> int:
        return len(self._list)

    def insert(self, i: int, value: object) -> None:
        value, data_ = self._classify(i, value)
        self._list.insert(i, value)
        self._data.insert(i, data_)
        structure_changed()

    def __repr__(self) -> str:
        return f"List({self._list!r})"


class Dict(_Container, MutableMapping):
    """A mapping of layers (or values) that is a pytree, children in key order."""

    def __init__(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), /,
                 **kwargs: Any):
        self.__dict__.update(_dict={}, _data=set())
        for k, v in dict(items, **kwargs).items():
            self[k] = v

    def _items(self) -> list[tuple[Any, Any]]:
        return sorted(self._dict.items())

    def _data_keys(self) -> set:
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self._dict[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._dict[key], data_ = self._classify(key, value)
        (self._data.add if data_ else self._data.discard)(key)
        structure_changed()

    def __delitem__(self, key: str) -> None:
        del self._dict[key]
        self._data.discard(key)
        structure_changed()

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._dict)

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["_dict"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __repr__(self) -> str:
        return f"Dict({self._dict!r})"


def private_containers(obj: Pytree) -> list[Any]:
    """The containers inside ``obj`` that only this module's code changes, each change
    followed by ``structure_changed``: its set of data names, and a ``List``'s or
    ``Dict``'s elements, their classification and its attributes (all private to it).  A
    kept graph compares them only after such a change
    (``varjax.objects.graph.register_mutable``); a module's ``__dict__``, whose public
    attributes ``object.__setattr__`` writes without this code, is compared on every call."""
    attributes = obj.__dict__
    found = [attributes[_DATA_NAMES]] if _DATA_NAMES in attributes else []
    if isinstance(obj, _Container):
        found += [attributes, *(attributes[k] for k in ("_list", "_dict", "_data")
                                if k in attributes)]
    return found


# -- the one walk of an object's children -------------------------------------------------

Key = Any    # an attribute name, a list index, a dict key, a stream name


def is_node(x: Any) -> bool:
    """Whether ``x`` has children in NNX's walk: an NNX object, ``Rngs``, an ``RngStream``,
    or a JAX container (dict, list, tuple...).  Variables and arrays are leaves."""
    if isinstance(x, (Pytree, Rngs, RngStream)):
        return True
    if isinstance(x, (Variable, jax.Array, np.ndarray)):
        return False
    level = jax.tree.structure(x, is_leaf=_below())
    return level.num_nodes > 1 or level.num_leaves == 0    # an empty container is a node too


def _below() -> Any:
    """An ``is_leaf`` that stops JAX one level down: everything but the root is a leaf
    (the root's own child included, in a cycle)."""
    root = [True]

    def is_leaf(_: Any) -> bool:
        was_root, root[0] = root[0], False
        return not was_root
    return is_leaf


def flatten_node(node: Any) -> tuple[list[tuple[Key, Any]], Any]:
    """``node``'s data children in JAX's flatten order, each named as flax.nnx names it (a
    stream by its name), and the one-level treedef that rebuilds ``node`` from them.  The
    walks name children with it and rebuild with it.  A stream's children are its key and
    count as NNX's ``RngKey``/``RngCount`` Variables (``varjax.nnx.rng_variables``)."""
    if isinstance(node, RngStream):
        return stream_children(node)
    flat, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=_below())
    if isinstance(node, Rngs):
        keys: list = list(node)
    else:
        keys = [_key_name(p[0]) for p, _ in flat]
    return list(zip(keys, (child for _, child in flat))), treedef


def children(node: Any, *, static: bool = False) -> list[tuple[Key, Any]]:
    """``node``'s ``(key, child)`` pairs in flax.nnx's order (keys sorted, indices before
    names); none for a leaf.  Data children only, unless ``static``: then its static
    attributes too (a stream's ``tag``, a ``List``'s plain elements), as ``iter_graph``
    lists them.  Every walk of an NNX object goes through here, so each visits children
    by the same rules and in the same order."""
    if not is_node(node):
        return []
    pairs = flatten_node(node)[0]
    return in_order(pairs + _statics(node) if static else pairs)


def in_order(pairs: list[tuple[Key, Any]]) -> list[tuple[Key, Any]]:
    """``(key, child)`` pairs in flax.nnx's order: indices, then names, each sorted."""
    return sorted(pairs, key=_sort_key)


def _statics(node: Any) -> list[tuple[Key, Any]]:
    if isinstance(node, _Container):
        data = node._data_keys()
        return [(k, v) for k, v in node._items() if k not in data]
    if isinstance(node, Pytree):
        names = node.__dict__.get(_DATA_NAMES, ())
        return [(k, v) for k, v in node.__dict__.items() if k != _DATA_NAMES and k not in names]
    if isinstance(node, RngStream):
        return [("tag", node.tag)]
    return []


def _key_name(k: Any) -> Key:
    for attr in ("name", "key", "idx"):   # GetAttrKey, DictKey/FlattenedIndexKey, SequenceKey
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def _sort_key(pair: tuple[Key, Any]) -> tuple[int, Any]:
    key = pair[0]
    if isinstance(key, int):
        return (0, key, "")
    return (1, 0, key) if isinstance(key, str) else (2, 0, repr(key))
