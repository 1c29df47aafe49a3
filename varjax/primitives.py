"""The three varjax primitives: ``var_get``, ``var_set`` and ``rng_draw``.

A variable is identified by ``(collection, path)``: ``('params',
('Dense_0', 'kernel'))``.  Its value may be any pytree (``sow`` keeps tuples),
so reads and writes are multiple-result primitives over the flat leaves, with
the treedef and leaf avals as parameters:

* ``var_get[collection, path, tree, avals]() -> leaves`` reads the current value;
* ``var_set[collection, path, tree](*leaves) -> ()`` replaces it;
* ``rng_draw[stream, aval]() -> key`` draws a fresh key from an RNG stream.

Each carries its effect (see ``effects.py``), so JAX keeps them in order and
never dead-code-eliminates a write.  They have no implementation: outside a
functionalized function there is no variable store, and binding one eagerly
raises ``ScopeError``.  Under raw ``jax.grad`` reads and draws have zero
tangents and writes store the primal value; under raw ``jax.vmap`` reads and
draws are unbatched and a batched write raises ``TransformError``.

Sharp edges:
  * ``rng_draw`` is never dead-code-eliminated even when its key is unused:
    draws are order-based, so dropping one would shift every later key.
"""
from __future__ import annotations

from typing import Any, Sequence

from varjax import _jax, errors
from varjax.effects import RngEffect, VariableEffect

Path = tuple[str, ...]
Key = tuple[str, Path]  # (collection, path)

var_get_p = _jax.Primitive("var_get")
var_get_p.multiple_results = True
var_set_p = _jax.Primitive("var_set")
var_set_p.multiple_results = True
rng_draw_p = _jax.Primitive("rng_draw")

VARJAX_PRIMITIVES = (var_get_p, var_set_p, rng_draw_p)


def is_internal(collection: str) -> bool:
    """Collections named ``__*`` are varjax's scratch space (RNG keys and loop counters):
    always writable, never returned to the user."""
    return collection.startswith("__")


def _get_abstract_eval(*, collection, path, tree, avals):
    return list(avals), {VariableEffect(collection)}


def _set_abstract_eval(*leaves, collection, path, tree):
    return [], {VariableEffect(collection)}


def _draw_abstract_eval(*, stream, aval):
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

def _zero_tangent(aval):
    return _jax.Zero(aval.to_tangent_aval())


def _get_jvp(primals, tangents, **params):
    outs = var_get_p.bind(**params)
    return outs, [_zero_tangent(_jax.get_aval(o)) for o in outs]


def _set_jvp(primals, tangents, **params):
    # A write under raw jax.grad stores the primal: variables are not differentiated.
    var_set_p.bind(*primals, **params)
    return [], []


def _draw_jvp(primals, tangents, **params):
    key = rng_draw_p.bind(**params)
    return key, _zero_tangent(_jax.get_aval(key))


_jax.primitive_jvps[var_get_p] = _get_jvp
_jax.primitive_jvps[var_set_p] = _set_jvp
_jax.primitive_jvps[rng_draw_p] = _draw_jvp


def _set_batch(args, dims, *, collection, path, tree):
    from varjax import scope  # scope imports this module
    raise errors.TransformError(
        "a batched value is written to a variable under raw jax.vmap; a variable has one "
        "value, so varjax cannot tell which batch member should win.",
        collection=collection, path=path, **scope.where(),
        fix="use the lifted vj.vmap (nn.vmap) with variable_axes={'%s': 0}, which keeps one "
            "copy per batch member along a variable axis" % collection)


_jax.primitive_batchers[var_set_p] = _set_batch

# A read whose result is unused can go: reading has no observable effect.
_jax.dce_rules[var_get_p] = lambda used_outs, eqn: ([], eqn if any(used_outs) else None)


# --- printing --------------------------------------------------------------------------

def _pp_name(eqn) -> str:
    p = eqn.params
    if eqn.primitive is rng_draw_p:
        return f"rng_draw[{p['stream']}]"
    return f"{eqn.primitive.name}[{p['collection']}:{errors.format_path(p['path'])}]"


for _p in VARJAX_PRIMITIVES:
    _jax.register_print_name(_p, _pp_name)


def bind_get(collection: str, path: Path, tree: Any, avals: Sequence[Any]) -> list[Any]:
    return var_get_p.bind(collection=collection, path=tuple(path), tree=tree,
                          avals=tuple(avals))


def bind_set(collection: str, path: Path, leaves: Sequence[Any], tree: Any) -> None:
    var_set_p.bind(*leaves, collection=collection, path=tuple(path), tree=tree)


def bind_draw(stream: str, aval: Any) -> Any:
    return rng_draw_p.bind(stream=stream, aval=aval)


def leaf_aval(x: Any) -> Any:
    """The aval a variable leaf has in the IR (weak types dropped: stored values are strong)."""
    aval = _jax.get_aval(x)
    return aval.update(weak_type=False) if getattr(aval, "weak_type", False) else aval
