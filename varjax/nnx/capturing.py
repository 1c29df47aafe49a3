"""``nnx.capture``: run a function over a module, collecting what ``sow`` and ``perturb`` put.

While the function runs, each module under the target holds ``__captures__``
(``module.CAPTURES``): one Variable per captured type (and per type of ``init=``), each
holding what was put there by name (``module.Captured``).  ``Module.sow``/``Module.perturb``
write there, so the collected values are Variable state of the module: an ``nnx`` transform inside the
function carries them like any Variable (its writes come back through the discharge
signature), and one around ``capture`` sees only the function's output.  After the call
the values are returned as ``State``s nested by module path, and the attribute is gone:
the module is as it was.

``init=`` starts the captured Variables from a state (``capture``'s own output): passed to
``nnx.grad`` as a differentiable argument, a ``Perturbation`` state gives the gradient
with respect to the intermediates ``perturb`` marked (the Tree Mode note's workflow).
``method_outputs=`` sows each public method's output (and ``__call__``'s) of every module
class under the target under the method's name, for the call.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Callable

from varjax.ir import errors
from varjax.nnx.module import CAPTURES, Captured, Module, iter_modules
from varjax.nnx.pytree import data
from varjax.nnx.state_ops import split_state
from varjax.nnx.statelib import State
from varjax.nnx.variablelib import Variable

__all__ = ["capture"]

Path = tuple[Any, ...]


def _by_module(init: Any) -> dict[Path, dict[str, Variable]]:
    """``init``'s Variables grouped by the path of the module holding them."""
    found: dict[Path, dict[str, Variable]] = {}

    def walk(node: Any, path: Path) -> None:
        for key, value in node.items():
            if isinstance(value, Variable):
                found.setdefault(path, {})[key] = value
            elif isinstance(value, Mapping):
                walk(value, (*path, key))
    walk(init, ())
    return found


def _instrument(module: Any, variable_type: type[Variable]) -> list[tuple[type, str, Any]]:
    """Wraps the public methods and ``__call__`` defined by each module class under
    ``module`` to sow their output under the method's name; returns what to restore."""
    replaced: list[tuple[type, str, Any]] = []
    classes = {type(m) for _, m in iter_modules(module)}
    for cls in classes:
        for name, method in list(vars(cls).items()):
            if inspect.isfunction(method) and (name == "__call__" or not name.startswith("_")):
                def sowing(self: Any, *args: Any, __name: str = name, __method: Any = method,
                           **kwargs: Any) -> Any:
                    out = __method(self, *args, **kwargs)
                    self.sow(variable_type, __name, out)
                    return out
                functools.update_wrapper(sowing, method)
                setattr(cls, name, sowing)
                replaced.append((cls, name, method))
    return replaced


def _collected(module: Any, wanted: set[type]) -> State:
    """The captured values of ``wanted`` types, each a new Variable of its type, nested by
    module path then name."""
    flat: dict[Path, Variable] = {}
    for path, m in iter_modules(module):
        for var in m.__dict__.get(CAPTURES, ()):
            if type(var) in wanted:
                flat.update({(*path, name): type(var)(value)
                             for name, value in var.value.items()})
    return State.from_flat(flat)


def capture(fn: Callable | type[Variable], *var_types: type[Variable],
            init: State | Mapping | None = None,
            method_outputs: type[Variable] | None = None) -> Callable:
    """``fn`` returning ``(out, state)`` (one state per type of ``var_types``, after
    ``out``; just ``out`` with none), the values ``sow``/``perturb`` put under the module
    while it ran.  ``fn`` is a module (its ``__call__``), a module's bound method, or a
    function whose first argument is the module; ``capture(nnx.Intermediate)`` (types
    first) is a decorator."""
    if isinstance(fn, type) and issubclass(fn, Variable):
        types = (fn, *var_types)
        return lambda actual: capture(actual, *types, init=init, method_outputs=method_outputs)
    for t in var_types:
        if not (isinstance(t, type) and issubclass(t, Variable)):
            raise errors.InvalidVariablesError(
                f"nnx.capture: {t!r} is not a Variable type.", **errors.where(),
                fix="name the Variable types to capture, e.g. nnx.capture(model, "
                    "nnx.Intermediate)")
    if isinstance(fn, Module):
        instance = fn
    elif inspect.ismethod(fn) and isinstance(fn.__self__, Module):
        instance = fn.__self__
    else:
        instance = None

    def call(*args: Any, **kwargs: Any) -> Any:
        module = instance if instance is not None else (args[0] if args else None)
        if not isinstance(module, Module):
            raise errors.ConfigError(
                f"nnx.capture: {getattr(fn, '__name__', 'the function')} was called with "
                f"{type(module).__name__ if args else 'no arguments'} first; a function "
                "captured this way takes the module to capture from as its first argument.",
                **errors.where(), fix="pass the module first, or capture the module itself: "
                                      "nnx.capture(model, ...)(x)")
        given = _by_module(init) if init is not None else {}
        for path, m in iter_modules(module):
            values: dict[type, dict[str, Any]] = {t: {} for t in var_types}
            for name, var in given.get(path, {}).items():
                values.setdefault(type(var), {})[name] = var.get_value()
            setattr(m, CAPTURES, data(tuple(t(Captured(v)) for t, v in values.items())))
        replaced = _instrument(module, method_outputs) if method_outputs else []
        try:
            out = fn(*args, **kwargs)
            found = _collected(module, set(var_types))
        finally:
            for cls, name, method in replaced:
                setattr(cls, name, method)
            for _, m in iter_modules(module):
                if CAPTURES in m.__dict__:
                    delattr(m, CAPTURES)
        if not var_types:
            return out
        states = split_state(found, *var_types)
        return (out, states) if len(var_types) == 1 else (out, *states)
    # a module's __dict__ (its attributes) is not the wrapper's
    return call if isinstance(fn, Module) else functools.wraps(fn)(call)
