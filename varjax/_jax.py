"""The one door to JAX internals.

varjax rewrites jaxprs, so it needs pieces of JAX that are not public API: the
effect registries, the higher-order primitives it must discharge through, the
source-info machinery that points errors at the user's line, and the jit cache
key.  Every ``jax._src`` import in varjax and varjax.passes lives in this file,
so a JAX upgrade touches this file alone.  Pinned to the jax 0.10 series.

Sharp edges:
  * Parameter *names* of JAX's higher-order primitives (``jaxpr``,
    ``num_consts``, ``branches``...) are plain dict keys read in
    ``varjax/ir/nested.py``, ``passes/default/discharge/``, ``analysis.py`` and ``lower_rng.py``;
    a rename in JAX shows up there.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from jax._src import api_util, core, effects, source_info_util
from jax._src import config as _config
from jax._src import custom_derivatives as _cd
from jax._src import linear_util as lu
from jax._src import mesh as mesh_lib
from jax._src import pretty_printer as pp
from jax._src import util as _util
from jax._src.ad_checkpoint import remat_p as remat_p
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lax.control_flow.conditionals import cond_p as cond_p
from jax._src.lax.control_flow.loops import scan_p as scan_p
from jax._src.lax.control_flow.loops import while_p as while_p
from jax._src.named_sharding import UNSPECIFIED
from jax._src.pjit import jit_p as jit_p
from jax._src.random import prng as _prng
from jax._src.shard_map import shard_map_p as shard_map_p

from varjax.ir.stack_headroom import FILENAME as STACK_HEADROOM_FILE
from varjax.ir.stack_headroom import call_with_headroom

Primitive = core.Primitive
ClosedJaxpr = core.ClosedJaxpr
Jaxpr = core.Jaxpr
JaxprEqn = core.JaxprEqn
Var = core.Var
Literal = core.Literal
ShapedArray = core.ShapedArray
AbstractValue = core.AbstractValue
Effect = effects.Effect
SourceInfo = source_info_util.SourceInfo

custom_jvp_call_p = _cd.custom_jvp_call_p
custom_vjp_call_p = _cd.custom_vjp_call_p
closed_call_p = core.closed_call_p

jaxpr_as_fun = core.jaxpr_as_fun
eval_jaxpr = core.eval_jaxpr
primitive_jvps = ad.primitive_jvps
primitive_batchers = batching.primitive_batchers
dce_rules = pe.dce_rules
dce_jaxpr = pe.dce_jaxpr
has_effects = pe.has_effects   # what DCE's default rule keeps
Zero = ad.Zero


def register_cache(cache: Any, name: str) -> None:
    """Have ``jax.clear_caches()`` call ``cache.cache_clear()`` (held weakly by JAX)."""
    _util.register_cache(cache, name)


def register_effect_type(effect_type: type) -> None:
    """Let an effect type through control flow, custom derivatives and remat."""
    effects.control_flow_allowed_effects.add_type(effect_type)
    effects.custom_derivatives_allowed_effects.add_type(effect_type)
    effects.remat_allowed_effects.add_type(effect_type)


def stage_uncached(prim: Primitive) -> None:
    """Stage ``prim`` without JAX's abstract-evaluation cache.  That cache keys on the
    parameters, and a variable primitive's name one variable (its path, its tree): every
    variable of every model would hold an entry, alive after the model is gone.  The rules
    are trivial, so the cache saves nothing (measured: no difference in trace time)."""
    def stage(trace: Any, source_info: Any, *tracers: Any, **params: Any) -> Any:
        out_avals, effs = prim.abstract_eval(*(t.aval for t in tracers), **params)
        outs = out_avals if prim.multiple_results else [out_avals]
        eqn, out_tracers = trace.make_eqn(tracers, outs, prim, params, effs,
                                          source_info=source_info)
        trace.frame.add_eqn(eqn)
        return out_tracers if prim.multiple_results else out_tracers[0]
    pe.custom_staging_rules[prim] = stage


def exclude_from_user_frames(path: str) -> None:
    """Frames under ``path`` are library frames: source lines skip them."""
    source_info_util.register_exclusion(path)


def user_frame_text(source_info: SourceInfo | None) -> str | None:
    """``file:line (function)`` of the first user frame, or None."""
    if source_info is None:
        return None
    frame = source_info_util.user_frame(source_info.traceback)
    if frame is None:
        return None
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def python_user_frame_text() -> str | None:
    """The first user frame of the *Python* stack.

    JAX's captured tracebacks stop where a trace entered Python from C++, so code
    traced entirely inside library frames (a varjax.nn layer applied at top level)
    has no user frame in them; the Python stack still reaches the user's call."""
    frame = sys._getframe(1)
    while frame is not None:
        if source_info_util.is_user_filename(frame.f_code.co_filename):
            return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_qualname})"
        frame = frame.f_back
    return None


