"""Every error varjax raises on purpose.

A varjax error answers four questions in a fixed layout: what happened, which
variable (collection and path), where in the user's code (the module and
``file:line``), and how to fix it.  Catch ``VarjaxError`` to catch them all::

    <what happened>
      collection: params                  the collection (or RNG stream)
      variable:   hidden/kernel           the full variable path
      module:     MLP/hidden (Dense)      where in the module tree, see below
      at:         train.py:12 (MLP.__call__)
      fix:        <one sentence>

A line is left out where its field does not apply (a malformed pipeline string
has no variable; a plain function has no module); it is never made up.

The ``module`` field is the module's *scope*, the form JAX's name stack gives it:
the root module's class, then the names of the submodules down to it, joined by
``/`` (``MLP/hidden``), as in ``jaxpr.pretty_print(name_stack=True)``.

  * Raised while tracing (``varjax.trace.variable_api``, the layers, Module lifecycle errors):
    the scope of the module whose method was running, then its class in
    parentheses: ``MLP/hidden (Dense)``.  The root is just its class, ``MLP``; a
    module that is not bound is ``Dense (unbound)``.  This is ``Module._label()``.
  * Raised by a pass after tracing: the equation's name stack, via ``where``;
    the class is not recorded there, so it reads ``MLP/hidden``.  A method other
    than ``__call__`` shows as ``MLP.encode/Dense_0``, and a ``jax.named_scope``
    entered inside a module shows too (``MLP/block/hidden``).
  * ``module`` is None in code that no module method runs (a ``vj.functionalize``
    function): a name stack counts as a module's only from the first entry that
    names a ``varjax.nn.Module`` subclass, so a user's ``jax.named_scope`` in a
    plain function is not reported as a module.

Use ``where(eqn.source_info)`` for ``source=`` and ``module=`` at every raise site
that has an equation, and ``where()`` (or ``context.site()``, which adds the
running module) while tracing.

Tracebacks.  A ``VarjaxError`` that leaves a public entry point (``init``,
``apply``, ``jaxpr``, ... of ``vj.functionalize`` and of ``varjax.nn`` modules;
see ``api_boundary``) has varjax's own frames (``varjax/``, ``passes/``) removed
from its traceback, as JAX removes its frames: what is left is the user's code
and the innermost frame, the line that raised it.  A note on the exception says
so.  ``VARJAX_TRACEBACK_FILTERING=off`` keeps every frame (read when an error
is raised, so it can be set at any time); JAX's own filtering is
``JAX_TRACEBACK_FILTERING``.  Only varjax errors are filtered: any other
exception (a bug, an error in user code) keeps its whole traceback.

Sharp edges:
  * The source line is the first frame outside JAX and varjax.  Code called
    through a library you wrote yourself points at that library.
  * JAX restarts the name stack inside the body of ``scan``/``while``/``cond``/
    ``jit``; passes put the enclosing equations back with ``enclosing``.  A method
    called directly on a submodule of a ``bind`` module traces with that
    submodule's name as the root of the stack (``hidden``), which is no class
    name: pass-time errors there have no ``module``.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import threading
import types
from typing import Any, Callable, Iterator, Sequence, TypeVar

from varjax import _jax

__all__ = [
    "VarjaxError", "ScopeError", "ImmutableCollectionError", "MissingVariableError",
    "MissingRngError", "UnknownStreamError", "InvalidVariablesError", "VariableShapeError",
    "VariableCreationError",
    "VariableStructureError", "TransformError", "UnsupportedPrimitiveError",
    "PipelineError", "PassError", "VerificationError", "ModuleError", "UnknownMethodError",
    "NotCallableError", "NameInUseError",
    "AssignSubModuleError", "UnboundModuleError", "InvalidScopeError", "FrozenModuleError",
    "ConfigError", "StaticDataError", "InconsistentAliasError", "NotProvidedError",
    "TRACEBACK_FILTERING_ENV", "api_boundary",
    "format_path", "source_text", "module_text", "where", "enclosing", "call_site",
]


def format_path(path: Sequence[str] | None) -> str:
    """A variable path as errors print it: ``Dense_0/kernel``, or ``<none>``."""
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


_enclosing = threading.local()


@contextlib.contextmanager
def enclosing(*source_infos: _jax.SourceInfo) -> Iterator[None]:
    """While a pass works inside the bodies of higher-order equations, their source infos
    (outermost first).  JAX restarts the name stack in each body, so an equation inside
    one carries only the part of its scope below the body; ``module_text`` puts the
    enclosing equations' scopes in front."""
    previous = getattr(_enclosing, "infos", ())
    # A rule that rewrites an equation's bodies through another helper enters it twice.
    _enclosing.infos = previous + tuple(si for si in source_infos
                                        if not any(si is p for p in previous))
    try:
        yield
    finally:
        _enclosing.infos = previous


