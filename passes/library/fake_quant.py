"""fake-quant: compute with parameters rounded to ``bits``-bit integers (simulated).

Quantization-aware training without changing model code.  Every floating ``var_get``
leaf of ``collection`` of rank at least ``min_rank`` -- at any depth, in ``init`` as in
``apply`` -- is replaced by its fake-quantized value::

    scale = max|w| / qmax          qmax = 2**(bits - 1) - 1   (127 for bits=8)
    q(w)  = clip(round(w / scale), -qmax, qmax) * scale

* **Symmetric**, zero point 0, restricted range ``[-qmax, qmax]`` (int8: -127..127, so
  the grid is the same on both sides of zero).
* **Per tensor** by default: one scale for the whole leaf.  ``per_channel=true`` gives
  one scale per output channel, the *last* axis (a ``Dense`` kernel ``[in, out]``, a
  ``Conv`` kernel ``[..., in, out]``); ``max|w|`` is then taken over every other axis.
  A leaf of rank 0 or 1 has one scale either way.
* ``round`` is round-to-nearest, ties to even (``jnp.round``).  A slice that is all
  zeros gets scale 1, so it stays zero instead of dividing by zero.
* ``min_rank=2`` (the default) leaves biases and norm scales in full precision, as
  integer inference keeps them (in 32 bits); ``min_rank=0`` quantizes every leaf.
* **Straight-through estimator**: the value read is ``w + stop_gradient(q(w) - w)``,
  which equals ``q(w)`` while its derivative with respect to ``w`` is the identity, so
  training updates the float parameters as if the rounding were not there.

Stored parameters stay in float; only the computation sees the grid.  Use as
``vj.functionalize(fn, passes="fake-quant{bits=8}")``; ``notes/pass-library.md``
shows the IR.
"""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import jax.numpy as jnp
from jax import lax

from varjax import _jax
from varjax.ir.primitives import var_get_p
from varjax.passes.framework.base import Pass, PassContext, Root, relative_path
from varjax.passes.framework.options import AtLeast, Between, Name, check_collection
from varjax.passes.framework.rewrite import Region, Rule
from varjax.passes.library.stop_gradient import ReadRewriter


def fake_quantize(w: Any, bits: int, per_channel: bool = False) -> Any:
    """``q(w)`` as the module docstring defines it, with a straight-through gradient."""
    qmax = jnp.asarray(2 ** (bits - 1) - 1, w.dtype)
    axes = tuple(range(w.ndim - 1)) if per_channel and w.ndim >= 2 else None
    amax = jnp.max(jnp.abs(w), axis=axes, keepdims=True)
    scale = lax.select(amax > 0, amax / qmax, lax.full_like(amax, 1))
    q = lax.clamp(-qmax, lax.round(w / scale, lax.RoundingMethod.TO_NEAREST_EVEN), qmax) * scale
    return w + lax.stop_gradient(q - w)


@dataclasses.dataclass(frozen=True)
class QuantizeRead(Rule):
    primitive = var_get_p
    collection: str
    bits: int
    per_channel: bool = False
    min_rank: int = 2
    roots: tuple[Root, ...] = ()     # the pass's (``Pass.rooted``)

    def match(self, eqn: _jax.JaxprEqn) -> bool:
        return (eqn.params["collection"] == self.collection
                and relative_path(self.roots, eqn.params["path"]) is not None
                and any(self._quantizes(a) for a in eqn.params["avals"]))

    def _quantizes(self, aval: Any) -> bool:
        return jnp.issubdtype(aval.dtype, jnp.floating) and aval.ndim >= self.min_rank

    def rewrite(self, eqn: _jax.JaxprEqn, invals: list[Any], region: Region) -> list[Any]:
        return [fake_quantize(x, self.bits, self.per_channel) if self._quantizes(a) else x
                for x, a in zip(region.bind(eqn, invals), eqn.params["avals"])]


@dataclasses.dataclass(frozen=True)
class FakeQuant(Pass):
    """Computes with ``collection`` reads rounded to symmetric ``bits``-bit integers
    (``fake-quant{bits=8}``: quantization-aware training; the module docstring gives the
    formula)."""

    name = "fake-quant"
    summary = "compute with `collection` reads rounded to symmetric `bits`-bit integers"
    # In init a parameter is read back after it is created; forward-stores would turn
    # that read into the created value before this pass saw it.
    before = ("forward-stores", "discharge")
    rootable = True
    # Below 2 bits there is no nonzero level; above 16, use floats.
    bits: Annotated[int, Between(2, 16)] = 8
    """Bits of the integer grid, 2 to 16 (``qmax = 2**(bits - 1) - 1``)."""
    per_channel: bool = False
    """One scale per output channel (the last axis) instead of one per tensor."""
    min_rank: Annotated[int, AtLeast(0)] = 2
    """Only leaves of at least this rank are quantized (2: kernels, not biases)."""
    collection: Annotated[str, Name()] = "params"
    """The collection whose reads are quantized."""

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        check_collection(self, "collection", self.collection, jaxpr, ctx)
        rule = QuantizeRead(self.collection, self.bits, self.per_channel, self.min_rank, self.roots)
        return ReadRewriter([rule]).run(jaxpr)
