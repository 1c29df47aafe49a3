"""``summary``: the variables of a model, per module and collection, read from the IR.

``vj``'s entry point to the IR summary of ``varjax.nn.module.ir_summary`` (which says how it is
computed: two abstract traces, no computation), for anything the inspection tools accept:
a Module, a method of one, or a function using ``vj.param`` & co.  ``Module.tabulate`` is
Linen's table over the same summary.
"""
from __future__ import annotations

from typing import Any

from varjax.functionalization.functionalized import function_name
from varjax.nn.module import Module
from varjax.nn.module.ir_summary import Row, Summary, Totals, format_bytes, summarize
from varjax.tools.target import as_functionalized

__all__ = ["Row", "Summary", "Totals", "format_bytes", "summary"]


def summary(target: Any, *args: Any, rngs: Any = None, **kwargs: Any) -> Summary:
    """Summarize the variables of ``target`` (a Module, a method of one, or a function using
    ``vj.param`` & co.) when called with ``args``/``kwargs``; ``rngs`` go to ``init``
    (default ``jax.random.key(0)``) and to the traced call."""
    name = type(target).__name__ if isinstance(target, Module) else function_name(target)
    return summarize(as_functionalized(target), name, *args, rngs=rngs, **kwargs)
