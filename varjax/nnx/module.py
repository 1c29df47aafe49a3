"""``nnx.Module``: an NNX object with the module helpers (modes, traversal, ``sow``).

A module is a ``Pytree`` (``varjax.nnx.pytree``): built eagerly in ``__init__``, its
Variables and submodules its children.  What this file adds walks that tree: ``train()``
/``eval()``/``set_attributes`` set attributes of every module under it, ``iter_modules``/
``iter_children`` list them with their paths, and ``sow``/``perturb`` keep an intermediate
value (or its perturbation) where ``nnx.capture`` collects it, as NNX does.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from varjax.ir import errors
from varjax.nnx.pytree import Pytree, _Container
from varjax.nnx.variables import Perturbation, Variable, variable_type_from_name

__all__ = ["Module", "iter_modules", "iter_children", "CAPTURES", "Captured"]

# The attribute ``nnx.capture`` gives each module while it runs: a tuple of Variables, one
# per captured type, each holding a ``Captured`` of what ``sow``/``perturb`` put there.
CAPTURES = "__captures__"


@jax.tree_util.register_pytree_node_class
class Captured:
    """The values ``sow``/``perturb`` put in one capture Variable, by name, in order.

    NNX keeps a dict there; the Variable core stores a mapping value as one variable per
    key (as a variables dict nests), so a dict gaining a key inside a transform would not
    be the same variable.  This pytree keeps the names static and the values as children:
    one variable whose structure grows."""

    def __init__(self, items: Any = ()):
        self._items = tuple(dict(items).items())

    def items(self) -> tuple[tuple[str, Any], ...]:
        return self._items

    def __contains__(self, name: str) -> bool:
        return any(k == name for k, _ in self._items)

    def __getitem__(self, name: str) -> Any:
        return dict(self._items)[name]

    def put(self, name: str, value: Any) -> "Captured":
        return Captured({**dict(self._items), name: value})

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return tuple(v for _, v in self._items), tuple(k for k, _ in self._items)

    @classmethod
    def tree_unflatten(cls, names: tuple, values: tuple) -> "Captured":
        return cls(zip(names, values))

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
            init_fn: Callable[[], Any] = tuple) -> bool:
        """Keeps ``value`` under ``name``, combined by ``reduce_fn`` with what was sown there
        before (``init_fn()`` the first time): by default a tuple of every value sown.

        Under ``nnx.capture`` the value goes to the capture's Variable of ``variable_type``
        (returning False, sowing nothing, when that type is not captured), so the module
        keeps no trace of it; otherwise it is kept in attribute ``name``, a
        ``variable_type`` Variable made on the first ``sow``, as NNX's older form does."""
        typ = _variable_type(variable_type)
        captures = self.__dict__.get(CAPTURES)
        if captures is not None:
            var = _captured(captures, typ)
            if var is None:
                return False
            held = var.value
            var.value = held.put(name, reduce_fn(held[name] if name in held else init_fn(),
                                                 value))
            return True
        existing = self.__dict__.get(name)
        if existing is None:
            setattr(self, name, typ(reduce_fn(init_fn(), value)))
        else:
            _check_attribute(self, "sow", name, existing, typ)
            existing.value = reduce_fn(existing.value, value)
        return True

    def perturb(self, name: str, value: Any,
                variable_type: type[Variable] | str = Perturbation) -> Any:
        """``value`` plus the perturbation kept under ``name`` (zeros, made on first use):
        differentiating with respect to the perturbations gives the gradient with respect to
        the intermediate ``value``.  Under ``nnx.capture`` the perturbation lives in the
        capture's Variable of ``variable_type`` (``value`` is returned unchanged when that
        type is not captured); otherwise in attribute ``name``, as NNX's older form does."""
        typ = _variable_type(variable_type)
        captures = self.__dict__.get(CAPTURES)
        if captures is not None:
            var = _captured(captures, typ)
            if var is None:
                return value
            held = var.value
            if name not in held:
                held = held.put(name, jax.tree.map(jnp.zeros_like, value))
                var.value = held
            return held[name] + value
        existing = self.__dict__.get(name)
        if existing is None:
            old = jax.tree.map(jnp.zeros_like, value)
            setattr(self, name, typ(old))
        else:
            _check_attribute(self, "perturb", name, existing, typ)
            old = existing.value
        return old + value


def _variable_type(variable_type: type[Variable] | str) -> type[Variable]:
    return variable_type_from_name(variable_type, allow_register=True) \
        if isinstance(variable_type, str) else variable_type


def _captured(captures: tuple[Variable, ...], typ: type[Variable]) -> Variable | None:
    """The capture's Variable of exactly ``typ`` (NNX matches the type, not subclasses)."""
    return next((var for var in captures if type(var) is typ), None)


def _check_attribute(module: Module, what: str, name: str, existing: Any,
                     typ: type[Variable]) -> None:
    if not isinstance(existing, typ):
        raise errors.ModuleError(
            f"{what}: attribute '{name}' of {type(module).__name__} is a "
            f"{type(existing).__name__}, not a {typ.__name__}.", path=(name,),
            **errors.where(), fix=f"{what} into another name, or with the attribute's type")