def current_source_info() -> SourceInfo:
    return source_info_util.current()


@contextlib.contextmanager
def source_info_of(eqn: JaxprEqn) -> Iterator[None]:
    """Equations bound inside inherit ``eqn``'s traceback, name stack and context."""
    si = eqn.source_info
    name_stack = source_info_util.current_name_stack() + si.name_stack
    with source_info_util.user_context(si.traceback, name_stack=name_stack), eqn.ctx.manager:
        yield


def trace_to_jaxpr(fun: Callable, in_avals: list[AbstractValue], name: str = "varjax") -> ClosedJaxpr:
    """Trace flat ``fun(*in_avals) -> list`` to a ClosedJaxpr, nothing else.

    This is ``jax.make_jaxpr`` without pytree handling, static-argument
    hashing or debug-info plumbing, which matters because passes re-trace
    every jaxpr they rewrite.  The inputs are flat arrays with no names to give
    them, so the debug info leaves them unnamed instead of asking
    ``inspect.signature`` (a third of a small trace's cost).
    """
    dbg = core.DebugInfo(name, api_util.fun_sourceinfo(fun), None, core.initial_result_paths)
    wrapped = lu.wrap_init(fun, debug_info=dbg)
    # From a fresh stretch of CPython's frame stack (see varjax.ir.stack_headroom).
    jaxpr, _, consts = call_with_headroom(pe.trace_to_jaxpr_dynamic, wrapped, tuple(in_avals))
    return ClosedJaxpr(jaxpr, consts)


def get_aval(x: Any) -> AbstractValue:
    return core.typeof(x)


def fold_in_static(key: Any, data: int) -> Any:
    """``jax.random.fold_in(key, data)`` for a typed key and a Python int in the uint32
    range, binding JAX's fold-in primitive with a numpy scalar: the public function first
    makes ``data`` a device array, which costs as much as the fold-in itself under a
    trace.  The equation staged is the same (the scalar becomes a literal)."""
    return _prng.random_fold_in(key, np.uint32(data))


def lower_as(prim: Primitive, fn: Callable[..., Any]) -> None:
    """Compile ``prim`` (one result) as the JAX function ``fn`` of its operands and params."""
    mlir.register_lowering(prim, mlir.lower_fun(fn, multiple_results=False))


def is_typed_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``), not raw ``uint32``."""
    return isinstance(getattr(x, "dtype", None), _prng.KeyTy)


def is_top_level() -> bool:
    """True when no JAX transformation or staging trace is active."""
    return core.trace_state_clean()


def current_trace() -> Any:
    """The innermost active JAX trace (an opaque object compared by identity)."""
    return core.trace_ctx.trace


def is_differentiating(trace: Any) -> bool:
    """Whether ``trace`` is a forward-mode or linearizing trace (raw ``jax.jvp``/``grad``)."""
    return isinstance(trace, (ad.JVPTrace, ad.LinearizeTrace))


def staged_eqns(trace: Any) -> list | None:
    """The equation list of the jaxpr that ``trace`` (a transformation over a staging
    trace) finally records into, or None when it does not stage.  Effectful equations are
    held strongly in it, in binding order."""
    while trace is not None and not isinstance(trace, pe.DynamicJaxprTrace):
        trace = getattr(trace, "parent_trace", None)
    return trace.frame.tracing_eqns if trace is not None else None


def trace_ref() -> Any:
    """The innermost active JAX trace's weak reference: the identity a held ``Variable``
    records when it is made, compared by ``is`` when it is written."""
    return core.trace_ctx.trace._weakref


def is_invalidated(trace: Any) -> bool:
    """Whether the transformation that ``trace`` belongs to has returned."""
    return trace._invalidated


def in_trace(trace: Any) -> Any:
    """Bind under ``trace`` (a context manager)."""
    return core.set_current_trace(trace)


def trace_of(x: Any) -> Any:
    """The trace a tracer belongs to, or None for a concrete value."""
    return x._trace if isinstance(x, core.Tracer) else None


def jit_key_state(name: str):
    """A thread-local config value that JAX folds into every jit cache key.

    varjax stores a fingerprint of the active tracing context in it, so a
    ``jax.jit``-decorated function called inside varjax-traced code is never
    served a trace made under a different variable context.
    """
    return _config.config_ext.Config(name, None, include_in_jit_key=True,
                                     include_in_trace_context=True)


def call_thunk(thunk: Any, *args: Any) -> Any:
    """Call a JAX ``lu.WrappedFun`` thunk stored in an equation's params."""
    return thunk.call_wrapped(*args)


