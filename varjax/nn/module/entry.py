"""Entry points: ``init`` / ``apply`` / ``bind``, and the functionalized traces behind them.

``apply`` is ``vj.functionalize`` of one small function that clones the template,
binds the clone to the running trace (a ``TraceRoot``) and calls the method;
``init`` is ``apply`` with nothing given and everything but ``intermediates``
mutable.  The ``Functionalized`` is cached on the module and shared by equal
modules while one is alive (see ``_SHARED``), and goes with the last of them.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref
from typing import Any, Callable, Mapping, Self

import jax

from varjax import _jax
from varjax.functionalization.functionalized import Functionalized, function_name
from varjax.ir import errors, filters, liveness
from varjax.ir.statics import typed
from varjax.ir.typing import CollectionFilter, Passes, PyTree, RngsLike, VariableDict
from varjax.nn.binding import BoundRoot, TraceRoot
from varjax.nn.module.interception import cache_key
from varjax.nn.module.lifecycle import Lifecycle
from varjax.nn.typing import CaptureIntermediates
from varjax.trace.context import current, site
from varjax.trace.variable_dicts import flatten_variables

# Linen's default for init: sown intermediates are not part of the variables.
DEFAULT_INIT_MUTABLE = filters.DenyList(["intermediates"])


class EntryPoints(Lifecycle):
    """How a template module is run: bound to a trace (``init``/``apply``) or to variables
    (``bind``)."""

    @errors.api_boundary
    def bind(self, variables: VariableDict, *, rngs: RngsLike | None = None,
             mutable: CollectionFilter = False, passes: Passes = ()) -> Self:
        """A bound clone with unlimited lifetime; mutable collections are updated in place.
        ``passes`` run on every call of it (see ``apply``)."""
        return self.clone(parent=BoundRoot(variables, rngs, mutable, _entries(passes)), name=None)

    def unbind(self) -> tuple[Self, dict[str, Any]]:
        """``(unbound clone, variables)`` of a module made by ``bind``."""
        if self.scope is None or not isinstance(self.scope.root, BoundRoot) or self.scope.path:
            raise errors.UnboundModuleError(
                f"unbind() needs the root module returned by bind(); got {self._label()}.",
                **site(about=self), fix="call unbind on the module that bind() returned")
        return self.clone(parent=None), self.scope.root.variables

    def functionalize(self, method: str | Callable[..., Any] | None = None,
                      capture_intermediates: CaptureIntermediates = False,
                      passes: Passes = ()) -> Functionalized:
        """The ``vj.functionalize`` object behind ``init``/``apply`` for ``method``: use it
        for ``.jaxpr(...)`` / ``.functional_jaxpr(...)`` / ``.traced(...)`` of a module call.
        ``passes`` (a pipeline string or ``Pass`` instances) are added to the default
        pipeline, and run in the bodies of the lifted transforms inside too.

        Cached on the module, so repeated ``apply`` calls reuse its traces."""
        capture = capture_intermediates
        fn = resolve_method(self, method)
        cache = self.__dict__.setdefault("_varjax_functionalized", {})
        # Interceptors and named calls change the trace; passes change the pipeline.
        key = (fn, capture, cache_key(), _entries(passes))
        found = cache.get(key)
        if found is None:
            found = cache[key] = _shared_functionalized(self, key)
        return found

    def _new_functionalized(self, fn: Callable, capture: Any, passes: tuple = ()) -> Functionalized:
        capture_fn = _capture_filter(capture)

        def bound_call(*args: Any, **kwargs: Any) -> Any:
            root = TraceRoot(current(), capture_fn)
            return fn(self.clone(parent=root, name=None), *args, **kwargs)
        bound_call.__name__ = f"{type(self).__name__}.{function_name(fn)}"
        return Functionalized(bound_call, passes=passes)

    @errors.api_boundary
    def init_with_output(self, rngs: RngsLike, *args: Any, method: str | Callable[..., Any] | None = None,
                         mutable: CollectionFilter = DEFAULT_INIT_MUTABLE,
                         capture_intermediates: CaptureIntermediates = False,
                         passes: Passes = (), **kwargs: Any) -> tuple[PyTree, dict[str, Any]]:
        fz = self.functionalize(method, capture_intermediates, passes)
        return fz.init_with_output(rngs, *args, mutable=mutable, **kwargs)

    @errors.api_boundary
    def init(self, rngs: RngsLike, *args: Any, method: str | Callable[..., Any] | None = None,
             mutable: CollectionFilter = DEFAULT_INIT_MUTABLE,
             capture_intermediates: CaptureIntermediates = False, passes: Passes = (),
             **kwargs: Any) -> dict[str, Any]:
        """All variables the method creates: ``apply({}, ..., mutable=True)[1]`` with the
        ``params`` stream given, minus ``intermediates`` (Linen's default).  Variables that
        ``passes`` create (LoRA adapters) are created here too."""
        return self.init_with_output(rngs, *args, method=method, mutable=mutable,
                                     capture_intermediates=capture_intermediates, passes=passes,
                                     **kwargs)[1]

    @errors.api_boundary
    def lazy_init(self, rngs: RngsLike, *args: Any, method: str | Callable[..., Any] | None = None,
                  mutable: CollectionFilter = DEFAULT_INIT_MUTABLE, **kwargs: Any) -> dict[str, Any]:
        """``init`` with ``jax.ShapeDtypeStruct`` in place of inputs whose values the variables
        do not need: the forward pass is traced, and only what the variables depend on runs
        (Linen's ``lazy_init``).  A variable whose initial value depends on such an input
        raises ``VariableCreationError``."""
        leaves, tree = jax.tree.flatten((args, kwargs))
        abstract = [isinstance(x, jax.ShapeDtypeStruct) for x in leaves]

        def init_from(*given: Any) -> dict[str, Any]:
            it = iter(given)
            a, kw = jax.tree.unflatten(tree, [next(it) if ab else x for x, ab in zip(leaves, abstract)])
            return self.init(rngs, *a, method=method, mutable=mutable, **kw)
        inputs = [x for x, ab in zip(leaves, abstract) if ab]
        closed, shapes = jax.make_jaxpr(init_from, return_shape=True)(*inputs)
        pruned, consts, used = liveness.prune(closed)
        if any(used):
            _raise_lazy(self, closed, shapes)
        values = jax.jit(lambda *c: _jax.eval_jaxpr(pruned.jaxpr, (), *c))(*consts)
        return jax.tree.unflatten(jax.tree.structure(shapes), values)

    @errors.api_boundary
    def apply(self, variables: VariableDict, *args: Any, rngs: RngsLike | None = None,
              method: str | Callable[..., Any] | None = None, mutable: CollectionFilter = False,
              capture_intermediates: CaptureIntermediates = False, passes: Passes = (),
              **kwargs: Any) -> PyTree | tuple[PyTree, dict[str, Any]]:
        """Runs ``method`` (default ``__call__``) of a bound clone; returns ``out`` or
        ``(out, updated_collections)`` when anything is mutable.  ``passes`` (a pipeline
        string such as ``"lora{rank=4}"`` or ``Pass`` instances) rewrite the call's IR after
        the default passes that they do not declare to follow, in lifted bodies too."""
        fz = self.functionalize(method, capture_intermediates, passes)
        return fz.apply(variables, *args, rngs=rngs, mutable=mutable, **kwargs)


# Equal modules (same class and fields) share their Functionalized while one of them is
# alive, so a new but equal model object -- built per call, or rebuilt inside a function
# that traces again -- neither retraces nor recompiles.  Fields compare by type and value
# (``statics.typed``), down through submodules, tuples and dicts: ``Fill(1)``,
# ``Fill(1.0)`` and ``Fill(True)`` are equal dataclasses, but ``jnp.full((2,), v)`` traces
# to three dtypes.
#
# The table holds its entries weakly: a model's traces (jaxprs, compiled calls) are held
# by the model object (``_varjax_functionalized``), as ``jax.jit`` holds its traces by the
# function, and go when the last equal model does.  A loop that builds a new model object
# per eager step and drops it therefore traces each step: keep the model, as one keeps a
# jitted function.
_SHARED: "weakref.WeakValueDictionary[Any, Functionalized]" = weakref.WeakValueDictionary()


def _shared_functionalized(module: EntryPoints, key: tuple) -> Functionalized:
    try:
        # ``typed`` would key a list field too, but the list may change after this call.
        hash(module)
        shared_key = typed((module, *key))
        found = _SHARED.get(shared_key)
    except TypeError:                 # a field is unhashable: this instance only
        return module._new_functionalized(key[0], key[1], key[3])
    if found is None:
        found = _SHARED[shared_key] = module._new_functionalized(key[0], key[1], key[3])
    return found


def _entries(passes: Passes) -> tuple:
    """``passes=`` as a hashable tuple (a cache key; ``Functionalized`` parses it)."""
    if passes is None:
        return ()
    if isinstance(passes, str):
        return (passes,) if passes.strip() else ()
    return tuple(passes)


def _raise_lazy(module: EntryPoints, closed: Any, shapes: dict[str, Any]) -> None:
    """The variables of a ``lazy_init`` that need an abstract input's value: an error naming
    the first of them."""
    keys = list(flatten_variables(shapes))
    n = len(closed.jaxpr.outvars)
    for i, (collection, path) in enumerate(keys):
        if any(liveness.prune(closed, [j == i for j in range(n)])[2]):
            raise errors.VariableCreationError(
                f"lazy_init cannot create variable {errors.format_path(path)}: its initial "
                "value depends on an input given as a jax.ShapeDtypeStruct.",
                collection=collection, path=path, **site(about=module),
                fix="pass that input as an array (or use init)")


def resolve_method(module: EntryPoints, method: str | Callable[..., Any] | None) -> Callable:
    """The function ``method=`` names: a method name, a method of any instance (unbound), or
    a callable taking the module first (``None``: ``__call__``)."""
    if method is None:
        method = "__call__"
    if isinstance(method, str):
        fn = getattr(type(module), method, None)
        if fn is not None and callable(fn):
            return fn
        if method in {f.name for f in dataclasses.fields(module)} \
                and callable(getattr(module, method)):
            return _field_call(method)                           # a submodule field
        raise errors.UnknownMethodError(
            f"{type(module).__name__} has no method or submodule field '{method}'.",
            **site(about=module),
            fix="pass method= the name of a method or a submodule field of the module")
    if inspect.ismethod(method) and isinstance(method.__self__, EntryPoints):
        method = method.__func__           # a method of some instance: call it on the clone
    if not callable(method) or not _takes_module(method):
        raise errors.ModuleError(
            f"method= must be a method name or a callable taking the module first, got "
            f"{method!r}.", **site(about=module),
            fix="pass e.g. method=Model.encode or method='encode'")
    return method


@functools.cache
def _field_call(name: str) -> Callable:
    """``apply(method='bar')`` for a submodule field ``bar``: call the bound clone's
    ``bar``, as Linen does; one function per name, so the traces are cached per name."""
    def call(module: Any, *args: Any, **kwargs: Any) -> Any:
        module._try_setup()        # adopts (binds) the submodules its fields hold
        return getattr(module, name)(*args, **kwargs)
    call.__name__ = name
    return call


def _takes_module(fn: Callable) -> bool:
    """Whether ``fn`` can take the bound module as its first argument."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):     # a builtin without a signature: let the call decide
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               for p in params)


def capture_call_intermediates(module: Any, method_name: str) -> bool:
    """Linen's default ``capture_intermediates`` filter: sow the output of every ``__call__``."""
    return method_name == "__call__"


def _capture_filter(capture: Any) -> Callable[[EntryPoints, str], bool] | None:
    if capture is False or capture is None:
        return None
    if capture is True:
        return capture_call_intermediates
    return capture


def apply(fn: Callable[..., Any], module: EntryPoints, mutable: CollectionFilter = False,
          capture_intermediates: CaptureIntermediates = False) -> Callable[..., Any]:
    """Linen's ``nn.apply``: ``fn(bound_module, *args)`` as ``(variables, *args, rngs=)``."""
    def applied(variables: Mapping[str, Any], *args: Any, rngs: Any = None, **kwargs: Any) -> Any:
        return module.apply(variables, *args, rngs=rngs, method=fn, mutable=mutable,
                            capture_intermediates=capture_intermediates, **kwargs)
    return applied


def init_with_output(fn: Callable[..., Any], module: EntryPoints,
                     mutable: CollectionFilter = DEFAULT_INIT_MUTABLE,
                     capture_intermediates: CaptureIntermediates = False) -> Callable[..., Any]:
    """Linen's ``nn.init_with_output``: ``fn(bound_module, *args)`` as
    ``(rngs, *args) -> (out, variables)``."""
    def initialized(rngs: Any, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        return module.init_with_output(rngs, *args, method=fn, mutable=mutable,
                                       capture_intermediates=capture_intermediates, **kwargs)
    return initialized


def init(fn: Callable[..., Any], module: EntryPoints, mutable: CollectionFilter = DEFAULT_INIT_MUTABLE,
         capture_intermediates: CaptureIntermediates = False) -> Callable[..., Any]:
    """Linen's ``nn.init``: ``fn(bound_module, *args)`` as ``(rngs, *args) -> variables``."""
    with_output = init_with_output(fn, module, mutable, capture_intermediates)
    return lambda rngs, *args, **kwargs: with_output(rngs, *args, **kwargs)[1]
