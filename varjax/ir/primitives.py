"""The three varjax primitives: ``var_get``, ``var_set`` and ``rng_draw``.

A variable is identified by ``(collection, path)``: ``('params',
('Dense_0', 'kernel'))``.  Its value may be any pytree (``sow`` keeps tuples),
so reads and writes are multiple-result primitives over the flat leaves, with
the treedef and leaf avals as parameters:

* ``var_get[collection, path, tree, avals, lift]() -> leaves`` reads the current value;
* ``var_set[collection, path, tree, lift](*leaves) -> ()`` replaces it;
* ``rng_draw[stream, aval, path, count]() -> key`` draws a fresh key from an RNG
  stream.  ``path`` is ``None`` for a draw under NNX's convention (order-based, counted
  by ``lower-rng``); under Linen's it is the drawing module's path and ``count`` the
  draw's number for that stream and path (from 1; 0: the stream's key itself, handed
  to a lifted body), both static (see ``varjax.ir.streams``).

``lift`` is None for the program's own accesses, and the lifted transform's name
(``"scan"``) for those a lift binds at its boundary, which hand the variable to (or take
it back from) bodies that already ran the program's passes (``handing``).

Each carries its effect (see ``effects.py``), so JAX keeps them in order and
never dead-code-eliminates a write.  They have no implementation: outside a
functionalized function there is no variable store, and binding one eagerly
raises ``ScopeError``.  Under raw ``jax.grad`` draws have zero tangents, writes store
the primal value, and reads have zero tangents except a read of a value written under the
same differentiation, which carries its derivative (see ``_forwarded``); under raw ``jax.vmap`` reads and
draws are unbatched and a batched write raises ``TransformError`` (a rule the tracing
layer registers, ``varjax.trace.context``: its message names the running module).

Sharp edges:
  * ``rng_draw`` is never dead-code-eliminated even when its key is unused:
    draws are order-based, so dropping one would shift every later key.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import weakref
from typing import Any, Sequence

import jax

from varjax import _jax
from varjax.ir import axis_metadata, errors
from varjax.ir.effects import RngEffect, VariableEffect

Path = tuple[str, ...]
Key = tuple[str, Path]  # (collection, path)

class _ReadPrimitive(_jax.Primitive):
    def bind_with_trace(self, trace, args, avals, params, /):
        written = _forwarded(trace, params) if _jax.is_differentiating(trace) else None
        return written if written is not None else super().bind_with_trace(trace, args, avals, params)


class _WritePrimitive(_jax.Primitive):
    def bind_with_trace(self, trace, args, avals, params, /):
        out = super().bind_with_trace(trace, args, avals, params)
        if _jax.is_differentiating(trace):
            _remember(trace, params, args)
        return out


var_get_p = _ReadPrimitive("var_get")
var_get_p.multiple_results = True
var_set_p = _WritePrimitive("var_set")
var_set_p.multiple_results = True
rng_draw_p = _jax.Primitive("rng_draw")

VARJAX_PRIMITIVES = (var_get_p, var_set_p, rng_draw_p)


def is_internal(collection: str) -> bool:
    """Collections named ``__*`` are varjax's scratch space (RNG keys and loop counters):
    always writable, never returned to the user."""
    return collection.startswith("__")


def _get_abstract_eval(*, collection, path, tree, avals, lift):
    return list(avals), {VariableEffect(collection)}


def _set_abstract_eval(*leaves, collection, path, tree, lift):
    return [], {VariableEffect(collection)}


def _draw_abstract_eval(*, stream, aval, path, count):
    return aval, {RngEffect(stream)}


var_get_p.def_effectful_abstract_eval(_get_abstract_eval)
var_set_p.def_effectful_abstract_eval(_set_abstract_eval)
rng_draw_p.def_effectful_abstract_eval(_draw_abstract_eval)


def _no_impl(name):
    def impl(*args, **params):
        raise errors.ScopeError(
            f"{name} ran outside a functionalized function: varjax variables only "
            "exist while @vj.functionalize (or Module.init/apply) traces your code.",
            collection=params.get("collection", params.get("stream")),
            path=params.get("path"), **errors.where(),
            fix="call the function through .init / .apply of vj.functionalize(fn)")
    return impl


var_get_p.def_impl(_no_impl("var_get"))
var_set_p.def_impl(_no_impl("var_set"))
rng_draw_p.def_impl(_no_impl("rng_draw"))


# --- raw JAX transformations over stateful code --------------------------------------

def zero_tangent(aval: Any) -> Any:
    """The symbolic zero tangent of a value of ``aval`` (keys, reads: not differentiated)."""
    return _jax.Zero(aval.to_tangent_aval())


def _get_jvp(primals, tangents, **params):
    outs = var_get_p.bind(**params)
    return outs, [zero_tangent(_jax.get_aval(o)) for o in outs]


def _set_jvp(primals, tangents, **params):
    # A write under raw jax.grad stores the primal: variables are not differentiated.
    var_set_p.bind(*primals, **params)
    return [], []


def _draw_jvp(primals, tangents, **params):
    key = rng_draw_p.bind(**params)
    return key, zero_tangent(_jax.get_aval(key))


# A write followed by a read of the same variable is data flow, and under raw jax.jvp /
# jax.grad the read must carry the written value's derivative.  But a read binds with no
# operands, so JAX treats its result as a constant of the differentiation and never calls
# its JVP rule.  So the primitives see the differentiating trace first (bind_with_trace):
# a write under one remembers the tracers it stored, and a later read under the same trace
# returns them, derivative included, when nothing in between can have changed the
# variable -- checked on the staged equations, which hold every effect in order (a write
# inside a jitted helper, a loop or a branch shows there even when its Python did not run).
# Nested differentiation: the write rebinds the primal on the parent trace, which
# remembers its own level's value.  Any other read binds as usual.
_written: dict[int, tuple[Any, dict[Key, tuple[tuple, list, int]]]] = {}


def _remember(trace: Any, params: dict, leaves: Sequence[Any]) -> None:
    eqns = _jax.staged_eqns(trace)
    if eqns is None:
        return
    for tid in [t for t, (ref, _) in _written.items() if ref() is None or _jax.is_invalidated(ref())]:
        del _written[tid]
    entry = _written.get(id(trace))
    if entry is None or entry[0]() is not trace:
        entry = _written[id(trace)] = (weakref.ref(trace), {})
    entry[1][(params["collection"], params["path"])] = (tuple(leaves), eqns, len(eqns))


def _forwarded(trace: Any, params: dict) -> list[Any] | None:
    entry = _written.get(id(trace))
    if entry is None or entry[0]() is not trace:
        return None
    key = (params["collection"], params["path"])
    found = entry[1].get(key)
    if found is None:
        return None
    leaves, eqns, mark = found
    if eqns is not _jax.staged_eqns(trace) or any(_may_write(e, key) for e in eqns[mark:]):
        return None
    if [leaf_aval(x) for x in leaves] != list(params["avals"]):
        return None
    with _jax.in_trace(trace):   # stored values are strongly typed, as a read returns them
        return [jax.lax.convert_element_type(x, x.dtype) if _jax.get_aval(x).weak_type else x
                for x in leaves]


def _may_write(eqn: Any, key: Key) -> bool:
    """Whether a staged equation can change variable ``key`` (reads cannot)."""
    if isinstance(eqn, weakref.ref):   # JAX holds effect-free equations weakly
        return False
    if eqn.primitive is var_get_p or (eqn.primitive is var_set_p and
                                      (eqn.params["collection"], eqn.params["path"]) != key):
        return False
    return VariableEffect(key[0]) in eqn.effects


_jax.primitive_jvps[var_get_p] = _get_jvp
_jax.primitive_jvps[var_set_p] = _set_jvp
_jax.primitive_jvps[rng_draw_p] = _draw_jvp


# A read whose result is unused can go: reading has no observable effect.
_jax.dce_rules[var_get_p] = lambda used_outs, eqn: ([], eqn if any(used_outs) else None)


# --- printing --------------------------------------------------------------------------

def _pp_name(eqn) -> str:
    p = eqn.params
    if eqn.primitive is rng_draw_p:
        if p["path"] is None:
            return f"rng_draw[{p['stream']}]"
        return f"rng_draw[{p['stream']}:{'/'.join(p['path'])}#{p['count']}]"
    names = "".join(f" {n}" for n in partition_names(p["tree"]))
    lift = f" lift={p['lift']}" if p["lift"] is not None else ""
    return f"{eqn.primitive.name}[{p['collection']}:{errors.format_path(p['path'])}{names}{lift}]"


def partition_names(tree: Any) -> list[tuple]:
    """The partition names of the boxes (``nn.Partitioned``) in a variable of treedef
    ``tree``: the names ride on its equations, and the printer shows them."""
    return [b.names for b in axis_metadata.boxes_of(tree) if isinstance(b, axis_metadata.Partitioned)]


for _p in VARJAX_PRIMITIVES:
    _jax.register_print_name(_p, _pp_name)
    _jax.stage_uncached(_p)


# The lifted transform the variable accesses being bound hand their values to (or take
# them back from), if any: see ``handing``.
_handing: contextvars.ContextVar[str | None] = contextvars.ContextVar("varjax_handing", default=None)


@contextlib.contextmanager
def handing(lift: str):
    """Reads and writes bound inside are a lifted transform's boundary: they carry
    ``lift=<the transform's name>``.  Such a read hands a variable, with the axes the
    transform adds (a scan's stacked layers), to bodies that ran the program's passes on
    their own reads of it, with the body's shapes; a pass that rewrites values leaves it
    alone (``notes/writing-passes.md``).  The lifting layer binds its boundary here."""
    token = _handing.set(lift)
    try:
        yield
    finally:
        _handing.reset(token)


def lift_of(eqn: Any) -> str | None:
    """The lifted transform a ``var_get``/``var_set`` equation hands its variable to (or
    takes it back from); None for an access of the program itself."""
    return eqn.params.get("lift")


def bind_get(collection: str, path: Path, tree: Any, avals: Sequence[Any]) -> list[Any]:
    return var_get_p.bind(collection=collection, path=tuple(path), tree=tree,
                          avals=tuple(avals), lift=_handing.get())


def bind_set(collection: str, path: Path, leaves: Sequence[Any], tree: Any) -> None:
    var_set_p.bind(*leaves, collection=collection, path=tuple(path), tree=tree,
                   lift=_handing.get())


def bind_draw(stream: str, aval: Any, path: Path | None = None, count: int = 0) -> Any:
    """A draw from ``stream``: NNX's convention when ``path`` is None, else Linen's draw
    ``count`` of the module at ``path`` (see ``varjax.ir.streams``)."""
    return rng_draw_p.bind(stream=stream, aval=aval,
                           path=None if path is None else tuple(path), count=int(count))


def leaf_aval(x: Any) -> Any:
    """The aval a variable leaf has in the IR (weak types dropped: stored values are strong)."""
    aval = _jax.get_aval(x)
    return aval.update(weak_type=False) if getattr(aval, "weak_type", False) else aval


@dataclasses.dataclass
class VarType:
    """What the IR knows about a variable: pytree structure and leaf avals."""

    tree: Any
    avals: tuple

    @staticmethod
    def of(value: Any) -> "VarType":
        leaves, tree = jax.tree.flatten(value)
        return VarType.of_leaves(tree, leaves)

    @staticmethod
    def of_leaves(tree: Any, leaves: Sequence[Any]) -> "VarType":
        """The type of a value given flat (arrays or tracers); weak types are dropped."""
        return VarType(tree, tuple(leaf_aval(x) for x in leaves))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VarType) and self.tree == other.tree and self.avals == other.avals

    def __hash__(self) -> int:
        return hash((self.tree, self.avals))

    def describe(self) -> str:
        """``float32[3]`` for an array; ``tuple [float32[3], float32[3]]`` for a pytree
        (a Python list of numbers reads ``list [float32[], ... (9 leaves)]``)."""
        shapes = [a.str_short() for a in self.avals]
        if self.tree.num_leaves == 1 and not self.tree.children():
            return shapes[0]
        if len(shapes) > 4:
            shapes = shapes[:3] + [f"... ({len(shapes)} leaves)"]
        root = self.tree.node_data()
        return f"{root[0].__name__ if root else self.tree} [{', '.join(shapes)}]"
