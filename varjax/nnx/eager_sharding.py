"""``nnx.use_eager_sharding``/``nnx.using_eager_sharding``: flax.nnx's switch for placing a
Variable on the mesh when it is made, from its ``out_sharding``.

varjax never places a Variable when it is made: a Variable's ``out_sharding`` is metadata
that the ``shard-variables`` pass reads inside a transform (a model built under
``nnx.jit`` with ``jax.set_mesh`` is sharded there).  So eager sharding is always off, and
this is flax.nnx's switch with that one position: ``use_eager_sharding(False)`` is
accepted in flax.nnx's three forms (a call, a ``with`` block, a decorator), which ported
code uses to make Variables with ``out_sharding`` without a mesh; ``True`` is refused with
``NotProvidedError``.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

from varjax.trace.unprovided import not_provided

__all__ = ["use_eager_sharding", "using_eager_sharding"]

F = TypeVar("F", bound=Callable[..., Any])


class use_eager_sharding:  # noqa: N801  (flax.nnx's name)
    """Eager sharding off (``False``); ``True`` is not provided (module docstring)."""

    def __init__(self, value: bool, /) -> None:
        if value is not False:
            not_provided(f"nnx.use_eager_sharding({value!r})",
                         "varjax does not place a Variable on the mesh when it is made; its "
                         "out_sharding is placed by the shard-variables pass inside a "
                         "transform.", "build the model inside nnx.jit under jax.set_mesh(mesh)",
                         by="varjax.nnx")

    def __enter__(self) -> use_eager_sharding:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __call__(self, f: F) -> F:
        return f


def using_eager_sharding() -> bool:
    """Whether Variables are placed on the mesh when made: never, in varjax."""
    return False
