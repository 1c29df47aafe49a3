"""``nnx.bridge``: ``varjax.nn`` (Linen) and ``varjax.nnx`` (NNX) modules inside each other,
as ``flax.nnx.bridge`` (Flax's "Use Flax NNX and Linen together" guide).

``ToNNX(linen_module, rngs=...)`` + ``lazy_init`` put a Linen module in an NNX model;
``ToLinen``/``to_linen`` put an NNX class in a Linen model; ``bridge.variables`` maps a
Linen collection to the NNX Variable type registered for it and back.  This package is the
one place that imports both frontends (``tests/test_layering.py``).

Not built: ``bridge.Module`` and what serves it (``Scope``, ``AttrPriority``, ``compact``,
``current_context``, ``current_module``, ``nnx_in_bridge_mdl``, ``linen_in_bridge_mdl``),
flax.nnx's third way of writing a module (NNX objects with Linen's ``setup``/``compact``
and scopes), which the guide does not use; each raises ``NotProvidedError``.  The
submodule names ``wrappers``, ``module`` and ``interop`` are flax.nnx's file layout.
"""
from __future__ import annotations

import typing

from varjax.functional import initializers as initializers
from varjax.nnx.bridge import variables as variables
from varjax.nnx.bridge.functional import Functional, functional
from varjax.nnx.bridge.to_linen import ToLinen, to_linen
from varjax.nnx.bridge.to_nnx import ToNNX, lazy_init
from varjax.nnx.bridge.variables import NNXMeta, with_partitioning
from varjax.trace.unprovided import not_provided

__all__ = ["Functional", "NNXMeta", "ToLinen", "ToNNX", "functional", "initializers",
           "lazy_init", "to_linen", "variables", "with_partitioning"]

_BRIDGE_MODULE = ("flax.nnx.bridge.Module, an NNX object written with Linen's setup/compact "
                  "and scopes, and its helpers are not built (the bridge guide does not use "
                  "them)")
NOT_PROVIDED: dict[str, str] = {
    **{name: _BRIDGE_MODULE for name in (
        "Module", "Scope", "AttrPriority", "compact", "current_context", "current_module",
        "nnx_in_bridge_mdl", "linen_in_bridge_mdl", "module", "interop")},
    "wrappers": "it is flax.nnx's file of ToNNX/ToLinen/lazy_init/functional, which "
                "varjax.nnx.bridge exports itself",
}


def __getattr__(name: str) -> typing.Any:
    if name in NOT_PROVIDED:
        not_provided(f"nnx.bridge.{name}", NOT_PROVIDED[name] + ".",
                     "use bridge.ToNNX / bridge.ToLinen (notes/nnx.md, 'The bridge')",
                     by="varjax.nnx")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*__all__, *NOT_PROVIDED})
