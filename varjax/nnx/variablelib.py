"""NNX's Variable types, as classes of varjax's one Variable core.

``nnx.Variable`` is ``vj.Variable`` (``varjax.trace.variable``) with NNX's accessors: each
type is a collection of the IR, named as ``nnx.variable_name_from_type`` names it
(``Param`` ``params``, ``BatchStat`` ``batch_stats``; a user subclass its class name, or
``Count@its.module`` when another class has that name: two same-named classes are two
types, as in NNX), so a type filter and a collection name select the same variables (a
type selects its subclasses too, as NNX's: ``Param`` a ``LoRAParam``, ``Intermediate`` a
``Perturbation``, each still of a collection of its own) and
every varjax tool (``vj.state``, ``vj.pretty``, passes) sees them.  Inside an object-mode transform an
``nnx`` Variable is a handle whose reads and writes are ``var_get``/``var_set`` of the
trace, as ``vj.Variable``'s are: the same class, not a second mechanism.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import types
import warnings
from typing import Any, Callable, Generic, Iterator, Mapping, Sequence, TypeVar

import jax
import numpy as np

from varjax import _jax
from varjax.ir import errors
from varjax.ir.typing import Metadata, PyTree
from varjax.trace import variable as core
from varjax.trace.unprovided import not_provided

__all__ = ["Variable", "Param", "BatchStat", "Cache", "Intermediate", "Perturbation", "OptState",
           "LoRAParam", "RngState", "RngKey", "RngCount", "variable_name_from_type",
           "variable_type_from_name", "register_variable_name", "VariableMetadata",
           "with_metadata", "var_defaults", "VarDefaults", "A"]

A = TypeVar("A")
F = TypeVar("F", bound=Callable[..., Any])
_MISSING: Any = object()
_VALUE_HOOKS = ("on_set_value", "on_get_value", "on_create_value")
_AXIS_HOOKS = ("on_add_axis", "on_remove_axis")


@dataclasses.dataclass
class VariableMetadata(Generic[A]):
    """What an initializer wrapped by ``with_metadata`` returns: the value and the metadata
    the Variable made from it takes (``nnx.Param(init(key, shape))`` unwraps it), so a
    layer that passes its initializer's result to a Variable carries the metadata without
    knowing of it.  The hooks are flax.nnx's deprecated Variable hooks: varjax runs the
    axis hooks (``Variable.add_axis``) and refuses the value hooks (``_no_value_hooks``)."""

    raw_value: A
    on_set_value: tuple[Callable[..., Any], ...] = ()
    on_get_value: tuple[Callable[..., Any], ...] = ()
    on_create_value: tuple[Callable[..., Any], ...] = ()
    on_add_axis: tuple[Callable[..., Any], ...] = ()
    on_remove_axis: tuple[Callable[..., Any], ...] = ()
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _no_value_hooks(hooks: Mapping[str, Any]) -> None:
    given = sorted(name for name in _VALUE_HOOKS if hooks.get(name))
    if given:
        not_provided(f"Variable hooks ({', '.join(given)})",
                     "varjax reads and writes Variables as IR effects and runs no hooks "
                     "around them (flax.nnx deprecates them too).",
                     "subclass nnx.Variable and compute in your layer's __call__",
                     by="varjax.nnx")


def _as_tuple(hooks: Callable[..., Any] | Sequence[Callable[..., Any]]) -> tuple:
    return (hooks,) if callable(hooks) else tuple(hooks)


def with_metadata(initializer: F, on_set_value: Sequence[Callable[..., Any]] = (),
                  on_get_value: Sequence[Callable[..., Any]] = (),
                  on_create_value: Sequence[Callable[..., Any]] = (),
                  on_add_axis: Sequence[Callable[..., Any]] = (),
                  on_remove_axis: Sequence[Callable[..., Any]] = (), **metadata: Any) -> F:
    """``initializer`` whose result carries ``metadata`` into the Variable made from it
    (``VariableMetadata``): ``nnx.with_metadata(init, out_sharding=('a', None))``; the axis
    hooks (a callable or a sequence of them) with it."""
    _no_value_hooks(dict(on_set_value=on_set_value, on_get_value=on_get_value,
                         on_create_value=on_create_value))
    add, remove = _as_tuple(on_add_axis), _as_tuple(on_remove_axis)

    @functools.wraps(initializer)
    def wrapper(*args: Any) -> VariableMetadata:
        return VariableMetadata(initializer(*args), on_add_axis=add, on_remove_axis=remove,
                                metadata=metadata)
    return wrapper  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class VarDefaults(Mapping[str, Any]):
    """The defaults new Variables take (``var_defaults()``): in varjax a Variable is never
    a hijax type nor an array ``Ref`` (its reads and writes are effects of the object-mode
    trace), so both are False."""

    hijax: bool = False
    ref: bool = False

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(("hijax", "ref"))

    def __len__(self) -> int:
        return 2


_OLD_NAMES = ("sharding", "sharding_names")


def _renamed(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """``metadata`` with flax.nnx's deprecated names of ``out_sharding`` (``sharding``,
    ``sharding_names``) renamed, each with flax.nnx's ``DeprecationWarning``."""
    out = dict(metadata)
    for old in _OLD_NAMES:
        if old in out:
            warnings.warn(f"'{old}' is deprecated, use 'out_sharding' instead.",
                          DeprecationWarning, stacklevel=3)
            out["out_sharding"] = out.pop(old)
    return out


