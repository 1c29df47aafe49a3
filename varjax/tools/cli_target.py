"""What ``python -m varjax``'s ``FILE:NAME`` names, made into a target the tools take.

The command line has no Python to write ``MLP(features=3)`` in, so it builds what it can and
refuses the rest with a message saying what to write in the file instead:

- a Module class is built with no arguments; one with required fields is refused (a
  ``ModuleError`` asking for an instance or a ``functools.partial`` of the class);
- ``functools.partial(Wide, features=3)`` is that instance, built;
- a function over a module, as ``Module.apply``'s ``method=`` and Flax's ``nn.apply`` take
  one: its first parameter is the module. Annotated with a Module class (``def forward(model:
  MLP, x)``), the class is built as above; ``functools.partial(forward, MLP(features=3))``
  gives the instance itself. Either way the function runs with the module bound, as
  ``MLP().apply(variables, x, method=forward)`` does (called directly, it would be unbound);
- anything else callable (a function using ``vj.*``, a functionalized function, a module
  instance, a partial of either) is taken as ``varjax.tools.target`` takes it.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
import typing
from pathlib import Path
from typing import Any, Callable

from varjax.ir import errors
from varjax.nn.module import Module


def load_target(ref: str) -> Any:
    """``FILE:NAME`` -> the object to inspect (see the module docstring).  A ``ValueError``
    is a usage error (no such file or name); a ``ModuleError`` a module it cannot build."""
    file, sep, name = ref.rpartition(":")
    if not sep or not file or not name:
        raise ValueError(f"expected FILE:NAME, got {ref!r}")
    path = Path(file)
    if not path.is_file():
        raise ValueError(f"no such file: {file}")
    # Like `python FILE`: the file's folder is importable, and the module is registered
    # (dataclasses, hence Modules, look their module up in sys.modules).
    sys.path.insert(0, str(path.resolve().parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    if not hasattr(module, name):
        raise ValueError(f"{file} has no attribute {name!r}")
    target = getattr(module, name)
    if _is_module_class(target) or (isinstance(target, functools.partial)
                                    and _is_module_class(target.func)):
        return build_module(target, ref)
    if not callable(target):
        raise ValueError(f"{ref} is a {type(target).__name__}, not a function or Module")
    owner = module_parameter(target)
    if owner is not None:
        return functools.partial(target, build_module(owner, ref, over=name))
    return target


def build_module(factory: Any, ref: str, over: str | None = None) -> Module:
    """``factory()``: a Module class or a partial of one, refused with a ``ModuleError`` when
    it needs arguments it was not given (``Wide.__init__``'s own ``TypeError`` says which,
    but not what to write instead).  ``over``: the function over the module, if any."""
    cls = factory.func if isinstance(factory, functools.partial) else factory
    missing = [p.name for p in inspect.signature(factory).parameters.values()
               if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        built = f"{cls.__name__}({', '.join(f'{field}=...' for field in missing)})"
        fix = (f"name an instance in the file (model = {built}) and give FILE:model, or a "
               f"functools.partial(...) of the class with those fields" if over is None else
               f"name a partial in the file ({over}_bound = functools.partial({over}, "
               f"{built})) and give FILE:{over}_bound")
        raise errors.ModuleError(
            f"{ref}: the command line builds {cls.__name__} with no arguments, but it has "
            f"required fields: {', '.join(missing)}.", module=cls.__name__,
            source=_defined_at(cls), fix=fix)
    return factory()


def module_parameter(fn: Callable[..., Any]) -> type[Module] | None:
    """The Module class ``fn``'s first parameter is annotated with (``def forward(model: MLP,
    x)``), or None.  A partial that already passed the first argument has none."""
    try:
        first = next(iter(inspect.signature(fn).parameters.values()), None)
    except (TypeError, ValueError):     # a builtin or C callable: no signature to read
        return None
    if first is None or first.kind not in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD):
        return None
    annotation = first.annotation
    if isinstance(annotation, str):     # `from __future__ import annotations`
        try:
            annotation = typing.get_type_hints(fn).get(first.name)
        except (NameError, TypeError):  # a hint that does not resolve names no module
            return None
    return annotation if _is_module_class(annotation) else None


def _is_module_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, Module)


def _defined_at(cls: type) -> str | None:
    """``file:line`` of a class's definition, where its fields are."""
    try:
        return f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):
        return None


def check_call(target: Any, ref: str, args: list[Any], kwargs: dict[str, Any]) -> None:
    """A ``ValueError`` (a usage error) when ``target`` cannot take the ``--shape``
    arguments and ``--kw`` keywords, before tracing turns it into a traceback from inside
    the trace.  A target without a readable signature is left to the call."""
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        given = [f"{len(args)} --shape argument(s)", *(f"--kw {name}" for name in kwargs)]
        raise ValueError(f"{ref} cannot be called with {', '.join(given)}: {e}; its "
                         f"parameters are {signature}") from None
