"""NNX's compile-side transforms: ``jit_partial``, ``cached_partial``, ``make_jaxpr``,
``checkify``, on varjax's object-mode transforms.

A train step is called again and again on the same model and optimizer.  flax.nnx makes
that cheap by flattening the fixed objects once (``jit_partial``, tree mode) or by caching
their graph traversal (``cached_partial``, graph mode).  varjax's object-mode ``jit``
already keeps the argument graph of its last calls on the same objects
(``varjax.objects.graph.ArgumentGraphs``) and calls a ``jax.jit`` of their pytree
children, so both are a binding of the objects in front of ``nnx.jit``: what they add is
flax.nnx's contract (which modes each accepts; objects only among the bound arguments).

``make_jaxpr`` and ``checkify`` run the function as one functionalized trace (its Variable
reads and writes are ``var_get``/``var_set``, discharged by the pass pipeline) inside
``jax.make_jaxpr``/``checkify.checkify``.  ``make_jaxpr`` returns the pure jaxpr from the
Variables' values and the arguments to the outputs, as flax.nnx's does, and
``vj.pretty`` prints it; ``checkify`` writes the updates back and returns ``(error, out)``.
``make_jaxpr(f, effectful=True)`` (beyond flax.nnx) returns instead the trace before the
passes (``varjax.objects.inspection``): each Variable read and write a ``var_get``/``var_set``
at its module path, what ``vj.pretty`` shows of a step's effects (``vj.dump`` shows it and the
IR after each pass).
"""
from __future__ import annotations

import functools
import inspect
from typing import AbstractSet, Any, Callable, Sequence

import jax
from jax.experimental import checkify as checkify_lib

from varjax.ir import errors
from varjax.ir.typing import ShardingLike
from varjax.nnx.config import resolve
from varjax.nnx.graph_updates import carrying, finish
from varjax.nnx.jit_shardings import partial_prefix, refuse_state_shardings, static_positions
from varjax.nnx.transform_checks import as_decorator, objects_in, refuse_bound_method
from varjax.objects import inspection
from varjax.objects import object_transforms as objects
from varjax.objects.nodes import is_node
from varjax.objects.run import arg_names

__all__ = ["jit_partial", "cached_partial", "make_jaxpr", "checkify"]


def _no_objects_after(bound: int, what: str, fn: Callable, args: tuple) -> None:
    """An NNX object or Variable among the arguments after the first ``bound`` is refused:
    ``jit_partial`` keeps Variables only in the arguments bound to it, as flax.nnx does.
    Runs while tracing, so a call costs nothing."""
    for i, arg in enumerate(args[bound:], start=bound):
        found = objects_in(arg)
        if found:
            raise errors.ConfigError(
                f"nnx.{what}: argument {i} of {getattr(fn, '__name__', 'the function')} "
                f"holds a {type(found[0]).__name__}; only the arguments bound to {what} "
                "may hold NNX objects or Variables.", **errors.where(),
                fix=f"bind it: nnx.{what}(f, *objects), and pass arrays at the call")


def _partial_positions(fun: Callable, bound: int, n: int, argnums: int | Sequence[int] | None,
                       argnames: str | Sequence[str] | None,
                       static: bool) -> tuple[bool, tuple[int, ...], tuple[str, ...]]:
    """``jit_partial``'s ``argnums``/``argnames`` (position 0 the bound arguments, as one;
    ``k`` the call's argument ``k - 1``; names ``fun``'s parameters) as object mode's ``jit``
    takes them, whose positions are the ``n`` nodes of the bound arguments, then the call's:
    ``(whether they name the bound arguments, the call's positions, the call's names)``.
    Each of positions and names is completed from the other by ``fun``'s signature
    (``static_positions``), as ``jax.jit`` completes them.  ``static``: naming the bound
    arguments is a ``ConfigError`` (they are traced)."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums or ())
    own = tuple(i if i < 0 else bound + i - 1 for i in nums if i != 0)
    own, names = static_positions(fun, own, argnames)
    bound_names = _bound_names(fun, bound)
    names_bound = 0 in nums or any(0 <= i < bound for i in own) or bool(set(names) & bound_names)
    if names_bound and static:
        raise errors.ConfigError(
            "nnx.jit_partial: static_argnums 0 (or a bound parameter's name in "
            "static_argnames) names the bound arguments, which are traced.", **errors.where(),
            fix="give the positions of the call's own arguments, from 1, or their names")
    return (names_bound, tuple(i if i < 0 else n + i - bound for i in own if not 0 <= i < bound),
            tuple(name for name in names if name not in bound_names))


def _bound_names(fun: Callable, bound: int) -> set[str]:
    """The names of ``fun``'s first ``bound`` parameters, which the bound arguments fill."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return set()
    return {p.name for p in params[:bound] if p.kind != p.VAR_POSITIONAL}


