"""The IR of an object-mode call, for the inspection tools (``vj.dump``,
``nnx.make_jaxpr(..., effectful=True)``).

An object-mode step (a function over NNX modules, ``vj.Variable``s, bound modules) runs as
one functionalized trace (``varjax.objects.run``): each Variable read is a ``var_get`` and
each write a ``var_set`` at the Variable's path in the arguments (``params:model/linear/
kernel``), and the pass pipeline discharges them.  A JAX transform of that trace shows only
the pure result (``jax.make_jaxpr``), and tracing the step as raw JAX loses its writes; so
these functions build the trace as the transforms do (``run``, with its ``inspect`` hook)
and, instead of running it, return the traced IR or run its pipeline watched.

``vj.jit``/``nnx.jit`` mark the call they return with the function and passes they trace
(``mark``), so a tool handed the jitted step inspects the IR that the transform runs.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax

from varjax import _jax
from varjax.functionalization.functionalized import Functionalized
from varjax.objects.nodes import is_node
from varjax.objects.run import arg_names, run
from varjax.passes import Pipeline
from varjax.passes.framework.instrument import Instrumentation
from varjax.passes.framework.pipeline import parse_entries

_STEP = "_varjax_object_step"


def mark(call: Callable, fn: Callable, passes: tuple) -> Callable:
    """``call`` (a transform of ``fn``) marked as running ``fn`` under ``passes``."""
    setattr(call, _STEP, (fn, passes))
    return call


def marked_step(target: Any) -> tuple[Callable, tuple] | None:
    """``(fn, passes)`` of a call ``mark`` marked, else None."""
    return getattr(target, _STEP, None)


def holds_objects(tree: Any) -> bool:
    """Whether ``tree`` holds objects (Variables, NNX modules, ``Rngs``, bound modules)."""
    return any(is_node(x) for x in jax.tree.leaves(tree, is_leaf=is_node))


def is_object_call(target: Any, args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Whether ``target(*args, **kwargs)`` is an object-mode step: a marked transform, or a
    call whose arguments hold objects."""
    return marked_step(target) is not None or holds_objects((args, dict(kwargs)))


def called(model: Any, *args: Any, **kwargs: Any) -> Any:
    """``model(*args, **kwargs)``: an object called as a step (``vj.dump(model, x)`` of an NNX
    module), its variables named under ``model``."""
    return model(*args, **kwargs)


def effectful_jaxpr(fn: Callable, args: tuple, kwargs: Mapping[str, Any]) -> _jax.ClosedJaxpr:
    """The IR of ``fn(*args, **kwargs)`` as traced, before any pass: what ``vj.pretty``
    prints with the module paths of its ``var_get``/``var_set``."""
    def traced(functionalized: Functionalized, call: tuple) -> _jax.ClosedJaxpr:
        return functionalized._effectful_jaxpr(*call)
    return _inspect(fn, args, kwargs, (), traced)


def run_pipeline(fn: Callable, args: tuple, kwargs: Mapping[str, Any],
                 passes: Sequence[Any] | str | None,
                 instrumentations: Sequence[Instrumentation]) -> _jax.ClosedJaxpr:
    """The pipeline of ``fn(*args, **kwargs)`` (the default passes, a jitted step's, then
    ``passes``) run on its IR, uncached, with ``instrumentations`` watching (``vj.dump``'s
    ``Recorder``); returns the pure jaxpr.  Nothing runs and nothing is written back."""
    def watched(functionalized: Functionalized, call: tuple) -> _jax.ClosedJaxpr:
        traced = functionalized._effectful(functionalized._key(*call)[0])
        own = functionalized.pipeline
        pipeline = Pipeline(own.passes, verify=own.verify, instrumentations=instrumentations)
        return functionalized._run_pipeline(traced, pipeline)[0]
    return _inspect(fn, args, kwargs, parse_entries(passes), watched)


def _inspect(fn: Callable, args: tuple, kwargs: Mapping[str, Any], passes: tuple,
             inspect: Callable[[Functionalized, tuple], Any]) -> Any:
    found = marked_step(fn)
    if found is not None:
        fn, own = found
        passes = own + passes
    return run(fn, tuple(args), dict(kwargs), names=arg_names(fn), passes=passes,
               inspect=inspect)
