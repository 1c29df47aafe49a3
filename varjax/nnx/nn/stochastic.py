"""flax.nnx.nn.stochastic's names: the dropout layer, each ``varjax.nnx``'s own
(``reexport``)."""
from __future__ import annotations

from varjax.nnx.nn.reexport import nnx_name

NAMES = ("Dropout",)
# served by __getattr__ below, so the names are no globals of this module
__all__ = list(NAMES)


def __getattr__(name: str) -> object:
    return nnx_name(__name__, NAMES, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *NAMES})