def wrap_thunk(thunk: Any, around: Callable[[Callable[[], Any]], Any]) -> Any:
    """A thunk like ``thunk`` that JAX calls as ``around(call)``, where ``call()`` runs
    the original: ``around`` may set up context or post-process the result."""
    def wrapped(*args):
        return around(lambda: thunk.call_wrapped(*args))
    return lu.wrap_init(wrapped, debug_info=thunk.debug_info)


def bind_primitive(prim: Primitive, args: list[Any], params: dict[str, Any]) -> list[Any]:
    """``prim.bind`` from equation-style params; always returns a list."""
    out = prim.bind(*args, **prim.get_bind_params(params))
    return list(out) if prim.multiple_results else [out]


def register_print_name(prim: Primitive, text_of: Callable[[JaxprEqn], str]) -> None:
    """Print ``prim``'s equations as ``outs = text_of(eqn) ins`` instead of all params."""
    def rule(eqn, context, settings):
        annotation = source_info_util.summarize(eqn.source_info) if settings.source_info else None
        stack = f"[{eqn.source_info.name_stack}]" if settings.name_stack else None
        rhs = [pp.text(text_of(eqn), annotation=stack)]
        if eqn.invars:
            rhs.append(pp.text(" ") + core.pp_vars(eqn.invars, context))
        if not eqn.outvars:
            return pp.concat(rhs)
        lhs = core.pp_vars(eqn.outvars, context, print_shapes=settings.print_shapes,
                           is_binder=True)
        return pp.concat([lhs, pp.text(" = ", annotation=annotation), *rhs])
    core.pp_eqn_rules[prim] = rule


def scope_names(name_stack: Any) -> list[str]:
    """The ``named_scope`` entries of a name stack, outermost first (transform entries such
    as ``vmap`` or ``jvp`` left out)."""
    return [e.name for e in name_stack.stack if isinstance(e, source_info_util.Scope)]


def with_name_stack(eqn: JaxprEqn, name: str) -> JaxprEqn:
    """``eqn`` whose name stack is the single scope ``name``."""
    stack = source_info_util.new_name_stack(name)
    return eqn.replace(source_info=eqn.source_info.replace(name_stack=stack))


def pretty_print(jaxpr: ClosedJaxpr, *, source_info: bool = False, name_stack: bool = False) -> str:
    return jaxpr.pretty_print(source_info=source_info, name_stack=name_stack,
                              print_effects=True)


def jit_params_with(params: dict, jaxpr: ClosedJaxpr, n_in_front: int, n_out_back: int) -> dict:
    """``jit`` equation params for a body that gained leading inputs and trailing outputs."""
    new = dict(params, jaxpr=jaxpr)
    new["in_shardings"] = (UNSPECIFIED,) * n_in_front + tuple(params["in_shardings"])
    new["out_shardings"] = tuple(params["out_shardings"]) + (UNSPECIFIED,) * n_out_back
    new["in_layouts"] = (None,) * n_in_front + tuple(params["in_layouts"])
    new["out_layouts"] = tuple(params["out_layouts"]) + (None,) * n_out_back
    new["donated_invars"] = (False,) * n_in_front + tuple(params["donated_invars"])
    return new


def new_var(aval: AbstractValue) -> Var:
    return core.Var(aval)


def rebuild_jaxpr(jaxpr: Jaxpr, *, invars, outvars, eqns, effects) -> Jaxpr:
    """``jaxpr`` with new binders/equations; argument names are dropped (arity changed)."""
    return jaxpr.replace(invars=list(invars), outvars=list(outvars), eqns=list(eqns),
                         effects=effects, debug_info=jaxpr.debug_info.with_unknown_names())