def jit_partial(fun: Callable, *partial_args: Any, in_shardings: ShardingLike = None,
                out_shardings: ShardingLike = None,
                static_argnums: int | Sequence[int] | None = None,
                static_argnames: str | Sequence[str] | None = None,
                donate_argnums: int | Sequence[int] | None = None,
                donate_argnames: str | Sequence[str] | None = None, keep_unused: bool = False,
                device: jax.Device | None = None, backend: str | None = None,
                inline: bool = False, graph: bool | None = None,
                graph_updates: bool | None = None) -> Callable:
    """``nnx.jit(fun)`` with ``partial_args`` bound in front: ``jit_partial(step, model,
    optimizer)(x, y)``.  Updates to the bound objects' Variables come back to them.

    The bound objects are flattened once, here, to their Variables (and ``Rngs``), which
    are passed to the object-mode ``jit`` one by one: a call of nodes and arrays is the
    one whose graph that ``jit`` keeps, so each call skips walking the objects.  Their
    structure is fixed here, as in flax.nnx.

    As in flax.nnx, graph updates are refused (pass ``graph_updates=False`` or
    ``graph=False``), the call's own arguments may not hold NNX objects, and the bound
    arguments are one argument to ``jax.jit``, at position 0 (so ``1`` is the call's first
    argument): ``static_argnums`` may not name them; ``donate_argnums=0`` (or a bound
    parameter's name in ``donate_argnames``) donates every Variable of every bound
    argument, each given back written or not.  ``in_shardings`` as a tuple gives each
    bound argument an entry (a Sharding, None, or a tree of its structure such as
    ``nnx.get_named_sharding(model, mesh)``), then each of the call's; a bound Variable's
    update comes back with its entry's sharding.  A ``StateSharding`` is refused, as in
    flax.nnx.  ``out_shardings``, ``keep_unused``, ``device``, ``backend`` and ``inline``
    are ``jax.jit``'s (flax.nnx 0.12.8 refuses ``device``/``backend``: it always passes
    ``out_shardings`` with them; ``nnx.jit`` here takes them, and so does this)."""
    modes = resolve(graph, graph_updates)
    if modes[1]:
        raise errors.ConfigError(
            "nnx.jit_partial does not carry graph updates (structural changes inside the "
            "function); it needs graph_updates=False, or tree mode (graph=False).",
            **errors.where(), fix="pass graph_updates=False (as flax.nnx asks)")
    refuse_state_shardings("jit_partial", in_shardings=in_shardings,
                           out_shardings=out_shardings)
    refuse_bound_method(fun, "jit_partial")
    bound = len(partial_args)
    leaves, treedef = jax.tree.flatten(partial_args, is_leaf=is_node)
    n = len(leaves)
    _, statics, static_names = _partial_positions(fun, bound, n, static_argnums,
                                                  static_argnames, static=True)
    all_bound, donated, donated_names = _partial_positions(fun, bound, n, donate_argnums,
                                                           donate_argnames, static=False)
    carried = carrying(fun, "jit_partial", *modes)

    def flat(*args: Any, **kwargs: Any) -> Any:
        args = (*jax.tree.unflatten(treedef, args[:n]), *args[n:])
        _no_objects_after(bound, "jit_partial", fun, args)
        return carried(*args, **kwargs)[0]
    flat.__name__ = getattr(fun, "__name__", "fn")   # not its signature: JAX reads that
    sharded = in_shardings is not None or out_shardings is not None
    jitted = objects.jit(
        flat, static_argnums=statics, static_argnames=static_names,
        donate_argnums=(tuple(range(n)) if all_bound else ()) + donated, donate_argnames=donated_names,
        in_shardings=partial_prefix(in_shardings, partial_args, statics) if sharded else None,
        out_shardings=out_shardings, keep_unused=keep_unused, device=device, backend=backend,
        inline=inline)

    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> Any:
        return jitted(*leaves, *args, **kwargs)
    return call