def _refuse_mode(where: str, hijax: bool | None, ref: bool | None) -> None:
    asked = [name for name, on in (("hijax", hijax), ("ref", ref)) if on]
    if asked:
        not_provided(f"{where}({asked[0]}=True)",
                     "a varjax Variable is neither a hijax type nor an array Ref: object mode "
                     "makes its reads and writes effects of the transform's trace, which "
                     "gives what both modes give (in-place updates under jit, grad, vmap).",
                     f"leave {asked[0]} out (or False)", by="varjax.nnx")


@contextlib.contextmanager
def _unchanged() -> Iterator[None]:
    yield


def var_defaults(*, hijax: bool | None = None, ref: bool | None = None
                 ) -> VarDefaults | contextlib.AbstractContextManager[None]:
    """With no argument the defaults (``VarDefaults``); with ``hijax=``/``ref=`` a context
    manager and decorator setting them, as flax.nnx's.  Only False is a mode varjax has,
    so setting it changes nothing and True raises ``NotProvidedError``."""
    if hijax is None and ref is None:
        return VarDefaults()
    _refuse_mode("nnx.var_defaults", hijax, ref)
    return _unchanged()


class Variable(core.Variable, collection="Variable"):
    """An NNX variable: ``.value``, ``[...]``, ``get_value()``/``set_value()``, metadata as
    attributes.  Subclass it for a collection of your own (``class Count(nnx.Variable)``
    is collection ``Count``, as NNX names it)."""

    __slots__ = ()

    def __class_getitem__(cls, item: Any) -> types.GenericAlias:
        """``nnx.Variable[jax.Array]``, ``nnx.Param[A]``: a Variable type annotated with
        its value's, as flax.nnx's generic Variable is written in signatures."""
        return types.GenericAlias(cls, item)

    def __init__(self, value: PyTree | VariableMetadata, *, hijax: bool | None = None,
                 ref: bool | None = None, **metadata: Any):
        _refuse_mode(f"nnx.{type(self).__name__}", hijax, ref)
        if isinstance(value, VariableMetadata):
            _no_value_hooks({k: getattr(value, k) for k in _VALUE_HOOKS})
            hooks = {k: _as_tuple(getattr(value, k)) for k in _AXIS_HOOKS if getattr(value, k)}
            value, metadata = value.raw_value, {**hooks, **metadata, **value.metadata}
        metadata = _renamed(metadata)
        if "collection" in metadata:
            raise errors.InvalidVariablesError(
                f"nnx.{type(self).__name__}: an NNX Variable's collection is its type, got "
                f"collection={metadata['collection']!r}.", collection=metadata["collection"],
                **errors.where(), fix="subclass nnx.Variable for a collection of your own")
        super().__init__(value, **metadata)

    def get_value(self) -> PyTree:
        return self.value

    def __getitem__(self, index: Any) -> Any:
        """``v[...]`` is the whole value, whatever it is (a tuple of sown values too)."""
        return self.value if index is Ellipsis else self.value[index]

    def __setitem__(self, index: Any, new: Any) -> None:
        """``v[i] = x`` as flax.nnx's: an array value keeps its shape and dtype (``x``
        takes its place as it is only when it is a JAX array of that shape and dtype, else
        it is written into it, ``.at[i].set``: cast and broadcast, so a float written to a
        bfloat16 statistic stays bfloat16); any other value (a NumPy array, a dict, a list)
        has the item set in a copy, written back whole, so it stays one write."""
        old = self.value_type()     # inside a trace: no read of the value for this
        if isinstance(old, (jax.Array, _jax.ShapedArray)):
            if index is Ellipsis and not (isinstance(new, jax.Array) and new.shape == old.shape
                                          and new.dtype == old.dtype):
                new = self.value.at[...].set(new)
            super().__setitem__(index, new)
        elif index is Ellipsis and not isinstance(old, np.ndarray):
            self.value = new
        else:
            changed = copy.copy(old)
            changed[index] = new
            self.value = changed

    def set_value(self, value: PyTree) -> None:
        self.value = value

    def get_metadata(self, name: str | None = None, default: object = _MISSING
                     ) -> Metadata | object:
        """All metadata (a copy), or entry ``name`` (``default`` when absent, else
        ``KeyError``), as NNX's ``Variable.get_metadata``."""
        if name is None:
            return dict(self._metadata)
        if default is _MISSING:
            return self._metadata[name]
        return self._metadata.get(name, default)

    def set_metadata(self, *args: Any, **metadata: Any) -> None:
        """NNX's three forms: ``set_metadata(dict)`` replaces all metadata,
        ``set_metadata(name, value)`` and ``set_metadata(**entries)`` add or replace
        entries."""
        if args and metadata or len(args) > 2:
            raise TypeError("set_metadata takes a dict, a name and a value, or keywords")
        if len(args) == 1:
            self._metadata = _renamed(dict(args[0]))
        else:
            self._metadata.update(_renamed(dict([args]) if args else metadata))

    @property
    def sharding_names(self) -> Any:
        """``out_sharding`` under its deprecated name (flax.nnx warns too)."""
        warnings.warn("'sharding_names' is deprecated, use 'out_sharding' instead.",
                      DeprecationWarning, stacklevel=2)
        return self._metadata.get("out_sharding")

    def has_metadata(self, name: str) -> bool:
        return name in self._metadata

    def replace(self, value: PyTree) -> "Variable":
        """A new Variable of this type and metadata holding ``value``."""
        return type(self)(value, **self._metadata)

    def add_axis(self, axis_index: int, axis_name: str | None) -> None:
        """Runs the ``on_add_axis`` hooks, ``hook(self, axis_index, axis_name)``, after a
        transform's ``transform_metadata`` named a new axis (``vj.transform_metadata``)."""
        for hook in self._hooks("on_add_axis"):
            hook(self, axis_index, axis_name)

    def remove_axis(self, axis_index: int, axis_name: str | None) -> None:
        """As ``add_axis``, the ``on_remove_axis`` hooks, after the axis was taken away."""
        for hook in self._hooks("on_remove_axis"):
            hook(self, axis_index, axis_name)

    def _hooks(self, name: str) -> tuple:
        """The hooks ``name`` of metadata (``on_add_axis=`` given to the Variable or its
        ``with_metadata`` initializer), else the class's method of that name, as flax.nnx
        picks them."""
        given = self._metadata.get(name)
        if given is not None:
            return _as_tuple(given)
        own = getattr(type(self), name, None)
        return (own,) if own is not None else ()