def jit_call(jaxpr: ClosedJaxpr, name: str) -> Callable[..., list]:
    """Stage ``jaxpr`` as one ``jit`` equation, without re-tracing it."""
    n_in, n_out = len(jaxpr.in_avals), len(jaxpr.out_avals)
    params = dict(jaxpr=jaxpr, in_shardings=(UNSPECIFIED,) * n_in,
                  out_shardings=(UNSPECIFIED,) * n_out, in_layouts=(None,) * n_in,
                  out_layouts=(None,) * n_out, donated_invars=(False,) * n_in,
                  ctx_mesh=mesh_lib.get_abstract_mesh(), name=name, keep_unused=False,
                  inline=False, compiler_options_kvs=())
    return lambda *args: jit_p.bind(*args, **params)


def open_consts(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[Any]]:
    """``closed`` with its constants turned into leading inputs, and the constants: call it
    as ``f(*consts, *args)``.  Needed when the constants may be tracers of an enclosing
    trace (a lifted body closing over an array), which a ``jit`` equation cannot hold."""
    if not closed.consts:
        return closed, []
    return ClosedJaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), ()), list(closed.consts)


def keep_binders(jaxpr: Jaxpr, eqns: Sequence[JaxprEqn], keep_inputs: Sequence[bool],
                 keep_outputs: Sequence[bool]) -> Jaxpr:
    """``jaxpr`` with ``eqns``, and only the inputs and outputs marked kept: what JAX's DCE
    builds (effects recomputed for the new binders, argument names and result paths
    filtered alike)."""
    invars = [v for v, k in zip(jaxpr.invars, keep_inputs) if k]
    outvars = [v for v, k in zip(jaxpr.outvars, keep_outputs) if k]
    dbg = jaxpr.debug_info
    dbg = core.DebugInfo(dbg.traced_for, dbg.func_src_info, dbg.filter_arg_names(keep_inputs),
                         dbg.filter_result_paths(keep_outputs))
    effs = pe.make_jaxpr_effects(jaxpr.constvars, invars, outvars, eqns)
    return jaxpr.replace(invars=invars, outvars=outvars, eqns=list(eqns), effects=effs,
                         debug_info=dbg)


# Source lines in errors and dumps point at user code, never at varjax itself.
_HERE = os.path.dirname(os.path.abspath(__file__))
exclude_from_user_frames(_HERE + os.sep)
exclude_from_user_frames(os.path.join(os.path.dirname(_HERE), "passes") + os.sep)
# Dataclass-generated methods (a Module's __init__) are compiled from strings; the
# constructor call that matters is the user's line that called them.
exclude_from_user_frames("<string>")
exclude_from_user_frames(STACK_HEADROOM_FILE)


# --- custom-rule closures (passes/default/discharge/closures.py) -------------------------------------------

def thunk_identity(thunk: Any) -> Any:
    """What identifies the custom function a rule thunk belongs to: its debug info, which
    every rewrap keeps -- varjax's ``wrap_thunk``, JAX's dead-code elimination, and JAX
    re-binding the call (which also folds the closed-over values into the arguments)."""
    return thunk.debug_info


def is_library_thunk(thunk: Any) -> bool:
    """Whether a rule thunk's function is library code (JAX's, varjax's) rather than the
    user's, by the file its debug info names (``jax.nn.relu``'s rule is JAX's)."""
    where = (getattr(thunk.debug_info, "func_src_info", None) or "").rpartition(" at ")[2]
    path = where.rsplit(":", 1)[0]
    return bool(path) and not source_info_util.is_user_filename(path)


def staged_var(x: Any) -> Var | None:
    """The jaxpr variable a staging tracer stands for (also after its trace ended), or
    None for any other value."""
    if isinstance(x, pe.DynamicJaxprTracer) and isinstance(x.val, Var):
        return x.val
    return None


def staged_producer(x: Any) -> tuple[Primitive, dict, list] | None:
    """``(primitive, params, input tracers)`` of the equation that produced the staging
    tracer ``x`` (kept by the tracer itself, also after its trace ended), or None."""
    parent = getattr(x, "parent", None) if isinstance(x, pe.DynamicJaxprTracer) else None
    if parent is None:
        return None
    return parent.primitive, parent.params, list(parent.in_tracers)


# --- raw shard_map (varjax/ir/nested.py, passes/default/discharge/) ------------------------------------

def varying_axes(x: Any) -> frozenset:
    """The mesh axes over which ``x`` may differ between shards, inside a ``shard_map``
    body that checks it (``check_vma=True``): JAX's varying-manual-axes type."""
    mat = getattr(core.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())