def cached_partial(f: Callable, *cached_args: Any, graph: bool | None = None,
                   graph_updates: bool | None = None) -> Callable:
    """``f`` (an ``nnx`` transform of a function) with ``cached_args`` bound in front.

    flax.nnx caches the traversal of the bound objects' graph here; varjax's object-mode
    transforms keep the graph of the objects of their last calls themselves
    (``ArgumentGraphs``), so a repeated call on the bound objects already skips the walk.
    As in flax.nnx, this is graph mode with graph updates only."""
    if resolve(graph, graph_updates) != (True, True):
        raise errors.ConfigError(
            "nnx.cached_partial is graph mode with graph updates only.", **errors.where(),
            fix="call it with graph=True and graph_updates=True (the defaults), or use "
                "nnx.jit_partial in tree mode")

    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        return f(*cached_args, *args, **kwargs)
    return call


def _pure_call(fn: Callable, args: tuple, kwargs: dict, pure: Any,
               make: Callable[[Callable], Callable]) -> tuple[Any, Any]:
    """``make(pure)`` of ``fn``'s functionalized trace for this call's objects, called:
    ``(its output, the graph to write the updates back into)``."""
    graph = pure.originals(args, kwargs)
    return pure.get(graph, make)(*args, **kwargs), graph


def make_jaxpr(f: Callable | None = None, *, graph: bool | None = None,
               graph_updates: bool | None = None,
               static_argnums: int | Sequence[int] = (),
               effectful: bool = False) -> Callable[..., Any]:
    """``jax.make_jaxpr`` over NNX objects: the pure jaxpr of ``f``'s call, from its
    arguments' leaves (Variable values in flax.nnx's order) to its outputs; Variable updates
    are not kept, as in flax.nnx.  Only without graph updates, as in flax.nnx.

    ``effectful=True`` (beyond flax.nnx): the IR of the call before the passes, its
    Variable reads and writes ``var_get``/``var_set`` at their paths in the arguments
    (``params:model/linear/kernel``); an update is a ``var_set`` there, so this is the IR
    in every mode, and non-array arguments are static in it without ``static_argnums``."""
    if effectful:
        if static_argnums != ():
            raise errors.ConfigError(
                "nnx.make_jaxpr(effectful=True) takes no static_argnums: the effectful IR "
                "keeps every non-array argument static.", **errors.where(),
                fix="leave static_argnums out")
        return as_decorator(f, _effectful)
    modes = resolve(graph, graph_updates)
    if modes[1]:
        raise errors.ConfigError(
            "nnx.make_jaxpr does not carry graph updates; it needs graph_updates=False.",
            **errors.where(), fix="pass graph_updates=False (as flax.nnx asks)")

    def build(fn: Callable) -> Callable:
        refuse_bound_method(fn, "make_jaxpr")
        pure = objects._Pure(carrying(fn, "make_jaxpr", *modes), arg_names(fn))

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            def outputs(p: Callable) -> Callable:
                return jax.make_jaxpr(lambda *a, **k: p(*a, **k)[0][0],
                                      static_argnums=static_argnums)
            jaxpr, _ = _pure_call(fn, args, kwargs, pure, outputs)
            return jaxpr
        return objects.wrapper(fn, call)
    return as_decorator(f, build)


def _effectful(fn: Callable) -> Callable:
    """``make_jaxpr(fn, effectful=True)``: the traced IR of each call (nothing runs)."""
    refuse_bound_method(fn, "make_jaxpr")

    def call(*args: Any, **kwargs: Any) -> Any:
        return inspection.effectful_jaxpr(fn, args, kwargs)
    return objects.wrapper(fn, call)


def checkify(f: Callable, errors: AbstractSet[type] = checkify_lib.user_checks, graph: bool | None = None,
             graph_updates: bool | None = None) -> Callable:
    """``checkify.checkify`` over NNX objects: ``(error, out)``, Variable updates written
    back to the caller's objects; with graph updates (the default) an argument's object
    returned is the caller's own and a structural change reaches the caller's object, as in
    ``nnx.jit`` (``graph_updates``); without them those are refused."""
    refuse_bound_method(f, "checkify")
    pure = objects._Pure(carrying(f, "checkify", *resolve(graph, graph_updates)), arg_names(f))
    checks = errors

    def call(*args: Any) -> Any:
        (error, ((out, changes), result)), graph_ = _pure_call(
            f, args, {}, pure, lambda p: checkify_lib.checkify(p, errors=checks))
        graph_.write_back(result.updates, result.created)
        return error, finish(args, {}, out, changes)
    return objects.wrapper(f, call)
