"""``nnx.Module``: an NNX object with the module helpers (modes, traversal, ``sow``).

A module is a ``Pytree`` (``varjax.nnx.pytree``): built eagerly in ``__init__``, its
Variables and submodules its children.  What this file adds walks that tree: ``train()``
/``eval()``/``set_attributes`` set attributes of every module under it, ``iter_modules``/
``iter_children`` list them with their paths, and ``sow`` keeps a value in an
``Intermediate`` (or other) Variable, as NNX does.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from varjax.ir import errors
from varjax.nnx.pytree import Pytree, _Container
from varjax.nnx.variables import Variable, variable_type_from_name

__all__ = ["Module", "iter_modules", "iter_children"]

Path = tuple[Any, ...]


def _children(node: Any) -> Iterator[tuple[Any, Any]]:
    """The data children of an NNX object: (attribute name or key, value)."""
    if isinstance(node, _Container):
        yield from ((k, v) for k, v in node._items() if isinstance(v, Pytree))
        return
    names = node.__dict__.get("_nnx_data", ())
    for name in sorted(names):
        yield name, node.__dict__[name]


def iter_modules(node: Any) -> Iterator[tuple[Path, "Module"]]:
    """Every module under ``node`` (``node`` included), each once, with its path, parents
    after their children (NNX's order: depth first, post-order)."""
    seen: set[int] = set()

    def walk(path: Path, obj: Any) -> Iterator[tuple[Path, Module]]:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for key, child in _children(obj):
            if isinstance(child, Pytree):
                yield from walk((*path, key), child)
        if isinstance(obj, Module):
            yield path, obj
    yield from walk((), node)


def iter_children(node: Any) -> Iterator[tuple[Any, "Module"]]:
    """The modules directly under ``node`` (through ``nnx.List``/``nnx.Dict`` too), with
    their attribute names or keys."""
    for key, child in _children(node):
        if isinstance(child, Module):
            yield key, child
        elif isinstance(child, _Container):
            for k, sub in _children(child):
                if isinstance(sub, Module):
                    yield (key, k), sub


class Module(Pytree):
    """The base class of NNX layers and models: subclass it, build Variables and
    submodules in ``__init__``, compute in ``__call__``."""

    def set_attributes(self, *filters: type, raise_if_not_found: bool = True,
                       **attributes: Any) -> None:
        """Sets ``attributes`` on every module under this one that has them (of the
        given types, when ``filters`` are given)."""
        found = set()
        for _, module in iter_modules(self):
            if filters and not isinstance(module, filters):
                continue
            for name, value in attributes.items():
                if name in module.__dict__:
                    setattr(module, name, value)
                    found.add(name)
        missing = sorted(set(attributes) - found)
        if missing and raise_if_not_found:
            raise errors.ModuleError(
                f"set_attributes: no module under {type(self).__name__} has the attribute(s) "
                f"{', '.join(missing)}.", path=(missing[0],), **errors.where(),
                fix="pass raise_if_not_found=False to skip them")

    def train(self, **attributes: Any) -> None:
        """Training mode: ``deterministic=False`` (``Dropout``), ``use_running_average=False``
        (``BatchNorm``) on every module that has them."""
        self.set_attributes(deterministic=False, use_running_average=False, **attributes,
                            raise_if_not_found=False)

    def eval(self, **attributes: Any) -> None:
        """Evaluation mode: the opposite of ``train``."""
        self.set_attributes(deterministic=True, use_running_average=True, **attributes,
                            raise_if_not_found=False)

    def iter_modules(self) -> Iterator[tuple[Path, "Module"]]:
        return iter_modules(self)

    def iter_children(self) -> Iterator[tuple[Any, "Module"]]:
        return iter_children(self)

    def sow(self, variable_type: type[Variable] | str, name: str, value: Any,
            reduce_fn: Callable[[Any, Any], Any] = lambda xs, x: (*xs, x),
            init_fn: Callable[[], Any] = tuple) -> None:
        """Keeps ``value`` in attribute ``name``, a ``variable_type`` Variable (made on the
        first ``sow``, from ``init_fn()``), combined by ``reduce_fn``: by default a tuple of
        every value sown."""
        typ = variable_type_from_name(variable_type, allow_register=True) \
            if isinstance(variable_type, str) else variable_type
        existing = self.__dict__.get(name)
        if existing is None:
            setattr(self, name, typ(reduce_fn(init_fn(), value)))
        elif isinstance(existing, typ):
            existing.value = reduce_fn(existing.value, value)
        else:
            raise errors.ModuleError(
                f"sow: attribute '{name}' of {type(self).__name__} is a "
                f"{type(existing).__name__}, not a {typ.__name__}.", path=(name,),
                **errors.where(), fix="sow into another name, or with the attribute's type")
