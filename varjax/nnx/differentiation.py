"""NNX's ``jvp``, ``vjp`` and ``custom_vjp`` in graph mode without graph updates, on JAX's.

An NNX module is a pytree of Variables, so JAX differentiates it as it is: ``f`` runs on a
copy of the primals rebuilt around JAX's tracers (new objects, so no tracer reaches the
caller's Variables), a module argument's tangent or cotangent is a module of the same
structure holding them, as flax.nnx returns it, and the Variable values the copy ends with
are handed out of the trace and written to the caller's Variables afterwards (a counter, a
BatchNorm's statistics), as flax.nnx writes them.

flax.nnx 0.12.8 runs ``jvp``/``vjp`` only with ``graph_updates=False`` (its default, graph
mode with graph updates, raises ``NotImplementedError``); so does ``varjax.nnx``, with the
same error.  ``custom_vjp(graph_updates=False)`` is flax.nnx's form closest to JAX's:
``bwd(*nondiff, res, g)`` gets the output's cotangent and returns one cotangent per
differentiated argument, a module's a module of cotangents.  Its default form (``bwd``
getting the inputs' update cotangents as ``State``s), ``updates_g``, ``DiffState`` in
``nondiff_argnums``, ``symbolic_zeros``, tree mode (``graph=False``) and ``reduce_axes`` are
refused by name.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import jax

from varjax.nnx.transform_checks import (
    as_decorator,
    objects_in,
    positional,
    refuse_bound_method,
    refuse_options,
)
from varjax.objects import split_merge
from varjax.trace.unprovided import not_provided

__all__ = ["jvp", "vjp", "custom_vjp"]


def _modes(what: str, graph: bool | None, graph_updates: bool | None) -> None:
    """Our refusal of tree mode, and flax.nnx's of graph updates."""
    if graph is False:
        not_provided(f"nnx.{what}(graph=False)", "tree mode is not built yet.",
                     f"call nnx.{what} with graph_updates=False", by="varjax.nnx")
    if graph_updates is None or graph_updates:
        raise NotImplementedError(f"graph-mode with graph_updates is not supported for "
                                  f"nnx.{what}. Set graph_updates=False.")


def _states(args: tuple) -> list[Any]:
    """The state of each argument holding objects (None for the others)."""
    return [split_merge.state(a) if objects_in(a) else None for a in args]


def _write_back(args: tuple, states: list[Any]) -> None:
    for a, s in zip(args, states):
        if s is not None:
            split_merge.update(a, s)


def _copy(args: tuple) -> tuple:
    """New objects holding the same values: what ``f`` runs on inside a JAX transform, so no
    tracer is left in the caller's Variables."""
    return jax.tree.map(lambda x: x, args)


def _pure(what: str, f: Callable, has_aux: bool) -> Callable:
    """``f`` over copies of its arguments, returning its output and ``(states, aux)``: the
    copies' final Variable values, to be written to the caller's objects."""
    def run(*copies: Any) -> Any:
        out = f(*copies)
        out, aux = out if has_aux else (out, None)
        if objects_in(out):
            not_provided(f"returning an object from nnx.{what}",
                         "its Variables would hold the transform's tracers.",
                         "return arrays", by="varjax.nnx")
        return out, (_states(copies), aux)
    return run


def vjp(f: Callable | None = None, *primals: Any, has_aux: bool = False,
        reduce_axes: Sequence[Any] = (), graph: bool | None = None,
        graph_updates: bool | None = None) -> Any:
    """``jax.vjp`` over NNX objects: ``(out, vjp_fn)`` (``(out, vjp_fn, aux)``), where
    ``vjp_fn(g)`` returns one cotangent per primal, a module's a module of cotangents."""
    _modes("vjp", graph, graph_updates)
    refuse_options("vjp", reduce_axes=(tuple(reduce_axes), ()))
    if f is None:
        return functools.partial(vjp, has_aux=has_aux, graph=graph, graph_updates=graph_updates)
    refuse_bound_method(f, "vjp")
    if not primals:
        return functools.partial(vjp, f, has_aux=has_aux, graph=graph,
                                 graph_updates=graph_updates)
    out, vjp_fn, (states, aux) = jax.vjp(_pure("vjp", f, has_aux), *primals, has_aux=True)
    _write_back(primals, states)
    return (out, vjp_fn, aux) if has_aux else (out, vjp_fn)


