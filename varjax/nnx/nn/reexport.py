"""How ``varjax.nnx.nn``'s submodules hold their names: each is ``varjax.nnx``'s own.

``flax.nnx.nn.linear.Linear is flax.nnx.Linear``; so here each submodule lists the names
flax.nnx 0.12.8's submodule of that name exports, and looks each up on ``varjax.nnx`` when
it is first asked for.  The layers live in modules named for what they hold (``linear``,
``convolution``, ``lora``...), not in flax's file layout, and the lookup keeps one place,
``varjax.nnx``'s exports, that says where each is; a name not built yet raises the
``NotProvidedError`` ``varjax.nnx`` raises for it.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["nnx_name"]


def nnx_name(module: str, names: Sequence[str], name: str) -> object:
    """``varjax.nnx.<name>`` for a submodule ``module`` whose names are ``names`` (its
    ``__getattr__``); any other name is an ``AttributeError``."""
    if name not in names:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    # At call time: varjax.nnx is imported before any of its submodules runs.
    from varjax import nnx
    return getattr(nnx, name)
