"""Walking nested jaxprs.

Equations of higher-order primitives hold whole jaxprs in their params:
``scan`` and ``jit`` one ``jaxpr``, ``while`` a ``cond_jaxpr`` and a
``body_jaxpr``, ``cond`` a tuple of ``branches``, remat an *open* ``Jaxpr``
rather than a ``ClosedJaxpr``.  Every check or pass that means "all the
equations" needs this same traversal, so it is written once, here, and finds
sub-jaxprs by type instead of by parameter name: a new higher-order primitive
is walked without being listed anywhere.

Sharp edges:
  * Only params holding a ``Jaxpr``/``ClosedJaxpr``, or a tuple or list of
    them, are seen.  Jaxprs JAX builds lazily behind thunks (``custom_jvp``'s
    jvp rule, ``custom_vjp``'s fwd/bwd) do not exist yet and are not visited.
  * A sub-jaxpr shared by several equations (JAX caches ``jit`` bodies) is
    visited once per equation holding it.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Union

from varjax import _jax
from varjax.primitives import rng_draw_p, var_get_p, var_set_p

AnyJaxpr = Union[_jax.ClosedJaxpr, _jax.Jaxpr]


def subjaxprs(eqn: _jax.JaxprEqn) -> list[AnyJaxpr]:
    """The jaxprs in ``eqn``'s params, in param order, closed or open as stored."""
    found: list[AnyJaxpr] = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (_jax.ClosedJaxpr, _jax.Jaxpr)):
                found.append(item)
    return found


def open_jaxpr(jaxpr: AnyJaxpr) -> _jax.Jaxpr:
    """The open ``Jaxpr`` of either kind: equations and effects live there."""
    return jaxpr.jaxpr if isinstance(jaxpr, _jax.ClosedJaxpr) else jaxpr


def walk_eqns(jaxpr: AnyJaxpr) -> Iterator[tuple[_jax.JaxprEqn, _jax.Jaxpr]]:
    """Every equation, nested ones included, with the open jaxpr holding it.

    Pre-order: an equation comes before the equations of its sub-jaxprs, so a
    check that fails on the outer equation reports the outermost culprit.
    """
    holder = open_jaxpr(jaxpr)
    for eqn in holder.eqns:
        yield eqn, holder
        for sub in subjaxprs(eqn):
            yield from walk_eqns(sub)



def enclosing(jaxpr: AnyJaxpr, target: _jax.JaxprEqn) -> list[_jax.JaxprEqn]:
    """The equations whose bodies hold ``target``, outermost first ([] at top level).

    For error messages: JAX restarts the name stack in every body, so the module scope
    of a nested equation is its enclosing equations' scopes followed by its own (see
    ``errors.enclosing``)."""
    return _chain_to(jaxpr, target) or []


def _chain_to(jaxpr: AnyJaxpr, target: _jax.JaxprEqn) -> list[_jax.JaxprEqn] | None:
    for eqn in open_jaxpr(jaxpr).eqns:
        if eqn is target:
            return []
        for sub in subjaxprs(eqn):
            found = _chain_to(sub, target)
            if found is not None:
                return [eqn, *found]
    return None


def first_variable(jaxprs: Iterable[AnyJaxpr]) -> tuple[str | None, tuple | None]:
    """``(collection, path)`` of the first variable read or written, or ``(stream, None)``
    of the first RNG draw, in ``jaxprs`` (nested bodies included); ``(None, None)`` if
    none.  For error messages about a higher-order equation as a whole."""
    for jaxpr in jaxprs:
        for eqn, _ in walk_eqns(jaxpr):
            if eqn.primitive in (var_get_p, var_set_p):
                return eqn.params["collection"], eqn.params["path"]
            if eqn.primitive is rng_draw_p:
                return eqn.params["stream"], None
    return None, None
