"""NNX's transforms in graph mode, on varjax's object-mode transforms.

An NNX module is a pytree of Variables, so each transform here is the object-mode one
(``varjax.objects.object_transforms``) with NNX's signature: inside, every Variable access
is a ``var_get``/``var_set`` of one functionalized trace, and updates reach the caller's
Variables through the discharge signature.  What NNX adds is desugared:

* ``grad``/``value_and_grad`` differentiate the ``nnx.Param``s of a module argument (or
  what a ``DiffState`` filter selects): the module is ``split`` into that state and the
  rest, ``vj.value_and_grad`` differentiates the first and writes updates of the rest back
  (a BatchNorm's statistics), and the gradient is a ``State``, as NNX returns it;
* ``jit`` refuses, with ``NotProvidedError``, a function that changes a module's structure
  (adds or removes an attribute, changes a static one), or returns an argument's module:
  the change would not reach the caller's object, and the module returned would be a new
  one (NNX's graph updates, which carry both, are not built yet; ``transform_checks``).

Options of flax.nnx's signatures that are not built raise ``NotProvidedError`` when given.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

from varjax.ir import errors
from varjax.nnx.graph import merge, split
from varjax.nnx.pytree import Pytree
from varjax.nnx.transform_checks import as_decorator, checked, no_argument_returned, refuse_options
from varjax.nnx.variables import Param
from varjax.objects import object_transforms as objects

__all__ = ["jit", "grad", "value_and_grad", "remat", "DiffState"]


def jit(fun: Callable | None = None, *, in_shardings: Any = None, out_shardings: Any = None,
        static_argnums: int | Sequence[int] | None = None, static_argnames: Any = None,
        donate_argnums: int | Sequence[int] | None = None, donate_argnames: Any = None,
        keep_unused: bool = False, device: Any = None, backend: Any = None,
        inline: bool = False, graph: bool | None = None, graph_updates: bool | None = None
        ) -> Any:
    """``jax.jit`` over NNX objects: Variable updates come back to the caller's objects."""
    refuse_options("jit", in_shardings=(in_shardings, None),
                   out_shardings=(out_shardings, None), static_argnames=(static_argnames, None),
                   donate_argnames=(donate_argnames, None), keep_unused=(keep_unused, False),
                   device=(device, None), backend=(backend, None), inline=(inline, False),
                   graph=(graph, None), graph_updates=(graph_updates, None))

    def build(f: Callable) -> Callable:
        return objects.jit(checked(f, "jit", no_argument_returned),
                           static_argnums=() if static_argnums is None else static_argnums,
                           donate_argnums=() if donate_argnums is None else donate_argnums)
    return as_decorator(fun, build)


@dataclasses.dataclass(frozen=True)
class DiffState:
    """Differentiate argument ``argnum`` with respect to what ``filter`` selects."""

    argnum: int
    filter: Any


def _diff_states(argnums: Any) -> tuple[tuple[DiffState, ...], bool]:
    many = not isinstance(argnums, (int, DiffState))
    items = argnums if many else (argnums,)
    return tuple(a if isinstance(a, DiffState) else DiffState(a, Param) for a in items), many


def value_and_grad(f: Callable | None = None, *, argnums: Any = 0, has_aux: bool = False,
                   holomorphic: bool = False, allow_int: bool = False, reduce_axes: Any = (),
                   graph: bool | None = None, graph_updates: bool | None = None) -> Any:
    """``jax.value_and_grad`` over NNX objects: a module argument's gradient is the ``State``
    of its ``nnx.Param``s (or of a ``DiffState``'s filter); the rest of its Variables keep
    the updates the function made."""
    refuse_options("value_and_grad", holomorphic=(holomorphic, False),
                   allow_int=(allow_int, False), reduce_axes=(reduce_axes, ()),
                   graph=(graph, None), graph_updates=(graph_updates, None))
    diffs, many = _diff_states(argnums)

    def build(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            args = list(args)
            defs, rests = {}, {}
            for d in diffs:
                if d.argnum >= len(args):
                    raise errors.TransformError(
                        f"nnx.grad: argnums names argument {d.argnum}, and the function was "
                        f"given {len(args)}.", **errors.where(), fix="pass that argument")
                if isinstance(args[d.argnum], Pytree):
                    defs[d.argnum], args[d.argnum], rests[d.argnum] = split(
                        args[d.argnum], d.filter, ...)
            order = sorted(rests)

            def inner(*a: Any) -> Any:
                a = list(a)
                rest = dict(zip(order, a[len(args):]))
                full = [merge(defs[i], a[i], rest[i]) if i in defs else a[i]
                        for i in range(len(args))]
                return fn(*full)
            vg = objects.value_and_grad(inner, argnums=tuple(d.argnum for d in diffs)
                                        if many else diffs[0].argnum, has_aux=has_aux)
            return vg(*args, *(rests[i] for i in order))
        return call
    return as_decorator(f, build)


def grad(f: Callable | None = None, *, argnums: Any = 0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False, reduce_axes: Any = (),
         graph: bool | None = None, graph_updates: bool | None = None) -> Any:
    """``value_and_grad`` without the value (with ``has_aux``: ``(grads, aux)``)."""
    def build(fn: Callable) -> Callable:
        vg = value_and_grad(fn, argnums=argnums, has_aux=has_aux, holomorphic=holomorphic,
                            allow_int=allow_int, reduce_axes=reduce_axes, graph=graph,
                            graph_updates=graph_updates)

        @functools.wraps(fn)
        def call(*args: Any) -> Any:
            value, grads = vg(*args)
            return (grads, value[1]) if has_aux else grads
        return call
    return as_decorator(f, build)


def remat(f: Callable | None = None, *, prevent_cse: bool = True,
          static_argnums: int | Sequence[int] = (), policy: Callable | None = None,
          graph: bool | None = None, graph_updates: bool | None = None) -> Any:
    """``jax.checkpoint`` over NNX objects."""
    refuse_options("remat", graph=(graph, None), graph_updates=(graph_updates, None))
    return as_decorator(f, lambda fn: objects.remat(fn, prevent_cse=prevent_cse,
                                                  static_argnums=static_argnums, policy=policy))
