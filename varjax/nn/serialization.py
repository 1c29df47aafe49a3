"""Checkpoints with boxes and FrozenDicts interchange with Linen through ``flax.serialization``.

``to_bytes``/``from_bytes`` save a box (``nn.with_partitioning``,
``nn.with_logical_partitioning``) as Linen saves its own, ``{'value': ...}``: the names
are static and come back from the target, so a boxed checkpoint of either library restores
into the other's boxes, bitwise.  A checkpoint of unboxed values restores into boxes too, as
``apply`` takes unboxed values for a boxing initializer.  A ``nn.FrozenDict`` is saved as the
dict it holds, as Linen saves its own, and restores into one.

flax is optional and costs seconds to import, so varjax does not import it: the box
classes (``axis_metadata.BOX_CLASSES``, and any defined later) are registered when the
user's code imports ``flax.serialization``, before varjax or after.  (Orbax needs nothing:
it saves a box as the pytree node it is, with Linen's key path.)
"""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Callable, Mapping

from varjax.ir import axis_metadata, errors
from varjax.ir.axis_metadata import Partitioned
from varjax.nn.frozen_dict import FrozenDict

_FLAX_SERIALIZATION = "flax.serialization"


def _box_state(box: Partitioned[Any]) -> dict[str, Any]:
    return {"value": sys.modules[_FLAX_SERIALIZATION].to_state_dict(box.value)}


def _box_from_state(target: Partitioned[Any], state: Any) -> Partitioned[Any]:
    """``target``'s box around the checkpoint's value (saved boxed or not)."""
    serialization = sys.modules[_FLAX_SERIALIZATION]
    if isinstance(state, Mapping) and not isinstance(target.value, Mapping):
        if set(state) != {"value"}:
            path = tuple(p for p in serialization.current_path().split("/") if p != ".")
            raise errors.InvalidVariablesError(
                f"the checkpoint has a dict with keys {sorted(state)} where the target holds a "
                f"{type(target).__name__} box, saved as {{'value': array}}.",
                collection=path[0] if path else None, path=path[1:], source=_caller_outside_flax(),
                fix="restore into a target of the architecture that wrote the checkpoint")
        state = state["value"]
    return target.replace_boxed(serialization.from_state_dict(target.value, state, name="value"))


def _frozen_state(d: FrozenDict) -> dict[str, Any]:
    to_state_dict = sys.modules[_FLAX_SERIALIZATION].to_state_dict
    return {str(k): to_state_dict(v) for k, v in d.items()}


def _frozen_from_state(target: FrozenDict, state: Any) -> FrozenDict:
    """``target``'s keys restored from ``state``: flax's dict rule, which names a missing or
    an extra key, on the plain dict the FrozenDict holds."""
    restore = sys.modules[_FLAX_SERIALIZATION].from_state_dict
    return FrozenDict(restore(target.unfreeze(), state))


def _caller_outside_flax() -> str:
    """``file:line (function)`` of the code that called flax.serialization (``errors.where``
    would name flax's own frame, which is not varjax's and so counts as the user's)."""
    varjax_dir = os.path.dirname(os.path.dirname(axis_metadata.__file__))     # varjax/, above ir/
    inside = (varjax_dir, os.path.dirname(sys.modules["flax"].__file__))
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _registrar(serialization: ModuleType) -> Callable[[type], None]:
    def register(cls: type) -> None:
        serialization.register_serialization_state(cls, _box_state, _box_from_state, override=True)
    return register


def _register_all(serialization: ModuleType) -> None:
    register = _registrar(serialization)
    for cls in axis_metadata.BOX_CLASSES:
        register(cls)
    serialization.register_serialization_state(FrozenDict, _frozen_state, _frozen_from_state,
                                                override=True)
    axis_metadata.box_class_hooks.append(register)


class _AfterImport:
    """A ``sys.meta_path`` finder that runs ``then(module)`` once module ``name`` is first
    imported, and then leaves ``sys.meta_path``; it finds nothing itself."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]):
        self.name, self.then, self.finding = name, then, False

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name or self.finding:
            return None
        self.finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.finding = False
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            sys.meta_path.remove(self)
            self.then(module)
        spec.loader.exec_module = exec_module    # this module's own loader object
        return spec


if _FLAX_SERIALIZATION in sys.modules:
    _register_all(sys.modules[_FLAX_SERIALIZATION])
else:
    sys.meta_path.insert(0, _AfterImport(_FLAX_SERIALIZATION, _register_all))
