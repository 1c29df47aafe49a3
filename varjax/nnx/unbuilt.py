"""The flax.nnx names ``varjax.nnx`` has not built yet, and why each is missing.

Each name resolves (``nnx.jit``, ``from varjax.nnx import split``) to ``NotProvidedError``
saying which part of the NNX frontend it belongs to, rather than ``AttributeError``: ported
code fails at the line that asks for it, with the reason.  A name leaves this table when it
is built; ``tests/nnx/test_nnx_names.py`` compares the table with ``dir(flax.nnx)``.
"""
from __future__ import annotations

from typing import NoReturn

from varjax.trace.unprovided import not_provided

__all__ = ["NOT_YET", "missing"]

_PARTS = {
    "one of flax.nnx's internal submodules; varjax.nnx keeps the same roles in its own "
    "modules (pytree, module, variablelib, graphlib, training) and has no trace-level checks, "
    "deprecation shims, summary tables or notebook visualisation": (
        "object", "pytreelib", "reprlib", "tracers", "helpers", "summary",
        "visualization", "deprecations", "wrappers"),
}

NOT_YET: dict[str, str] = {
    **{name: why for why, names in _PARTS.items() for name in names},
}


def missing(name: str, module: str) -> NoReturn:
    """``NotProvidedError`` for a name of ``NOT_YET``, else ``AttributeError``.  Only
    names that are not submodules get here: a submodule (``varjax.nnx.graph``) is imported
    by the package's ``__getattr__`` before it asks."""
    if name in NOT_YET:
        not_provided(f"nnx.{name}", f"not built yet: it is {NOT_YET[name]}.",
                     "see notes/nnx.md for what varjax.nnx has now", by="varjax.nnx")
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
