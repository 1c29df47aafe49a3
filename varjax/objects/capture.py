"""``vj.capture``: run a function or bound module, collecting what it sows or perturbs.

The captured collections are made mutable for the call and their writes are returned
instead of written back, so the module is not modified (Linen's ``mutable=
['intermediates']`` without the state living on).  ``init=`` gives the captured
variables their starting values: a ``perturbations`` state passed this way is an input
of the trace, so ``vj.grad`` with respect to it is the gradient of the intermediates.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from varjax.ir import errors
from varjax.ir.typing import VariableDict
from varjax.objects.nodes import is_node
from varjax.objects.run import arg_names, graph_of, run
from varjax.objects.split_merge import flatten_state
from varjax.trace.variable_dicts import unflatten_variables

_SELF = "self"


def capture(target: Callable[..., Any], *collections: str, init: VariableDict | None = None
            ) -> Callable[..., Any]:
    """``f(*args) -> (out, captured)``: ``target`` (a function, or a bound module, which is
    called) with ``collections`` captured; with only ``init=``, ``f(*args) -> out``.

    ``captured`` is a state (``{collection: {path: value}}``), paths relative to the
    module for a bound module, else prefixed by the argument names of the function."""
    if not collections and init is None:
        raise errors.TransformError(
            "vj.capture needs the collections to capture, or init=.", **errors.where(),
            fix="e.g. vj.capture(model, 'intermediates')")
    given = flatten_state(init, {}) if init is not None else {}
    wanted = tuple(collections) or tuple(sorted({col for col, _ in given}))
    module = is_node(target) and getattr(type(target), "_varjax_module", False)
    fn = _call_module if module else target
    names = (_SELF,) if module else arg_names(target)
    root = (_SELF,) if module else ()

    @functools.wraps(_call_module if module else target)
    def call(*args: Any, **kwargs: Any) -> Any:
        if module:
            args = (target, *args)
        graph = graph_of(args, kwargs, names)
        out, result = run(fn, args, kwargs, names=names, capture=wanted, given=given,
                          capture_root=root, graph=graph)
        graph.write_back(result.updates, result.created)
        if not collections:
            return out
        captured = {k: v for k, v in given.items() if k[0] in collections}
        captured.update(result.captured)
        return out, unflatten_variables(dict(sorted(captured.items())))
    return call


def _call_module(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self(*args, **kwargs)
