"""JAX effects that make variable traffic visible in the IR.

Every variable read or write carries a ``VariableEffect(collection)``, every
RNG draw an ``RngEffect(stream)``.  JAX propagates effects from equations to
their enclosing jaxprs and through every higher-order primitive, so the effect
set on any (sub-)jaxpr header says which collections and streams it touches
without walking it.  Passes use that to skip work: a ``scan`` whose effects
name no collection is bound unchanged.

The effects are registered as allowed in control flow, custom derivatives and
remat, so effectful code stages through ``jax.jit``, ``lax.scan``,
``lax.while_loop``, ``lax.cond``, ``jax.checkpoint`` and ``jax.custom_jvp`` /
``custom_vjp``.  They are deliberately *not* lowerable: a varjax effect that
reaches XLA is a bug (the discharge pass removes them all).

Sharp edges:
  * Effects are unordered: JAX may not reorder equations of a jaxpr, but
    nothing here relies on ordering between different collections.
"""
from __future__ import annotations

import zlib
from typing import Iterable

from varjax import _jax


class _TaggedEffect(_jax.Effect):
    """An effect identified by its class and one name (a collection or a stream)."""

    __slots__ = ("name",)
    label = ""

    def __init__(self, name: str):
        self.name = name

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.name == self.name

    def __hash__(self) -> int:
        # A stable hash (not Python's salted str hash): effect sets then iterate, and jaxprs
        # print their effect headers, in the same order in every process.
        return zlib.crc32(f"{self.label}[{self.name}]".encode())

    def __repr__(self) -> str:
        return f"{self.label}[{self.name}]"


class VariableEffect(_TaggedEffect):
    """The equation reads or writes variables of ``collection``."""

    label = "Var"

    @property
    def collection(self) -> str:
        return self.name


class RngEffect(_TaggedEffect):
    """The equation draws a key from RNG ``stream``."""

    label = "Rng"

    @property
    def stream(self) -> str:
        return self.name


_jax.register_effect_type(VariableEffect)
_jax.register_effect_type(RngEffect)


def is_varjax_effect(effect: object) -> bool:
    return type(effect) in (VariableEffect, RngEffect)


def varjax_effects(effs: Iterable[object]) -> set:
    return {e for e in effs if is_varjax_effect(e)}


def streams_of(effs: Iterable[object]) -> set[str]:
    return {e.stream for e in effs if type(e) is RngEffect}


def strip(effs: Iterable[object]) -> set:
    """The effects that are not varjax's."""
    return {e for e in effs if not is_varjax_effect(e)}
