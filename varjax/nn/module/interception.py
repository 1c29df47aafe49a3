"""Interceptors (Linen's ``nn.intercept_methods``) and the named-call switch.

An interceptor sees every wrapped method call of every module (``setup`` included) while
its ``with`` block is active, as ``interceptor(next_fun, args, kwargs, context)``, and
decides what the call returns: it may change the arguments, the result, or call
``next_fun`` not at all.  Interceptors nest; the innermost ``with`` runs first.

varjax traces module calls and caches the traces, and a cached trace runs no Python: the
interceptors active when a module is applied are therefore part of its trace-cache key
(``cache_key``), as is the named-call switch.  A stateful interceptor (one that logs calls)
sees a call once per trace, not once per ``apply``.

Named calls: every wrapped method runs inside ``jax.named_scope(<module name>)``, so the
module path shows in the jaxpr's name stacks, in XLA's ``op_name`` metadata and in the
``module:`` line of errors found by a pass.  ``disable_named_call`` turns the scopes off
(Linen's profiling switch); those errors then name no module.

Sharp edges:
  * Like Linen's, the interceptor stack and the named-call switch are process-wide and the
    stack is per thread.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator, Protocol

import jax


@dataclasses.dataclass(frozen=True)
class InterceptorContext:
    """What an interceptor is told about the call: the module (bound), the method's name,
    and the method itself (unbound, as defined on the class)."""

    module: Any
    method_name: str
    orig_method: Callable[..., Any]


class Interceptor(Protocol):
    def __call__(self, next_fun: Callable[..., Any], args: tuple, kwargs: dict,
                 context: InterceptorContext) -> Any: ...


_local = threading.local()


def active_interceptors() -> tuple[Interceptor, ...]:
    """The interceptors of the ``intercept_methods`` blocks open in this thread, outermost
    first."""
    return getattr(_local, "stack", ())


@contextlib.contextmanager
def intercept_methods(interceptor: Interceptor) -> Iterator[None]:
    """Within the block, every wrapped module method call goes through ``interceptor``."""
    previous = active_interceptors()
    _local.stack = previous + (interceptor,)
    try:
        yield
    finally:
        _local.stack = previous


def run_intercepted(method: Callable[..., Any], module: Any, args: tuple, kwargs: dict) -> Any:
    """``method(module, *args, **kwargs)`` through the active interceptors, innermost first."""
    stack = active_interceptors()
    if not stack:
        return method(module, *args, **kwargs)
    context = InterceptorContext(module, method.__name__, method)

    def call(depth: int, *a: Any, **k: Any) -> Any:
        if depth < 0:
            return method(module, *a, **k)
        return stack[depth](lambda *a2, **k2: call(depth - 1, *a2, **k2), a, k, context)
    return call(len(stack) - 1, *args, **kwargs)


_named_calls = [True]


def named_calls() -> bool:
    """Whether wrapped method calls open a ``jax.named_scope`` (on by default)."""
    return _named_calls[0]


def enable_named_call() -> None:
    """Module method calls run inside ``jax.named_scope(<module name>)`` (the default)."""
    _named_calls[0] = True


def disable_named_call() -> None:
    """Module method calls open no named scope: jaxprs and XLA metadata lose module paths."""
    _named_calls[0] = False


@contextlib.contextmanager
def override_named_call(enable: bool = True) -> Iterator[None]:
    """Named scopes on (or off) within the block, then back to what they were."""
    previous = _named_calls[0]
    _named_calls[0] = enable
    try:
        yield
    finally:
        _named_calls[0] = previous


def scope(label: str) -> contextlib.AbstractContextManager:
    """The named scope of one module call, or none when named calls are off."""
    return jax.named_scope(label) if _named_calls[0] else contextlib.nullcontext()


def cache_key() -> tuple:
    """What a module trace depends on beyond its arguments: the interceptors and the switch."""
    return (active_interceptors(), _named_calls[0])