def jvp(f: Callable | None = None, primals: tuple | None = None,
        tangents: tuple | None = None, *, has_aux: bool = False, graph: bool | None = None,
        graph_updates: bool | None = None) -> Any:
    """``jax.jvp`` over NNX objects: a module's tangent is a module of tangents;
    ``(out, tangent_out)`` (``(out, tangent_out, aux)``)."""
    _modes("jvp", graph, graph_updates)
    if f is None:
        return functools.partial(jvp, has_aux=has_aux, graph=graph, graph_updates=graph_updates)
    refuse_bound_method(f, "jvp")
    if primals is None:
        return functools.partial(jvp, f, has_aux=has_aux, graph=graph,
                                 graph_updates=graph_updates)
    out, tangent, (states, aux) = jax.jvp(_pure("jvp", f, has_aux), tuple(primals),
                                          tuple(tangents), has_aux=True)
    _write_back(primals, states)
    return (out, tangent, aux) if has_aux else (out, tangent)


class CustomVjp:
    """``jax.custom_vjp`` over NNX objects (flax.nnx's ``graph_updates=False`` form): the
    Variable updates ``fun`` (or ``fwd``) makes are written back to the caller's objects,
    and ``fwd``'s residuals may hold its (copied) modules."""

    def __init__(self, fun: Callable, nondiff_argnums: tuple[int, ...]):
        functools.update_wrapper(self, fun)
        self.fun, self.nondiff_argnums = fun, nondiff_argnums
        self.custom = jax.custom_vjp(self._primal, nondiff_argnums=nondiff_argnums)

    def _primal(self, *args: Any) -> Any:
        return _pure("custom_vjp", self.fun, False)(*_copy(args))

    def defvjp(self, fwd: Callable, bwd: Callable, symbolic_zeros: bool = False) -> None:
        refuse_options("custom_vjp.defvjp", symbolic_zeros=(symbolic_zeros, False))
        if "updates_g" in inspect.signature(bwd).parameters:
            not_provided("a nnx.custom_vjp bwd taking updates_g",
                         "the cotangents of the Variable updates are not handed to bwd yet.",
                         "leave updates_g out of bwd's signature", by="varjax.nnx")
        n = len(self.nondiff_argnums)

        def forward(*args: Any) -> Any:
            residual = []

            def fwd_out(*a: Any) -> Any:
                out, res = fwd(*a)
                residual.append(res)
                return out
            return _pure("custom_vjp", fwd_out, False)(*_copy(args)), residual[0]

        def backward(*args: Any) -> Any:
            nondiff, residual, (g, _) = args[:n], args[n], args[n + 1]
            return tuple(bwd(*_copy(nondiff), residual, g))
        self.custom.defvjp(forward, backward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = positional(self.fun, args, kwargs)
        out, (states, _) = self.custom(*args)
        _write_back(args, states)
        return out


def custom_vjp(fun: Callable | None = None, *, nondiff_argnums: tuple[Any, ...] = (),
                graph: bool | None = None, graph_updates: bool | None = None) -> Any:
    """flax.nnx's ``custom_vjp`` (see ``CustomVjp``); a decorator with options too."""
    if graph is False:
        not_provided("nnx.custom_vjp(graph=False)", "tree mode is not built yet.",
                     "call nnx.custom_vjp with graph_updates=False", by="varjax.nnx")
    if graph_updates is None or graph_updates:
        not_provided("nnx.custom_vjp with graph updates (its default)",
                     "a bwd receiving (input_updates_g, out_g), with State cotangents for "
                     "module arguments, is not built yet.",
                     "pass graph_updates=False: bwd(res, g) gets the output's cotangent and "
                     "returns a module of cotangents for a module", by="varjax.nnx")
    for a in nondiff_argnums:
        if not isinstance(a, int):
            not_provided(f"nnx.custom_vjp(nondiff_argnums=({type(a).__name__}(...),))",
                         "only argument numbers are built (flax.nnx takes no DiffState there "
                         "with graph_updates=False either).", "give ints", by="varjax.nnx")
    return as_decorator(fun, lambda f: CustomVjp(f, tuple(nondiff_argnums)))
