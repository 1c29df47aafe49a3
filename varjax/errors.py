"""Every error varjax raises on purpose.

A varjax error answers four questions in a fixed layout: what happened, which
variable (collection and path), where in the user's code (``file:line``, read
from the equation's source info or the current traceback), and how to fix it.
Catch ``VarjaxError`` to catch them all.

Sharp edges:
  * The source line is the first frame outside JAX and varjax.  Code called
    through a library you wrote yourself points at that library.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

from varjax import _jax

__all__ = [
    "VarjaxError", "ScopeError", "ImmutableCollectionError", "MissingVariableError",
    "MissingRngError", "VariableShapeError", "VariableCreationError",
    "VariableStructureError", "TransformError", "UnsupportedPrimitiveError",
    "PipelineError", "PassError", "VerificationError", "ModuleError", "NameInUseError",
    "AssignSubModuleError", "UnboundModuleError", "InvalidScopeError", "FrozenModuleError",
    "ConfigError",
    "format_path", "source_text",
]


def format_path(path: Sequence[str] | None) -> str:
    return "/".join(str(p) for p in path) if path else "<none>"


_call_site = threading.local()


@contextlib.contextmanager
def call_site(text: str | None) -> Iterator[None]:
    """While tracing and compiling one call, the user's line that made the call: the
    fallback when an equation's own traceback holds no user frame (code traced entirely
    in library frames, e.g. a ``varjax.nn`` layer applied directly)."""
    previous = getattr(_call_site, "text", None)
    _call_site.text = text
    try:
        yield
    finally:
        _call_site.text = previous


def source_text(source_info: _jax.SourceInfo | None = None) -> str:
    """``file:line (function)`` of the user's code; the current frame if not given."""
    if source_info is None:
        found = _jax.user_frame_text(_jax.current_source_info()) or _jax.python_user_frame_text()
    else:
        found = _jax.user_frame_text(source_info) or getattr(_call_site, "text", None)
    return found or "<unknown source>"


class VarjaxError(Exception):
    """Base class. ``collection``, ``path``, ``module`` and ``source`` are also attributes."""

    def __init__(self, what: str, *, collection: str | None = None,
                 path: Sequence[str] | None = None, source: str | None = None,
                 fix: str | None = None, module: str | None = None):
        self.what = what
        self.collection = collection
        self.path = tuple(path) if path is not None else None
        self.module = module
        self.source = source
        self.fix = fix
        lines = [what]
        if collection is not None:
            lines.append(f"  collection: {collection}")
        if path is not None:
            lines.append(f"  variable:   {format_path(path)}")
        if module is not None:
            lines.append(f"  module:     {module}")
        if source is not None:
            lines.append(f"  at:         {source}")
        if fix is not None:
            lines.append(f"  fix:        {fix}")
        super().__init__("\n".join(lines))


class ScopeError(VarjaxError):
    """A variable API was used outside a functionalized function."""


class ImmutableCollectionError(VarjaxError):
    """A variable was written in a collection that is not mutable."""


class MissingVariableError(VarjaxError):
    """A variable was read that neither exists nor can be created here."""


class MissingRngError(VarjaxError):
    """An RNG stream was drawn from that the caller did not provide."""


class VariableShapeError(VarjaxError):
    """A variable's given value does not have the shape/dtype the code expects."""


class VariableCreationError(VarjaxError):
    """A variable is created where its value before creation would be needed
    (inside a loop body, in only some branches of a conditional)."""


class VariableStructureError(VarjaxError):
    """A variable's pytree structure or avals disagree across a loop or branches."""


class TransformError(VarjaxError):
    """A raw JAX transformation was applied to stateful code it cannot handle."""


class UnsupportedPrimitiveError(VarjaxError, NotImplementedError):
    """A higher-order primitive carries variable effects varjax cannot discharge."""


class PipelineError(VarjaxError):
    """A pass pipeline is malformed: unknown pass, bad option, dependency cycle."""


class PassError(VarjaxError):
    """A pass raised; the message names the pass and the passes run before it."""


class VerificationError(VarjaxError):
    """The IR after a pass violates JAX's type rules or varjax's invariants."""


class ModuleError(VarjaxError):
    """A Module was used against its lifecycle (see ``notes/modules.md``)."""


class NameInUseError(ModuleError):
    """Two submodules, or a submodule and a variable, got the same name in one module."""


class AssignSubModuleError(ModuleError):
    """A submodule was constructed outside ``setup`` and outside an ``@compact`` method."""


class UnboundModuleError(ModuleError):
    """A method that needs variables was called on a module that is not bound."""


class InvalidScopeError(ModuleError):
    """A bound module was used after the ``init`` / ``apply`` that bound it ended."""


class FrozenModuleError(ModuleError):
    """An attribute was set on a module outside ``setup``; modules are frozen dataclasses."""


class ConfigError(ModuleError, ValueError):
    """A module's fields and call arguments disagree, e.g. an option given both as a field
    and as a call argument (``nn.merge_param``); also a ``ValueError``, as in Linen."""
