"""NNX's Variable types, as classes of varjax's one Variable core.

``nnx.Variable`` is ``vj.Variable`` (``varjax.trace.variable``) with NNX's accessors: each
type is a collection of the IR, named as ``nnx.variable_name_from_type`` names it
(``Param`` ``params``, ``BatchStat`` ``batch_stats``; a user subclass its class name), so
a type filter and a collection name select the same variables and every varjax tool
(``vj.state``, ``vj.pretty``, passes) sees them.  Inside an object-mode transform an
``nnx`` Variable is a handle whose reads and writes are ``var_get``/``var_set`` of the
trace, as ``vj.Variable``'s are: the same class, not a second mechanism.
"""
from __future__ import annotations

from typing import Any

from varjax.ir import errors
from varjax.trace import variable as core

__all__ = ["Variable", "Param", "BatchStat", "Cache", "Intermediate", "Perturbation", "OptState",
           "LoRAParam", "RngState", "RngKey", "RngCount", "variable_name_from_type",
           "variable_type_from_name"]


class Variable(core.Variable, collection="Variable"):
    """An NNX variable: ``.value``, ``[...]``, ``get_value()``/``set_value()``, metadata as
    attributes.  Subclass it for a collection of your own (``class Count(nnx.Variable)``
    is collection ``Count``, as NNX names it)."""

    __slots__ = ()

    def __init__(self, value: Any, **metadata: Any):
        if "collection" in metadata:
            raise errors.InvalidVariablesError(
                f"nnx.{type(self).__name__}: an NNX Variable's collection is its type, got "
                f"collection={metadata['collection']!r}.", collection=metadata["collection"],
                **errors.where(), fix="subclass nnx.Variable for a collection of your own")
        super().__init__(value, **metadata)

    def get_value(self) -> Any:
        return self.value

    def __getitem__(self, index: Any) -> Any:
        """``v[...]`` is the whole value, whatever it is (a tuple of sown values too)."""
        return self.value if index is Ellipsis else self.value[index]

    def set_value(self, value: Any) -> None:
        self.value = value

    def set_metadata(self, **metadata: Any) -> None:
        """Adds or replaces metadata entries (NNX's ``Variable.set_metadata``)."""
        self._metadata.update(metadata)

    def has_metadata(self, name: str) -> bool:
        return name in self._metadata

    def replace(self, value: Any) -> "Variable":
        """A new Variable of this type and metadata holding ``value``."""
        return type(self)(value, **self._metadata)


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


class Perturbation(Variable, collection="perturbations"):
    """Zeros added by ``Module.perturb``, whose gradient is the intermediate's."""

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
    __slots__ = ()


class RngCount(RngState, collection="RngCount"):
    __slots__ = ()


def variable_name_from_type(typ: type[core.Variable], /, *, allow_register: bool = False) -> str:
    """The collection of Variable type ``typ`` (its class name for one that names none).
    Every subclass is registered when its class is made, so ``allow_register`` (NNX's
    opt-in to registering on first use) changes nothing."""
    name = core.collection_of(typ)
    if name is None:
        raise errors.InvalidVariablesError(
            f"{typ.__qualname__} is not a registered Variable type.", **errors.where(),
            fix="subclass nnx.Variable")
    return name


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