def _delegate(name: str) -> Any:
    def op(self: Variable, *args: Any) -> Any:
        return getattr(self.value, name)(*args)
    op.__name__ = name
    return op


# NNX Variables compute like their values (``self.total / self.count`` in a metric).
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
              "xor", "lshift", "rshift"):
    setattr(Variable, f"__{_name}__", _delegate(f"__{_name}__"))
    setattr(Variable, f"__r{_name}__", _delegate(f"__r{_name}__"))
for _name in ("neg", "pos", "abs", "invert", "lt", "le", "gt", "ge", "float", "int", "index"):
    setattr(Variable, f"__{_name}__", _delegate(f"__{_name}__"))


class Param(Variable, collection="params"):
    """Trainable parameters (collection ``params``)."""

    __slots__ = ()


class BatchStat(Variable, collection="batch_stats"):
    """Running statistics of normalization layers (collection ``batch_stats``)."""

    __slots__ = ()


class Cache(Variable, collection="cache"):
    """Decoding caches (collection ``cache``)."""

    __slots__ = ()


class Intermediate(Variable, collection="intermediates"):
    """Values kept by ``Module.sow`` (collection ``intermediates``)."""

    __slots__ = ()


class Perturbation(Intermediate, collection="perturbations"):
    """Zeros added by ``Module.perturb``, whose gradient is the intermediate's.  An
    ``Intermediate`` as in NNX, so the type filter ``nnx.Intermediate`` selects it too;
    its collection is its own, so the name ``'intermediates'`` does not (as ``LoRAParam``
    under ``Param``)."""

    __slots__ = ()


