"""``nnx.Dropout``: a declaration over ``varjax.functional.stochastic.dropout``.

NNX's Dropout forks its own stream at construction (one draw from ``rngs[rng_collection]``)
and draws each mask's key from it, so masks follow the layer, not the order of calls
elsewhere; the same seed gives flax.nnx's masks bit for bit.  The forked stream is held
bare at ``rngs`` (state ``rngs/key``, ``rngs/count``), as NNX holds it: a bare
``RngStream`` is an object-mode node (``varjax.objects.nodes``), so under a transform its
count is written back and each call draws a fresh mask.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax

from varjax.functional.stochastic import dropout
from varjax.ir import errors
from varjax.nnx.call_options import first_from
from varjax.nnx.module import Module
from varjax.nnx.pytree import data
from varjax.trace.rngs import Rngs, RngStream

__all__ = ["Dropout"]


def _bad_rngs(rngs: Any, what: str) -> errors.ConfigError:
    return errors.ConfigError(f"Dropout's rngs must be {what}, got {type(rngs).__name__}.",
                              path=("rngs",), **errors.where(),
                              fix="pass rngs=nnx.Rngs(...), one of its streams, or a key")


class Dropout(Module):
    """Zeroes a random fraction ``rate`` of the input and scales the rest by
    ``1 / (1 - rate)``, unless ``deterministic`` (``Module.eval()`` sets it)."""

    def __init__(self, rate: float, *, broadcast_dims: Sequence[int] = (),
                 deterministic: bool | None = False, rng_collection: str = "dropout",
                 rngs: Rngs | RngStream | None = None):
        self.rate, self.broadcast_dims = rate, broadcast_dims
        self.deterministic, self.rng_collection = deterministic, rng_collection
        if isinstance(rngs, Rngs):
            rngs = rngs[rng_collection]
        if isinstance(rngs, RngStream):
            self.rngs = rngs.fork()
        elif rngs is None:
            self.rngs = data(None)
        else:
            raise _bad_rngs(rngs, "an nnx.Rngs, an RngStream or None")

    def set_view(self, deterministic: bool | None = None) -> None:
        """What ``nnx.view(model, deterministic=...)`` sets on this layer of the copy
        (``nnx.view_info`` prints the ``Args:`` below, flax.nnx's text).

        Args:
          deterministic: if True, disables dropout masking.
        """
        if deterministic is not None:
            self.deterministic = deterministic

    def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None,
                 rngs: Rngs | RngStream | jax.Array | None = None) -> jax.Array:
        deterministic = first_from(
            deterministic, self.deterministic, name="deterministic",
            fix="pass deterministic= to Dropout or its call, or call model.train()/eval()")
        if deterministic or self.rate == 0.0:
            return inputs
        key = None
        if self.rate != 1.0:   # rate 1 gives zeros without drawing, as NNX
            key = self._key(first_from(
                rngs, self.rngs, name="rngs",
                fix="pass rngs= to Dropout (nnx.Dropout(rate, rngs=rngs)) or to its call"))
        return dropout(inputs, self.rate, key, broadcast_dims=self.broadcast_dims)

    def _key(self, rngs: Rngs | RngStream | jax.Array) -> jax.Array:
        if isinstance(rngs, Rngs):
            return rngs[self.rng_collection]()
        if isinstance(rngs, RngStream):
            return rngs()
        if isinstance(rngs, jax.Array):
            return rngs
        raise _bad_rngs(rngs, "an nnx.Rngs, an RngStream or a key")
