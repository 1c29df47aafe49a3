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

from typing import Iterator, Union

from varjax import _jax

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