class OptState(Variable, collection="OptState"):
    """Optimizer state."""

    __slots__ = ()


class LoRAParam(Param, collection="LoRAParam"):
    """Low-rank adapter parameters: a ``Param`` of a collection of its own."""

    __slots__ = ()


class RngState(Variable, collection="RngState"):
    """RNG state.  ``nnx.Rngs`` here is ``vj.Rngs``, which keeps its keys and counts as
    object-mode cells of collection ``rngs``; these types exist for filters and for code
    that names them."""

    __slots__ = ()


class RngKey(RngState, collection="RngKey"):
    """An RNG stream's key, as a type to filter by (see ``RngState``)."""

    __slots__ = ()


class RngCount(RngState, collection="RngCount"):
    """An RNG stream's draw count, as a type to filter by (see ``RngState``)."""

    __slots__ = ()


def variable_name_from_type(typ: type[core.Variable], /, *, allow_register: bool = False) -> str:
    """The collection of Variable type ``typ``: its class name for one that names none
    (``Name@module`` when another class had that name first).  Every subclass is
    registered when its class is made, so ``allow_register`` (NNX's opt-in to
    registering on first use) changes nothing."""
    name = core.collection_of(typ)
    if name is None:
        raise errors.InvalidVariablesError(
            f"{typ.__qualname__} is not a registered Variable type.", **errors.where(),
            fix="subclass nnx.Variable")
    return name


def register_variable_name(name: str, typ: type[core.Variable] | None = None, *,
                           overwrite: bool = False
                           ) -> type[core.Variable] | Callable[[type[core.Variable]], type[core.Variable]]:
    """Makes ``name`` the collection of Variable type ``typ`` (NNX's link between a Linen
    collection and an NNX type); without ``typ``, a class decorator.  In varjax the name
    is the type's collection in the IR, so register it before making Variables of the
    type: those made before keep the collection they were made with."""
    if typ is None:
        return functools.partial(register_variable_name, name, overwrite=overwrite)
    core.rename_collection(typ, name, overwrite=overwrite)
    return typ


def variable_type_from_name(name: str, /, *, allow_register: bool = False) -> type[core.Variable]:
    """The Variable type of collection ``name``; a new subclass of ``nnx.Variable`` named
    ``name`` with ``allow_register=True`` when none is registered."""
    found = core.variable_type(name)
    if found is not core.Variable:
        return found
    if not allow_register:
        raise errors.InvalidVariablesError(
            f"no Variable type is registered for collection '{name}'.", collection=name,
            **errors.where(), fix="pass allow_register=True, or subclass nnx.Variable")
    return type(name, (Variable,), {"__slots__": (), "__module__": __name__})

