"""``Sequential``: layers applied one after another, as in Linen.

Modules in ``layers`` become submodules named ``layers_0``, ``layers_1``, ...
(the field name and the index), so parameter paths match Linen's.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from varjax.nn.module import Module, compact

__all__ = ["Sequential"]


class Sequential(Module):
    """Calls ``layers[0](*args, **kwargs)``, then feeds each output to the next layer.

    A ``tuple`` output is passed on as positional arguments and a ``dict`` as
    keyword arguments, so layers with several inputs and outputs chain without
    glue code.  ``layers`` may mix modules and plain functions (``nn.relu``,
    or a lambda building a module from the input's shape, which is why the
    call is ``compact``).
    """

    layers: Sequence[Callable[..., Any]]
    """The callables applied in order, each to the previous one's output."""

    def __post_init__(self) -> None:
        if not isinstance(self.layers, Sequence):
            raise ValueError(f"'layers' must be a sequence, got {type(self.layers).__name__!r}")
        super().__post_init__()

    @compact
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.layers:
            raise ValueError(f"Sequential module {self.name!r} has no layers")
        outputs = self.layers[0](*args, **kwargs)
        for layer in self.layers[1:]:
            if isinstance(outputs, tuple):
                outputs = layer(*outputs)
            elif isinstance(outputs, dict):
                outputs = layer(**outputs)
            else:
                outputs = layer(outputs)
        return outputs