def _module_classes() -> set[str]:
    """Names of every ``varjax.nn.Module`` subclass defined so far (read at error time)."""
    module = sys.modules.get("varjax.nn.module")
    if module is None:
        return set()
    names: set[str] = set()
    todo = [module.Module]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__name__ not in names:
                names.add(sub.__name__)
                todo.append(sub)
    return names


def module_text(source_info: _jax.SourceInfo | None = None) -> str | None:
    """The module scope an equation was traced in, from its name stack (see the module
    docstring): ``MLP/hidden``; None outside modules.  The current name stack if not given."""
    if source_info is None:
        stacks = [_jax.current_source_info().name_stack]
    else:
        # An equation is not its own enclosure: a rule raising about the equation it is
        # rewriting runs inside ``enclosing(eqn.source_info)``.
        outer = [si for si in getattr(_enclosing, "infos", ()) if si is not source_info]
        stacks = [si.name_stack for si in outer] + [source_info.name_stack]
    # Scope entries only: transforms (``vmap``, ``jvp``) are no place in the module tree.
    scopes = [name for stack in stacks for name in _jax.scope_names(stack)]
    classes = _module_classes()
    for i, name in enumerate(scopes):
        if name.split(".")[0] in classes:
            return "/".join(scopes[i:])
    return None


def where(source_info: _jax.SourceInfo | None = None, module: str | None = None) -> dict[str, Any]:
    """``source=`` and ``module=`` for an error: the user's line and the module scope of
    ``source_info`` (an equation's; the current frame and name stack if None).  A given
    ``module`` (a trace-time ``Module._label()``) wins over the name stack."""
    return {"source": source_text(source_info),
            "module": module if module is not None else module_text(source_info)}


TRACEBACK_FILTERING_ENV = "VARJAX_TRACEBACK_FILTERING"
_OFF = ("off", "0", "false", "no")
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # varjax/, above ir/
# varjax/ and passes/ (installed as varjax/passes/, a checkout has it beside varjax/).
_INTERNAL = (_HERE + os.sep, os.path.join(os.path.dirname(_HERE), "passes") + os.sep)
_FILTERED_NOTE = (f"--------------------\nvarjax removed its internal frames from this traceback;"
                  f" set {TRACEBACK_FILTERING_ENV}=off to keep them.")

_F = TypeVar("_F", bound=Callable[..., Any])


def _is_internal(filename: str) -> bool:
    # The generated caller of ``varjax.ir.stack_headroom`` is varjax's too, though not a file.
    return filename == _jax.STACK_HEADROOM_FILE or filename.startswith(_INTERNAL) or (
        not os.path.isabs(filename) and os.path.abspath(filename).startswith(_INTERNAL))


def hide_internal_frames(exc: BaseException) -> None:
    """Removes varjax's frames from ``exc``'s traceback, except the innermost one (the
    raise site), and notes it on ``exc``; nothing when filtering is off."""
    if os.environ.get(TRACEBACK_FILTERING_ENV, "").strip().lower() in _OFF:
        return
    entries = []
    tb = exc.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    keep = [t for i, t in enumerate(entries)
            if i == len(entries) - 1 or not _is_internal(t.tb_frame.f_code.co_filename)]
    if len(keep) == len(entries):
        return
    rebuilt = None
    for t in reversed(keep):
        rebuilt = types.TracebackType(rebuilt, t.tb_frame, t.tb_lasti, t.tb_lineno)
    exc.__traceback__ = rebuilt
    if _FILTERED_NOTE not in getattr(exc, "__notes__", ()):
        exc.add_note(_FILTERED_NOTE)


# The call whose ``mutable=`` and ``rngs=`` the user gave: ``apply``, or ``bind`` for a module
# made by ``bind`` (called eagerly or through an object-mode transform), so a fix names the call
# the user wrote, in the form it takes there.
_MUTABLE_GIVEN_BY: contextvars.ContextVar[str] = contextvars.ContextVar("mutable_given_by",
                                                                        default="apply")


@contextlib.contextmanager
def mutability_given_by(api: str) -> Iterator[None]:
    """While the block runs, the fixes of an immutable write and of a missing RNG stream name
    ``api``'s ``mutable=`` and ``rngs=``."""
    token = _MUTABLE_GIVEN_BY.set(api)
    try:
        yield
    finally:
        _MUTABLE_GIVEN_BY.reset(token)


def mutable_fix(collection: str) -> str:
    """The fix of a write to immutable ``collection``: the call that gave ``mutable=``.  A
    bound module's mutability is fixed when it is bound, so that fix shows the ``bind`` call."""
    api = _MUTABLE_GIVEN_BY.get()
    fix = f"pass mutable=['{collection}'] to {api}"
    if api == "bind":
        fix += (f": module.bind(variables, mutable=['{collection}']), or mutable=True for every "
                "collection")
    return fix


