"""What the inspection tools accept as "the code to look at", as one ``Functionalized``.

``vj.dump``, ``vj.dataflow``, the summary and the command line all take either a
``vj.functionalize``-d function, a plain function using ``vj.param`` & co., a
``Module`` (its ``__call__``), or a bound method of a module (``model.encode``), each
also wrapped in ``functools.partial`` (``partial(model.encode, train=False)``), or a
function over an unbound module given it as a partial's first argument (``partial(forward, model)``:
``forward(module, *args)`` runs bound, as ``model.apply(..., method=forward)`` runs it).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from varjax.functionalization.functionalized import Functionalized, functionalize
from varjax.nn.module import Module


def as_functionalized(target: Any) -> Functionalized:
    """The ``Functionalized`` behind ``target`` (see the module docstring)."""
    if isinstance(target, Functionalized):
        return target
    if isinstance(target, type) and issubclass(target, Module):
        raise TypeError(f"{target.__name__} is a Module class: pass an instance, "
                        f"e.g. {target.__name__}(...)")
    found = _module_call(target)
    if found is not None:
        module, method = found
        return module.functionalize(method)
    if callable(target):
        return functionalize(target)
    raise TypeError(f"cannot inspect a {type(target).__name__}: pass a function, a Module, "
                    "or a method of a Module")


def is_linen_target(target: Any) -> bool:
    """Whether ``target`` is a ``Functionalized`` or calls a ``Module`` (``as_functionalized``
    takes it as one), rather than a plain function."""
    return isinstance(target, Functionalized) or _module_call(target) is not None


def _module_call(target: Any) -> tuple[Module, Callable[..., Any] | None] | None:
    """``(module, method)`` when ``target`` calls a module: the method as ``apply``'s
    ``method=`` takes it (None: ``__call__``).  A partial's arguments go into the method,
    so the module runs bound (called directly, it is not)."""
    if isinstance(target, Module):
        return target, None
    owner = getattr(target, "__self__", None)
    if isinstance(owner, Module):
        return owner, target.__func__
    if not isinstance(target, functools.partial):
        return None
    found = _module_call(target.func)
    if found is not None:
        module, method = found
        return module, _with_arguments(method or type(module).__call__, target.args,
                                       target.keywords)
    if target.args and isinstance(target.args[0], Module) and target.args[0].scope is None:
        # a function over an unbound module (a bound one is an object-mode step's object)
        return target.args[0], _with_arguments(target.func, target.args[1:], target.keywords)
    return None


def _with_arguments(method: Callable[..., Any], args: tuple, keywords: dict) -> Callable[..., Any]:
    """``method`` with a partial's arguments after the module, as the partial passed them."""
    @functools.wraps(method)
    def call(module: Module, *more: Any, **kwargs: Any) -> Any:
        return method(module, *args, *more, **{**keywords, **kwargs})
    return call
