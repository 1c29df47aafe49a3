"""``nnx.Module``: an NNX object with the module helpers (modes, traversal, ``sow``).

A module is a ``Pytree`` (``varjax.nnx.pytree``): built eagerly in ``__init__``, its
Variables and submodules its children.  What this file adds walks that tree: ``train()``
/``eval()``/``set_attributes`` set attributes of every module under it, ``iter_modules``/
``iter_children`` list them with their paths (both through the one walk of
``pytree.children``, as flax.nnx lists them), and ``sow``/``perturb`` keep an intermediate
value (or its perturbation) where ``nnx.capture`` collects it, as NNX does.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp

from varjax.ir import errors
from varjax.ir.typing import Node, PyTree
from varjax.nnx.config import resolve
from varjax.nnx.pytree import Dict, List, Pytree, children, is_node
from varjax.nnx.state_ops import iter_graph
from varjax.nnx.variablelib import Perturbation, Variable, variable_type_from_name
from varjax.trace.rngs import Rngs, RngStream

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

    def __init__(self, items: Mapping[str, PyTree] | Iterable[tuple[str, PyTree]] = ()):
        self._items = tuple(dict(items).items())

    def items(self) -> tuple[tuple[str, Any], ...]:
        return self._items

    def __contains__(self, name: str) -> bool:
        return any(k == name for k, _ in self._items)

    def __getitem__(self, name: str) -> Any:
        return dict(self._items)[name]

    def put(self, name: str, value: PyTree) -> "Captured":
        return Captured({**dict(self._items), name: value})

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return tuple(v for _, v in self._items), tuple(k for k, _ in self._items)

    @classmethod
    def tree_unflatten(cls, names: tuple, values: tuple) -> "Captured":
        return cls(zip(names, values))

Path = tuple[Any, ...]


def iter_modules(node: Node, /, *, graph: bool | None = None
                 ) -> Iterator[tuple[Path, Module | List | Dict]]:
    """Every module under ``node`` (``node`` included) with its path: ``iter_graph``'s
    walk (children first, keys in order, each object once in graph mode) keeping the
    modules.  ``nnx.List``/``nnx.Dict`` are listed too, as flax.nnx's (Modules there)."""
    for path, value in iter_graph(node, graph=graph):
        if isinstance(value, (Module, List, Dict)):
            yield path, value


def iter_children(node: Node, /, *, graph: bool | None = None
                  ) -> Iterator[tuple[Hashable, Node]]:
    """The objects directly under ``node`` with their keys, as flax.nnx's: every child that
    is a graph node (a module, an ``nnx.List``/``nnx.Dict`` itself, ``Rngs``, a stream, a
    Variable), in the walk's order; arrays and plain containers are not.  ``node`` must
    have children (an NNX object or a container); ``graph`` is accepted for flax.nnx's
    signature, as one level lists the same children in both modes."""
    resolve(graph)
    if not is_node(node):
        raise errors.ConfigError(
            f"iter_children: expected an NNX object or a container, got a "
            f"{type(node).__name__}.", **errors.where(), fix="pass a module")
    for key, child in children(node):
        if isinstance(child, (Pytree, Rngs, RngStream, Variable)):
            yield key, child


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

    def iter_modules(self) -> Iterator[tuple[Path, Module | List | Dict]]:
        """``nnx.iter_modules(self)``; deprecated in flax.nnx, so it warns as there."""
        warnings.warn("Module.iter_modules() is deprecated: call nnx.iter_modules(module).",
                      DeprecationWarning, stacklevel=2)
        return iter_modules(self)

    def iter_children(self) -> Iterator[tuple[Hashable, Node]]:
        """``nnx.iter_children(self)``; deprecated in flax.nnx, so it warns as there."""
        warnings.warn("Module.iter_children() is deprecated: call nnx.iter_children(module).",
                      DeprecationWarning, stacklevel=2)
        return iter_children(self)

    def sow(self, variable_type: type[Variable] | str, name: str, value: PyTree,
            reduce_fn: Callable[[PyTree, PyTree], PyTree] = lambda xs, x: (*xs, x),
            init_fn: Callable[[], PyTree] = tuple) -> bool:
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

    def perturb(self, name: str, value: jax.Array,
                variable_type: type[Variable] | str = Perturbation) -> jax.Array:
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
