"""Naming: how a module and its submodules and variables get their names.

A submodule's name is its path segment, so it decides where its variables live
(``params:Dense_0/kernel``).  Names are reserved as in Linen (by ``setup``, and
per call of the compact method, which starts from setup's); taking one twice
raises ``NameInUseError`` instead of letting one definition silently win.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import TYPE_CHECKING, Any, Callable

from varjax.ir import errors
from varjax.ir.primitives import Path
from varjax.nn.binding import Scope
from varjax.trace.context import site

if TYPE_CHECKING:
    from varjax.nn.module.lifecycle_state import ModuleState


class Naming:
    """The naming half of a module: its label, and the names it hands out.

    Every ``Module`` is a ``Naming`` (``core.Module`` is assembled from it), so this file
    recognises modules by this class; it cannot import ``Module``, which imports it."""

    scope: Scope | None
    _state: ModuleState

    def _label(self) -> str:
        """The module in error messages: its scope as JAX's name stack shows it (the root's
        class, then submodule names) and its class, ``MLP/hidden (Dense)``; the root is
        ``MLP``, a module that is not bound ``Dense (unbound)`` (see ``varjax.ir.errors``).

        Implements ``varjax.ir.protocols.Labelled``."""
        if self.scope is None:
            return f"{type(self).__name__} (unbound)"
        root = self
        while root.scope.path and isinstance(root.parent, Naming) and root.parent.scope is not None:
            root = root.parent
        head = () if root.scope.path else (root._scope_name(),)
        text = "/".join(head + self.scope.path)
        return f"{text} ({type(self).__name__})" if self.scope.path else text

    def _scope_name(self) -> str:
        """The name of this module's ``jax.named_scope``: its name, or for a root its class."""
        return self.name or type(self).__name__

    def _path(self, name: str) -> Path:
        """The path of this module's variable or submodule ``name``."""
        return self.scope.path + (name,)

    def _autoname(self, cls: type) -> str:
        """``Dense_0``, ``Dense_1``, ...: the name of an inline submodule of a compact method,
        counted per class within this call."""
        prefix = cls.__name__
        n = self._state.cursor.get(prefix, 0)
        self._state.cursor[prefix] = n + 1
        return f"{prefix}_{n}"

    def _register_child(self, child: Naming, name: str) -> None:
        """Reserves ``name`` for ``child`` and binds it under this module's scope."""
        if self.scope is None:
            raise errors.UnboundModuleError(
                f"submodule {name} cannot be added to {self._label()}, which is not bound.",
                **site(about=self),
                fix="call the module through init/apply/bind")
        state = self._state
        if name in state.call_names:
            raise errors.NameInUseError(
                f"the name '{name}' is used by two submodules of {self._label()}.",
                path=self._path(name), **site(about=self),
                fix="give the submodules distinct name= arguments")
        taken = sorted(c for c, n in state.call_vars if n == name)
        if taken:
            raise errors.NameInUseError(
                f"submodule '{name}' of {self._label()} has the name of a variable in "
                f"collection '{taken[0]}'.", collection=taken[0], path=self._path(name),
                **site(about=self), fix="rename the submodule or the variable")
        state.call_names.add(name)
        if state.in_setup:
            state.setup_names.add(name)
        object.__setattr__(child, "name", name)
        object.__setattr__(child, "scope", Scope(self.scope.root, self._path(name)))
        child._adopt_fields()

    def _adopt_fields(self) -> None:
        """Binds the modules this module's fields hold, as soon as it is bound, as Linen
        does: ``self.bar.baz(x)`` reaches a bound ``baz`` before ``bar`` runs setup, and a
        module held by two fields (or two siblings' fields) belongs to the first one in
        declaration order, whichever method runs first."""
        state = self._state
        was, state.in_setup = state.in_setup, True    # the clones register as setup's do
        try:
            for name in type(self)._varjax_adoptable_fields:
                value = getattr(self, name)
                adopted = adopt_submodules(value, self._adopt, name)
                if adopted is not value:
                    object.__setattr__(self, name, adopted)
        finally:
            state.in_setup = was

    def _reserve_variable(self, what: str, collection: str, name: str, anywhere: bool = False) -> None:
        """Takes variable ``name`` of ``collection`` for this call, as Linen's reservations do:
        declaring it twice, under a submodule's name, or (unless ``anywhere``: ``sow``)
        outside setup and compact methods raises (one declaration would silently win
        otherwise)."""
        state = self._state
        path = self._path(name)
        if not (anywhere or state.in_setup or state.compact_depth or state.eager_op):
            raise errors.ModuleError(
                f"{what} '{name}' of {self._label()} is declared outside setup() and outside an "
                "@compact method.", collection=collection, path=path, **site(about=self),
                fix="declare it in setup(), or decorate the method with @nn.compact")
        if name in state.call_names:
            raise errors.NameInUseError(
                f"{what} '{name}' of {self._label()} has the name of a submodule.",
                collection=collection, path=path, **site(about=self),
                fix=f"rename the {what} or the submodule")
        key = (collection, name)
        if key in state.call_vars:
            raise errors.NameInUseError(
                f"{what} '{name}' of {self._label()} is declared twice in collection "
                f"'{collection}'" + (" (in setup and again in the call)."
                                     if key in state.setup_vars and not state.in_setup else "."),
                collection=collection, path=path, **site(about=self),
                fix="declare it once and keep the value (or handle) the declaration returns, "
                    "or give the second one another name")
        state.call_vars.add(key)
        if state.in_setup:
            state.setup_vars.add(key)

    def _adopt(self, child: Naming, name: str) -> Naming:
        """A module held by a field or assigned in setup becomes a child named ``name``."""
        if child.scope is not None:
            return child                      # already bound elsewhere: shared, not copied
        if child.parent is self:              # constructed in our setup without name=
            self._register_child(child, name)
            return child
        # One unbound instance held in several places is adopted once, where it is first
        # met, and shared after that (Linen's sharing by reference).  The field's name wins
        # over a name= the instance was built with, as in Linen.
        adopted = self.scope.root.adopted
        hit = adopted.get(id(child))
        if hit is not None and hit[0] is child:
            return hit[1]
        clone = dataclasses.replace(child, parent=self, name=name)
        if clone.scope is None:
            self._register_child(clone, clone.name)
        adopted[id(child)] = (child, clone)
        return clone


