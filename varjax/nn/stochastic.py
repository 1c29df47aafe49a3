"""``Dropout``: zeroes a random fraction ``rate`` of its input during training.

Kept entries are scaled by ``1 / (1 - rate)`` so the expected output equals
the input, which is why evaluation (``deterministic=True``) can return the
input unchanged.  The mask is drawn from the ``'dropout'`` RNG stream
(``rng_collection``): apply with ``rngs={'dropout': key}``.

With the same ``rngs`` keys the masks are Linen's bit for bit (Linen's key
derivation, ``notes/randomness.md``); with a ``vj.Rngs`` they follow NNX's.

The mask itself is ``varjax.functional.dropout``'s, given the key drawn here.

Sharp edges:
  * ``broadcast_dims`` shares one mask entry along those axes (e.g. the time
    axis, for the same mask at every step).
"""
from __future__ import annotations

from typing import Sequence

import jax

from varjax.functional.stochastic import dropout
from varjax.nn.dtypes import merge_param
from varjax.nn.module import Module, compact

__all__ = ["Dropout"]


class Dropout(Module):
    """Randomly zeroes inputs with probability ``rate`` unless ``deterministic``.

    ``deterministic`` is given as a field or as a call argument, not both
    (see ``merge_param``).  A key passed as ``rng`` is used instead of drawing
    from ``rng_collection``.
    """

    rate: float
    """The probability of zeroing an element."""
    broadcast_dims: Sequence[int] = ()
    """Axes along which the same mask is used (the mask has size 1 there)."""
    deterministic: bool | None = None
    """If true, no dropout; may be given to the call instead (``merge_param``)."""
    rng_collection: str = "dropout"
    """The RNG stream the mask is drawn from."""

    @compact
    def __call__(self, inputs: jax.Array, deterministic: bool | None = None,
                 rng: jax.Array | None = None) -> jax.Array:
        deterministic = merge_param("deterministic", self.deterministic, deterministic)
        if deterministic or self.rate == 0.0:
            return inputs
        if rng is None and self.rate != 1.0:    # rate 1 zeroes everything and draws nothing
            rng = self.make_rng(self.rng_collection)
        return dropout(inputs, self.rate, rng, broadcast_dims=self.broadcast_dims)
