"""Helpers shared by the layers: the dtype a layer computes in, and options
that may be given either as a field or as a call argument.

``canonicalize_dtype``, ``promote_dtype`` and ``cast`` live in
``varjax.functional.dtypes`` (the layer math of both frontends computes with them) and are
re-exported here, where Linen keeps them.  ``merge_param`` is Linen's own: it reports
through the tracing layer's ``site``, which the pure math does not know about.

Sharp edges:
  * ``merge_param`` raises ``VarjaxError`` where Linen raises ``ValueError``.
"""
from __future__ import annotations

from typing import TypeVar

from varjax.functional.dtypes import canonicalize_dtype as canonicalize_dtype
from varjax.functional.dtypes import cast as cast
from varjax.functional.dtypes import promote_dtype as promote_dtype
from varjax.ir import errors
from varjax.nn.typing import Dtype as Dtype
from varjax.trace.context import site

__all__ = ["canonicalize_dtype", "promote_dtype", "merge_param", "cast"]

T = TypeVar("T")


def merge_param(name: str, a: T | None, b: T | None) -> T:
    """The one of ``a`` (a module field) / ``b`` (a call argument) that is not ``None``.

    Options such as ``deterministic`` or ``use_running_average`` can be fixed
    when the module is built or chosen per call.  Giving both would leave one
    silently ignored and giving neither has no sensible default, so both
    raise.
    """
    if a is not None and b is not None:
        raise errors.ConfigError(
            f"'{name}' was given both as a module field and as a call argument.",
            **site(), fix=f"drop '{name}' from the constructor or from the call.")
    if a is None and b is None:
        raise errors.ConfigError(
            f"'{name}' was given neither as a module field nor as a call argument.",
            **site(), fix=f"pass '{name}' to the constructor or to the call.")
    return a if a is not None else b