# Field values that cannot hold a module (initializers are functions, dtypes classes).
_LEAVES = frozenset({int, float, bool, str, type(None), type, types.FunctionType,
                     functools.partial})


def adopt_submodules(value: Any, adopt: Callable[[Naming, str], Naming], name: str) -> Any:
    """``value`` (a field or a setup attribute named ``name``) with every module in it,
    down through lists, tuples and dicts, replaced by ``adopt(module, its name)``:
    ``layers_0``, ``layers_1`` in a list, ``layers_key`` in a dict."""
    if type(value) in _LEAVES:     # most fields: asked of every field at every setup
        return value
    if isinstance(value, Naming):
        return adopt(value, name)
    if isinstance(value, (list, tuple)):
        items = [adopt_submodules(x, adopt, f"{name}_{i}") for i, x in enumerate(value)]
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict):
        # adopted in key order, as Linen walks a dict (a module held under two keys
        # belongs to the first key in that order); the dict keeps its own order
        try:
            order = sorted(value)
        except TypeError:       # keys that do not compare: their own order
            order = list(value)
        adopted = {k: adopt_submodules(value[k], adopt, f"{name}_{k}") for k in order}
        return {k: adopted[k] for k in value}
    return value


def share_scope(module: Naming, other: Naming, /) -> None:
    """Makes two bound modules keep their variables in one place (Linen's
    ``nn.share_scope``): when ``other`` is ``module`` or below it, ``other`` moves to
    ``module``'s path; otherwise ``module`` moves to ``other``'s.  A wrapper calling it in
    ``setup`` (a LoRA around a ``Dense``) adds its variables next to the wrapped ones.
    The submodules the moved module already has move with it."""
    for m in (module, other):
        if m.scope is None:
            raise errors.UnboundModuleError(
                f"share_scope needs two bound modules; {m._label()} is not bound.",
                **site(about=m), fix="call share_scope in setup() or in a method run by init/apply")
    mine, theirs = module.scope.path, other.scope.path
    moved, target = (other, module.scope) if theirs[:len(mine)] == mine else (module, other.scope)
    old = moved.scope
    object.__setattr__(moved, "scope", target)

    def follow(child: Naming, name: str) -> Naming:
        if child.parent is moved and child.scope is not None and child.scope.path[:-1] == old.path:
            object.__setattr__(child, "scope", Scope(target.root, target.path + child.scope.path[-1:]))
        return child
    for attr, value in list(vars(moved).items()):
        if attr not in ("parent", "scope"):
            adopt_submodules(value, follow, attr)
