"""The duck-typed protocols between the IR-core layers and the objects above them.

The tracing core, ``functionalize``, ``lifting`` and the transforms sit below
``varjax.nn``, so they recognise modules by what a module provides, never by
importing its class.  (``vj.Rngs`` needs no protocol: ``varjax.trace.rngs`` sits below
``functionalize``, which imports the class.)  Those contracts used to be implicit
(a ``getattr`` here, a ``hasattr`` there).  This file writes each one down once, as a ``typing.Protocol``: who
implements it, who consumes it, and why it is duck typed.  It sits at IR-core level
and imports only ``varjax.ir.primitives`` (for ``Path``), so any layer may import it.

Member names start with ``_varjax_`` (or ``_``) on purpose: they are hooks between
varjax's layers, not API for users, and must not collide with the names users give
their own module methods and fields.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable, Protocol, runtime_checkable

from varjax.ir.primitives import Path

Body = Callable[..., Any]


@runtime_checkable
class Labelled(Protocol):
    """An object errors can name by scope and class: ``MLP/hidden (Dense)``.

    Implemented by ``varjax.nn.Module`` (``naming.Naming._label``).  Consumed by
    ``varjax.trace.variable_api`` (``where(about=...)``, ``check_type``, and the ``TraceContext.module``
    whose method is running), which put the label in the ``module:`` line of every
    error raised while that module traces, and by ``varjax.nn.binding.Scope.context``.
    The tracing core cannot import ``Module``: it sits below ``varjax.nn``."""

    def _label(self) -> str:
        """The module as errors name it (see ``varjax.ir.errors``)."""
        ...


class LiftableModule(Labelled, Protocol):
    """A module instance that a lifted transform's body may take as its first argument.

    Implemented by ``varjax.nn.Module`` (``lifted.LiftHooks``, the marker on ``core.Module``).
    Consumed by ``varjax.lifting.region``: ``is_module`` tests the class marker
    ``_varjax_module`` (one attribute lookup on the type, so cheap enough for every
    argument of every lifted call, and never triggers a module's lazy setup the way
    looking up a missing attribute on an instance does); then ``Lift.__call__`` binds
    the bodies with ``_varjax_bodies`` and scopes the region's variables under ``path``.
    ``varjax.transforms.calls`` also asks ``is_module`` to skip the module argument.
    Duck typed because lifting sits below ``varjax.nn`` and must not import it.

    Not ``runtime_checkable``: ``path`` raises ``UnboundModuleError`` on an unbound
    module, which ``isinstance`` would let escape; test ``_varjax_module`` instead."""

    _varjax_module: ClassVar[bool]

    @property
    def path(self) -> Path:
        """The module's names from its root: the prefix of the variables its bodies touch."""
        ...

    def _varjax_bodies(self, bodies: tuple[Body, ...]) -> tuple[Body, ...]:
        """``body(self, ...)`` for each body of one lifted call, each re-running the module's
        setup inside the region and restoring the module's state when it ends."""
        ...

    def _varjax_run_eager(self, fn: Callable[..., Any], args: tuple) -> Any:
        """``fn(self, *args)`` for a module made by ``bind``, called from outside any trace
        (a Linen direct-form transform given the bound module): run in the module's bound
        scope, as its own methods are, its updates kept; ``UnboundModuleError`` when it is
        not bound."""
        ...


@runtime_checkable
class LiftableModuleClass(Protocol):
    """A module *class* that a lifted transform can turn into a lifted class
    (``nn.vmap(MLP)`` -> ``VmapMLP``).

    Implemented by ``varjax.nn.Module`` (the classmethod ``lifted.LiftHooks._varjax_lift_class``).
    Consumed by ``varjax.transforms.common`` (the target of a transform that is a class
    with ``_varjax_module``), which hands it the function lifting one method.  Duck typed
    because ``varjax.transforms`` sits below ``varjax.nn``."""

    _varjax_module: bool

    def _varjax_lift_class(self, transform: str, lift_method: Callable[[Body], Body],
                           methods: Iterable[str] | None = None) -> type:
        """A subclass named ``{Transform}{Class}`` whose ``methods`` (default ``__call__``)
        run through ``lift_method``."""
        ...
