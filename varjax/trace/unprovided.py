"""What a frontend (``varjax.nn``, ``varjax.nnx``) deliberately does not build, and the
error that says so.

A Flax name a frontend does not implement still exists in it, so that ported code
imports; using it raises ``errors.NotProvidedError`` with the reason and what to use
instead.  It is a ``NotImplementedError`` too, so code that probes for a feature with
``except NotImplementedError`` keeps working.  Both frontends use these two helpers (they
never import each other), naming themselves in ``by``.
"""
from __future__ import annotations

from typing import Any, NoReturn

from varjax.ir import errors
from varjax.trace.context import site

__all__ = ["not_provided", "unprovided_class"]


def not_provided(name: str, why: str, fix: str, *, by: str) -> NoReturn:
    """Raises ``NotProvidedError`` for ``name`` of frontend ``by``, at the user's line."""
    raise errors.NotProvidedError(f"{name} is not provided by {by}: {why}", **site(), fix=fix)


def unprovided_class(name: str, why: str, fix: str, module: str) -> type:
    """A class named ``name`` (in ``module``, whose package names the frontend) that
    raises ``NotProvidedError`` when instantiated.

    So ``nn.<name>`` resolves (imports, ``isinstance``, default field values) and
    only building one fails, at the line that builds it.
    """
    by = ".".join(module.split(".")[:2])

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        not_provided(name, why, fix, by=by)

    return type(name, (), {"__init__": __init__, "__doc__": f"Not provided: {why}",
                           "__module__": module})
