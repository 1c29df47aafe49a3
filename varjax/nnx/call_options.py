"""Call arguments of NNX layers: modes (a call argument or the module's attribute), and
``out_sharding``, which is not built.

``Dropout(deterministic=...)`` and ``BatchNorm(use_running_average=...)`` keep a mode as an
attribute (which ``Module.train()``/``eval()`` set) that a call argument overrides; when
neither is given the layer cannot guess, so it says which option is missing.
"""
from __future__ import annotations

from typing import Any

from varjax.ir import errors
from varjax.trace.unprovided import not_provided

__all__ = ["first_from", "no_out_sharding"]


def first_from(*options: Any, name: str, fix: str) -> Any:
    """The first of ``options`` that is not None (the call argument, then the attribute),
    else ``ConfigError`` (a ``ValueError``, as NNX raises) naming ``name``."""
    for option in options:
        if option is not None:
            return option
    raise errors.ConfigError(f"no `{name}` was given: neither at the call nor as the "
                             "module's attribute.", path=(name,), **errors.where(), fix=fix)


def no_out_sharding(layer: str, out_sharding: Any, *, name: str = "out_sharding") -> None:
    """NNX's ``out_sharding`` call argument places the output on a mesh; not built here.
    ``name`` is the argument's name where a layer calls it otherwise (``qkv_sharding``)."""
    if out_sharding is not None:
        not_provided(f"{layer}(..., {name}=...)",
                     "placing a layer's output by a call argument is not built yet.",
                     f"leave {name}=None and constrain the result with "
                     "jax.lax.with_sharding_constraint", by="varjax.nnx")
