"""``nnx.Sequential``: callables applied in order, held in an ``nnx.List``.

The list marks each element data or static by its type when it is put in (a layer is data,
a plain function such as ``nnx.relu`` static), so the layers' Variables are the module's
state at ``layers/<i>/...``, as in flax.nnx, and transforms see them.  Sequential declares
no Variables and calls no ``functional`` math of its own: each element is the layer it is.
"""
from __future__ import annotations

import inspect
from typing import Callable

from varjax.ir import errors
from varjax.ir.typing import PyTree
from varjax.nnx.module import Module
from varjax.nnx.pytree import List
from varjax.trace.rngs import Rngs

__all__ = ["Sequential"]


def _takes_keyword(fn: Callable[..., object], name: str) -> bool:
    """Whether ``fn`` can be given ``name=`` (a keyword or positional-or-keyword
    parameter): only such layers are handed the call's ``rngs``."""
    return any(p.name == name and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in inspect.signature(fn).parameters.values())


def _as_arguments(output: object) -> tuple[tuple, dict[str, PyTree]]:
    """The next element's arguments from the previous one's output: a tuple is spread as
    positional arguments, a dict as keyword arguments, anything else is the one argument."""
    if isinstance(output, tuple):
        return output, {}
    if isinstance(output, dict):
        return (), dict(output)
    return (output,), {}


class Sequential(Module):
    """Applies ``fns`` in order, each to the previous one's output (see ``_as_arguments``).

    ``rngs`` given at the call goes to every element that takes an ``rngs`` keyword.  With
    no elements the call returns its input: the one argument, the tuple of several, the
    keyword arguments' dict, or None.
    """

    def __init__(self, *fns: Callable[..., PyTree]):
        self.layers = List(fns)

    def __call__(self, *args: PyTree, rngs: Rngs | None = None, **kwargs: PyTree) -> PyTree:
        if len(self.layers) == 0:
            return args[0] if len(args) == 1 else args or kwargs or None
        output: object = None
        for i, fn in enumerate(self.layers):
            if not callable(fn):
                raise errors.InvalidVariablesError(
                    f"Sequential: layer {i} is not callable: {fn!r}.", path=("layers", str(i)),
                    **errors.where(), fix="give Sequential only layers and functions")
            if i > 0:
                args, kwargs = _as_arguments(output)
            if rngs is not None and _takes_keyword(fn, "rngs"):
                kwargs = {**kwargs, "rngs": rngs}
            output = fn(*args, **kwargs)
        return output