def rng_fix(stream: str) -> str:
    """The fix of a draw from a stream nobody gave: the call that takes ``rngs=``."""
    if _MUTABLE_GIVEN_BY.get() == "bind":
        rngs = f"vj.Rngs({stream}=0)" if stream.isidentifier() else f"{{'{stream}': jax.random.key(0)}}"
        return f"bind the module with the stream: module.bind(variables, rngs={rngs})"
    return f"pass rngs={{'{stream}': jax.random.key(0)}} (or a vj.Rngs) to init/apply"


def api_boundary(fn: _F) -> _F:
    """Marks a public entry point: a ``VarjaxError`` leaving it has varjax's frames
    removed from its traceback (see the module docstring).

    Every boundary filters (it is idempotent), so entry points that varjax itself calls
    (``Module.apply`` calls ``Functionalized.apply``) need not know which one the user
    called.  The call path pays one wrapper call; the filtering runs only on the error
    path."""
    @functools.wraps(fn)
    def entry_point(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            for hook in _ON_ERROR:
                hook()
            if isinstance(e, VarjaxError):
                hide_internal_frames(e)
            raise
    return entry_point  # type: ignore[return-value]


_ON_ERROR: list[Callable[[], None]] = []


def on_error(hook: Callable[[], None]) -> None:
    """Run ``hook`` whenever an exception leaves a public entry point (a higher layer's
    bookkeeping of the interrupted call: ``trace/raw_writes.py`` forgets the writes the
    exception interrupted)."""
    _ON_ERROR.append(hook)


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


class UnknownStreamError(MissingRngError, AttributeError):
    """A ``vj.Rngs`` (or the ``rngs`` state given to ``vj.reseed``) has no such stream and
    nothing to fall back to.  Also an ``AttributeError``, so ``hasattr(rngs, name)`` works."""


class InvalidVariablesError(VarjaxError, TypeError):
    """The variables given to init/apply/bind are not a variables dict: the top level or a
    collection is not a dict, or a variable's value is not an array (None, a string...).
    Also a ``TypeError``, which JAX raises for the same mistake without naming the variable."""


class VariableShapeError(VarjaxError):
    """A variable's given value does not have the shape/dtype the code expects."""


class VariableCreationError(VarjaxError):
    """A variable is created where its value before creation would be needed
    (inside a loop body, in only some branches of a conditional)."""


class VariableStructureError(VarjaxError):
    """A variable's pytree structure or avals disagree across a loop or branches."""


class TransformError(VarjaxError):
    """A raw JAX transformation was applied to stateful code it cannot handle."""


class InconsistentAliasError(TransformError, ValueError):
    """One object is passed to an object-mode transform in two places that disagree (two
    ``in_axes``); also a ``ValueError``, which JAX raises for inconsistent arguments."""


class CarryIdentityError(TransformError, ValueError):
    """A loop body returns its carry's objects in other places than it was given them (two
    modules or Variables swapped); also a ``ValueError``, which flax.nnx raises for it."""


class UnsupportedPrimitiveError(VarjaxError, NotImplementedError):
    """A higher-order primitive carries variable effects varjax cannot discharge."""


class NotProvidedError(VarjaxError, NotImplementedError):
    """A Linen or NNX feature varjax deliberately does not provide (the name exists, so
    ported code imports); the message says why and what to use instead."""


class MissingDependencyError(VarjaxError, ImportError):
    """An optional package or program a tool needs is not installed (Graphviz for
    rendering the dataflow graph); the fix says what to install.  Also an ``ImportError``."""


class PartitioningError(VarjaxError, ValueError):
    """Partitioning metadata that cannot be used: a logical name on two axes, rules that are
    not a sequence of pairs, an axis no rule places where a rule is required, or a lifted
    transform adding an axis to a box without ``metadata_params={'partition_name': ...}``.
    Also a ``ValueError``, which Linen raises for the rule errors."""


class PipelineError(VarjaxError):
    """A pass pipeline is malformed: unknown pass, bad option, dependency cycle."""


class PassError(VarjaxError):
    """A pass raised; the message names the pass and the passes run before it."""


class VerificationError(VarjaxError):
    """The IR after a pass violates JAX's type rules or varjax's invariants."""


class ModuleError(VarjaxError):
    """A Module was used against its lifecycle (see ``notes/modules.md``)."""


class UnknownMethodError(ModuleError, AttributeError):
    """``apply``/``init`` was given ``method=`` a name that is neither a method nor a
    submodule field of the module.  Also an ``AttributeError``, as Linen raises there."""


class NotCallableError(ModuleError, TypeError):
    """A method to call (``ToLinen``'s ``nnx_method=``) names something that is not
    callable.  Also a ``TypeError``, as Flax raises there."""


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


class StaticDataError(ModuleError, ValueError):
    """An ``nnx`` object's static attribute holds data (a Variable, a module, an array)
    inside a plain container: a transform would not see it.  Also a ``ValueError``, as
    Flax NNX raises."""


class ConfigError(ModuleError, ValueError):
    """A module's fields and call arguments disagree, e.g. an option given both as a field
    and as a call argument (``nn.merge_param``); also a ``ValueError``, as in Linen."""
