"""NNX's helpers over a module tree that flax.nnx keeps beside ``Module``: ``view``,
``view_info``, ``with_attributes``, ``iter_module_children``, ``set_metadata``,
``display``, ``tabulate``.

``view`` and ``with_attributes`` return a *new* tree of NNX objects over the *same*
Variables, Rngs and arrays (flax.nnx's ``recursive_map`` over a structural clone): the
copy's static attributes (``deterministic``, ``use_running_average``) can be set without
touching the original, while training the copy trains the original's parameters.  An
object reached at two paths is copied once, so sharing is kept in the copy.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Hashable, Iterator, TypeVar

from varjax.ir import errors
from varjax.ir.typing import Filter, Node
from varjax.nnx.filterlib import to_predicate
from varjax.nnx.graph import state
from varjax.nnx.module import Module
from varjax.nnx.pytree import Dict, List, Pytree, children, flatten_node, is_node
from varjax.nnx.variablelib import Variable
from varjax.trace.rngs import Rngs, RngStream
from varjax.trace.unprovided import not_provided

__all__ = ["M", "view", "view_info", "with_attributes", "iter_module_children",
           "set_metadata", "display", "tabulate"]

M = TypeVar("M", bound=Module)
A = TypeVar("A")
Path = tuple[Any, ...]


def _kept(x: Any) -> bool:
    """What a copy holds as it is: Variables, RNG state (its counts stay shared), arrays
    and other leaves.  NNX objects and containers are copied."""
    return not is_node(x) or isinstance(x, (Rngs, RngStream))


def _map_copy(f: Callable[[Path, Any], Any], node: Any) -> Any:
    """A copy of ``node``'s objects and containers over the same leaves, ``f(path, copy)``
    applied to each copied NNX object after its children (flax.nnx's order)."""
    copies: dict[int, Any] = {}

    def copy(x: Any, path: Path) -> Any:
        if _kept(x):
            return x
        if id(x) in copies:
            return copies[id(x)]
        pairs, treedef = flatten_node(x)
        new = treedef.unflatten([copy(child, (*path, k)) for k, child in pairs])
        if isinstance(x, Pytree):
            new = f(path, new)
        copies[id(x)] = new
        return new
    return copy(node, ())


def view(node: A, /, *, only: Filter = ..., raise_if_not_found: bool = True,
         graph: bool | None = None, **kwargs: Any) -> A:
    """A copy of ``node`` (same Variables) in which every module the filter ``only``
    selects that has a ``set_view`` method was given the ``kwargs`` its ``set_view``
    takes: ``nnx.view(model, deterministic=True)``.  A keyword no ``set_view`` takes is
    an error unless ``raise_if_not_found=False``.  ``graph`` is accepted for flax.nnx's
    signature: both modes copy the same tree here."""
    predicate, unused = to_predicate(only), set(kwargs)

    def apply(path: Path, module: Any) -> Any:
        if hasattr(module, "set_view") and predicate(path, module):
            params = inspect.signature(module.set_view).parameters.values()
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
                module.set_view(**kwargs)
                unused.clear()
            else:
                names = {p.name for p in params if p.kind in (
                    inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
                module.set_view(**{k: v for k, v in kwargs.items() if k in names})
                unused.difference_update(names)
        return module

    out = _map_copy(apply, node)
    if unused and raise_if_not_found:
        raise errors.ConfigError(
            f"nnx.view: no set_view of a module under {type(node).__name__} takes "
            f"{', '.join(sorted(unused))}.", **errors.where(),
            fix="print(nnx.view_info(model)) lists what each module's set_view takes; pass "
                "raise_if_not_found=False to skip the others")
    return out


def with_attributes(node: A, /, *, only: Filter = ..., raise_if_not_found: bool = True,
                    graph: bool | None = None, **attributes: Any) -> A:
    """A copy of ``node`` (same Variables) with ``attributes`` set on every module the
    filter ``only`` selects that has them; the original is unchanged (``set_attributes``
    changes it in place).  An attribute no module has is an error unless
    ``raise_if_not_found=False``.  ``graph`` is accepted for flax.nnx's signature."""
    predicate, unused = to_predicate(only), set(attributes)

    def apply(path: Path, module: Any) -> Any:
        if isinstance(module, Module) and predicate(path, module):
            for name, value in attributes.items():
                if hasattr(module, name):
                    setattr(module, name, value)
                    unused.discard(name)
        return module

    out = _map_copy(apply, node)
    if unused and raise_if_not_found:
        raise errors.ConfigError(
            f"nnx.with_attributes: no module under {type(node).__name__} has the "
            f"attribute(s) {', '.join(sorted(unused))}.", **errors.where(),
            fix="pass raise_if_not_found=False to skip them")
    return out


def _arg_docs(doc: str) -> dict[str, str]:
    """The descriptions of a Google-style docstring's ``Args:`` (an argument at two
    spaces, its continuation lines deeper), each as flax.nnx's ``view_info`` prints it."""
    if "Args:\n" not in doc:
        return {}
    section = doc.split("Args:\n", 1)[1].split("Returns:\n", 1)[0]
    lines: dict[str, list[str]] = {}
    name = None
    for line in section.split("\n"):
        if line.startswith("  ") and not line.startswith("    "):
            name, _, first = line.partition(":")
            name = name.strip()
            lines[name] = ["    " + first.strip()]
        elif name is not None:
            lines[name].append(line)
    return {k: "\n".join(v) for k, v in lines.items()}


def view_info(node: Module, /, *, only: Filter = ..., graph: bool | None = None) -> str:
    """What ``view`` can set under ``node``: for each class with a ``set_view`` (by
    qualified name), its arguments with their annotations, defaults and the descriptions
    from its docstring's ``Args:``, in flax.nnx's text layout."""
    predicate, classes = to_predicate(only), set()

    def collect(path: Path, module: Any) -> Any:
        if hasattr(module, "set_view") and predicate(path, module):
            classes.add(type(module))
        return module
    _map_copy(collect, node)

    out: list[str] = []
    for cls in sorted(classes, key=lambda c: c.__qualname__):
        out.append(f"{cls.__qualname__}:")
        sig, doc = inspect.signature(cls.set_view), inspect.getdoc(cls.set_view)
        if not isinstance(doc, str):
            out.append(f"  set_view{sig}")
            continue
        docs = _arg_docs(doc)
        for name, param in sig.parameters.items():
            if name in ("self", "args", "kwargs"):
                continue
            default = "" if param.default is inspect.Parameter.empty else f" = {param.default}"
            out.append(f"  {name}: {param.annotation}{default}")
            if name in docs:
                out.append(docs[name])
    return "\n".join(out)


def iter_module_children(node: Node, /, *, graph: bool | None = None
                         ) -> Iterator[tuple[Hashable, Module | List | Dict]]:
    """The modules directly under ``node`` (an NNX object or a container), with their
    attribute names or keys.  An ``nnx.List``/``nnx.Dict`` child is listed itself, as
    flax.nnx lists its (module) containers; ``graph`` is accepted for its signature."""
    if not is_node(node):
        raise errors.ConfigError(
            f"iter_module_children: expected an NNX object or a container, got a "
            f"{type(node).__name__}.", **errors.where(), fix="pass a module")
    for key, child in children(node):
        if isinstance(child, (Module, List, Dict)):
            yield key, child


def set_metadata(node: Node, /, *, only: Filter = Variable, **metadata: Any) -> None:
    """Sets ``metadata`` on every NNX Variable of ``node`` the filter ``only`` selects,
    in place: ``nnx.set_metadata(model, only=nnx.Param, differentiable=False)``."""
    for leaf in state(node, only).flat().values():
        if isinstance(leaf, Variable):
            leaf.set_metadata(**metadata)


def display(*args: Any) -> None:
    """Prints each object, as flax.nnx's ``display`` does outside a notebook (in one it
    renders with ``treescope``, which varjax does not depend on)."""
    for x in args:
        print(x)


def tabulate(*args: Any, **kwargs: Any) -> str:
    """Not provided: flax.nnx draws its table with ``rich`` and ``yaml``, which varjax
    does not depend on."""
    not_provided("nnx.tabulate", "flax.nnx draws its summary table with the rich and yaml "
                 "packages, which varjax does not depend on.",
                 "print the model (nnx.display), or jax.tree.map(jnp.shape, nnx.state(model)) "
                 "for the parameter shapes", by="varjax.nnx")
