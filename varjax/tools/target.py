"""What the inspection tools accept as "the code to look at", as one ``Functionalized``.

``vj.dump``, ``vj.dataflow``, the summary and the command line all take either a
``vj.functionalize``-d function, a plain function using ``vj.param`` & co., a
``Module`` (its ``__call__``), or a bound method of a module (``model.encode``).
"""
from __future__ import annotations

from typing import Any

from varjax.functionalize import Functionalized, functionalize
from varjax.nn.module import Module


def as_functionalized(target: Any) -> Functionalized:
    """The ``Functionalized`` behind ``target`` (see the module docstring)."""
    if isinstance(target, Functionalized):
        return target
    if isinstance(target, type) and issubclass(target, Module):
        raise TypeError(f"{target.__name__} is a Module class: pass an instance, "
                        f"e.g. {target.__name__}(...)")
    if isinstance(target, Module):
        return target.functionalize()
    owner = getattr(target, "__self__", None)
    if isinstance(owner, Module):
        return owner.functionalize(target.__func__)
    if callable(target):
        return functionalize(target)
    raise TypeError(f"cannot inspect a {type(target).__name__}: pass a function, a Module, "
                    "or a method of a Module")
