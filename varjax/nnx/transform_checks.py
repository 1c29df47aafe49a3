"""What NNX's loops promise about objects, checked where object mode differs, and the
helpers the transforms share.

flax.nnx keeps object identity through a loop: its carry holds the caller's objects after
the loop.  Object mode writes Variable *values* back and returns new objects.  Where that
would be a visible difference, the ``varjax.nnx`` loops either restore the caller's objects
(``as_given``: a loop carry whose objects stay in their places) or refuse the case by name,
while tracing; a trace that raised is not cached, so a refusal holds on every call.  (The
other transforms carry structure and identity with NNX's graph updates, ``graph_updates``.)
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import jax

from varjax.ir import errors
from varjax.ir.caches import LRU
from varjax.nnx.graph import graphdef
from varjax.nnx.graph_updates import is_object
from varjax.nnx.module import Module
from varjax.nnx.pytree import Pytree
from varjax.objects.nodes import is_node
from varjax.trace.unprovided import not_provided


def objects_in(tree: Any) -> list[Any]:
    """Every NNX object and object-mode node (Variable, ``Rngs``) reachable in ``tree``,
    modules before their children, in tree order."""
    found: list[Any] = []

    def walk(t: Any) -> None:
        for x in jax.tree.leaves(t, is_leaf=lambda y: y is not t and is_object(y)):
            if is_object(x):
                found.append(x)
                if isinstance(x, Pytree):
                    walk(x)
    walk([tree])
    return found


def _top_objects(tree: Any) -> list[Any]:
    return [x for x in jax.tree.leaves(tree, is_leaf=is_object) if is_object(x)]


def _structures(tree: Any) -> list[Any]:
    return [graphdef(x) for x in _top_objects(tree) if isinstance(x, Pytree)]


def _structure_unchanged(what: str, before: list[Any], tree: Any) -> None:
    """A ``TransformError`` when a module of ``tree`` gained, lost or changed an attribute
    since ``before`` (``_structures``): a loop carries the same structure from step to step,
    so the change cannot come out of it (flax.nnx refuses it too)."""
    if before != _structures(tree):
        raise errors.TransformError(
            f"nnx.{what}: a module gained, lost or changed an attribute inside the function "
            "(a sow, a new or removed attribute); a loop carries the same structure from "
            "step to step, so the change cannot come out of it (flax.nnx refuses it too).",
            **errors.where(), fix=f"make the change outside nnx.{what}, or return the value "
                                  "as an output")


def refuse_options(what: str, **given: Any) -> None:
    """``NotProvidedError`` for an option of ``nnx.<what>`` given a value other than its
    default (``given``: name -> (value, default))."""
    for name, (value, default) in given.items():
        if value is not default and value != default:
            not_provided(f"nnx.{what}({name}=...)", "this option is not built yet.",
                         f"call nnx.{what} without {name}", by="varjax.nnx")


def as_decorator(f: Any, build: Callable[[Callable], Callable]) -> Any:
    """NNX's transforms are also decorators with options: ``@nnx.jit(static_argnums=1)``."""
    return build if f is None else build(f)


def refuse_bound_method(f: Callable, what: str) -> None:
    """flax.nnx refuses a module's bound method (``nnx.vmap(model.__call__)``): the module
    would be a closure, which no transform tracks.  The same ``ValueError`` here."""
    while isinstance(f, functools.partial):
        f = f.func
    if inspect.ismethod(f) and isinstance(f.__self__, Module):
        raise ValueError(f"nnx.{what} does not support bound methods. Use the decorator form "
                         f"@nnx.{what} or call nnx.{what}(MyClass.method)(instance, ...) "
                         "with the unbound method.")


_CHECKED = LRU()    # (fn, what, check_out) -> fn checked


def checked(fn: Callable, what: str,
            check_out: Callable[[str, Callable, tuple, Any], None]) -> Callable:
    """``fn`` as a loop body: refusing a structural change to its arguments' modules
    (``_structure_unchanged``), and calling ``check_out(what, fn, args, out)`` on what it
    returns (both while tracing); one per ``(fn, what, check_out)``, so the traces of
    ``fn`` are cached across calls."""
    key = (fn, what, check_out)
    found = _CHECKED.get(key)
    if found is None:
        @functools.wraps(fn)
        def found(*args: Any, **kwargs: Any) -> Any:
            before = _structures((args, kwargs))
            out = fn(*args, **kwargs)
            _structure_unchanged(what, before, (args, kwargs))
            check_out(what, fn, args, out)
            return out
        _CHECKED[key] = found
    return found


def same_carry_objects(what: str, fn: Callable, carry: Any, new_carry: Any,
                       moved: Callable[[], None]) -> None:
    """The new carry must hold the objects of ``carry`` in the same places; ``moved()`` is
    called when it holds the same objects in other places (each loop says what that is),
    ``TransformError`` when it holds other objects."""
    old, new = objects_in(carry), objects_in(new_carry)
    if [id(x) for x in old] == [id(x) for x in new]:
        return
    if sorted(map(id, old)) == sorted(map(id, new)):
        moved()
    raise errors.TransformError(
        f"nnx.{what}: {getattr(fn, '__name__', 'the body')} returns a carry whose objects "
        "are not the ones it was given (a new module or Variable, or one left out); the "
        "loop carries the same objects from step to step.", **errors.where(),
        fix="return the carry objects it got, in their places; assign Variable values to "
            "change them")


def as_given(init: Any, final: Any, same: bool = True) -> Any:
    """``final`` with the caller's objects of ``init`` in their places (their Variables
    already hold the final values), as flax.nnx returns a loop's carry with graph updates;
    with ``same=False`` (without them) new objects holding the caller's Variables there, as
    flax.nnx returns it then."""
    objects = iter(_top_objects(init) if same else
                   [x if is_node(x) else jax.tree.map(lambda v: v, x, is_leaf=is_node)
                    for x in _top_objects(init)])
    leaves, tree = jax.tree.flatten(final, is_leaf=is_object)
    return jax.tree.unflatten(tree, [next(objects) if is_object(x) else x for x in leaves])


def positional(f: Callable, args: tuple, kwargs: dict) -> tuple:
    """``args`` and ``kwargs`` as positional arguments of ``f``, defaults included, as
    flax.nnx resolves them before mapping (``in_axes`` then applies to all of them)."""
    if not isinstance(f, functools.partial):
        bound = inspect.signature(f).bind(*args, **kwargs)
        bound.apply_defaults()
        args, kwargs = bound.args, bound.kwargs
    if kwargs:     # a partial's signature is opaque, as in flax.nnx
        raise TypeError("keyword arguments could not be resolved to positions")
    return args
