"""``RNN``, which scans a recurrent cell over a sequence, and ``Bidirectional``, as in Linen.

``RNN`` runs the cell under the lifted ``nn.scan``, with Linen's fields and
defaults: ``variable_broadcast='params'`` (one set of cell parameters shared by
every step, created at init by a peeled first step), ``split_rngs={'params':
False}`` (every other stream is broadcast too: one dropout mask for all steps
unless the stream is split), ``variable_axes`` and ``variable_carry``.

The cells are in ``varjax.nn.recurrent_cells`` and re-exported here, where
Linen keeps them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol

import jax
import jax.numpy as jnp

from varjax.functional.recurrent import flip_sequences as flip_sequences
from varjax.functional.recurrent import select_last_carry
from varjax.ir.typing import CollectionFilter
from varjax.nn.module import Module
from varjax.nn.recurrent_cells import ConvLSTMCell as ConvLSTMCell
from varjax.nn.recurrent_cells import DenseParams as DenseParams
from varjax.nn.recurrent_cells import GRUCell as GRUCell
from varjax.nn.recurrent_cells import LSTMCell as LSTMCell
from varjax.nn.recurrent_cells import MGUCell as MGUCell
from varjax.nn.recurrent_cells import OptimizedLSTMCell as OptimizedLSTMCell
from varjax.nn.recurrent_cells import RNNCellBase as RNNCellBase
from varjax.nn.recurrent_cells import SimpleCell as SimpleCell
from varjax.nn.typing import Carry as Carry
from varjax.nn.typing import Dtype as Dtype
from varjax.nn.typing import Initializer as Initializer
from varjax.nn.typing import PrecisionLike as PrecisionLike
from varjax.nn.typing import PRNGKey as PRNGKey
from varjax.transforms.loops import scan

__all__ = ["RNNCellBase", "LSTMCell", "OptimizedLSTMCell", "GRUCell", "MGUCell", "SimpleCell",
           "ConvLSTMCell", "RNN", "RNNBase", "Bidirectional", "flip_sequences"]

Array = jax.Array
Output = Any


class RNN(Module):
    """Applies ``cell`` over the time axis of a sequence.

    ``inputs`` is ``[batch..., time, *features]`` (``[time, batch..., *features]``
    with ``time_major``); the outputs keep that layout.  ``reverse`` runs from
    the last step to the first and returns outputs in processing order unless
    ``keep_order``.  ``seq_lengths`` (``[batch]``) marks padding at the end of
    each sequence: reversing keeps padding at the end, and with
    ``return_carry`` the carry is the one after each sequence's last valid
    step.  Outputs at padded positions are not zeroed.

    ``__call__``'s ``return_carry``, ``time_major``, ``reverse`` and
    ``keep_order`` override the fields for one call.  Without
    ``initial_carry`` the carry comes from ``cell.initialize_carry(init_key)``,
    with ``jax.random.key(0)`` when ``init_key`` is not given either.
    """

    cell: RNNCellBase
    """The recurrent cell applied at each step (an ``RNNCellBase``)."""
    time_major: bool = False
    """Whether time is the first axis of the inputs (``[time, batch, ...]``) rather than the one
    after the batch axes."""
    return_carry: bool = False
    """Whether to return ``(carry, outputs)`` rather than the outputs alone."""
    reverse: bool = False
    """Whether to run over the sequence from its end."""
    keep_order: bool = False
    """With ``reverse``, whether to return the outputs in the input's order rather than
    reversed."""
    unroll: int = 1
    """How many steps each loop iteration runs (``jax.lax.scan``'s ``unroll``)."""
    variable_axes: Mapping[Any, int] = dataclasses.field(default_factory=dict)
    """Collections whose variables have one slice per step, and the axis it is on
    (``nn.scan``'s)."""
    variable_broadcast: CollectionFilter = "params"
    """Collections shared by every step (``nn.scan``'s; ``params`` by default)."""
    variable_carry: CollectionFilter = False
    """Collections carried from one step to the next (``nn.scan``'s)."""
    split_rngs: Mapping[Any, bool] = dataclasses.field(default_factory=lambda: {"params": False})
    """RNG streams split per step (``nn.scan``'s; ``params`` is not, so every step has the same
    parameters)."""

    def __call__(self, inputs: Array, *, initial_carry: Carry | None = None, init_key: Array | None = None,
                 seq_lengths: Array | None = None, return_carry: bool | None = None,
                 time_major: bool | None = None, reverse: bool | None = None,
                 keep_order: bool | None = None) -> Output | tuple[Carry, Output]:
        return_carry = self.return_carry if return_carry is None else return_carry
        time_major = self.time_major if time_major is None else time_major
        reverse = self.reverse if reverse is None else reverse
        keep_order = self.keep_order if keep_order is None else keep_order

        time_axis = 0 if time_major else inputs.ndim - self.cell.num_feature_axes - 1
        num_batch_dims = inputs.ndim - self.cell.num_feature_axes - 1
        if reverse:
            inputs = flip_sequences(inputs, seq_lengths, num_batch_dims, time_major)
        if initial_carry is None:
            step_shape = inputs.shape[:time_axis] + inputs.shape[time_axis + 1:]
            initial_carry = self.cell.initialize_carry(
                jax.random.key(0) if init_key is None else init_key, step_shape)

        # With seq_lengths the carry after each sequence's own last step is
        # picked from the per-step carries afterwards, so they are kept too.
        keep_carries = seq_lengths is not None and return_carry

        def step(cell: RNNCellBase, carry: Carry, x: Array) -> tuple[Carry, Any]:
            carry, y = cell(carry, x)
            return carry, ((carry, y) if keep_carries else y)

        # The lifted scan, as in Linen: by default the cell's params are broadcast (created
        # by a peeled first step at init) and its RNG streams are not split.
        carry, ys = scan(step, variable_axes=self.variable_axes,
                         variable_broadcast=self.variable_broadcast,
                         variable_carry=self.variable_carry, split_rngs=self.split_rngs,
                         unroll=self.unroll)(self.cell, initial_carry,
                                             jnp.moveaxis(inputs, time_axis, 0))

        if keep_carries:
            carries, ys = ys
            carry = select_last_carry(carries, seq_lengths)
        outputs = jax.tree.map(lambda y: jnp.moveaxis(y, 0, time_axis), ys)
        if reverse and keep_order:
            outputs = jax.tree.map(lambda y: flip_sequences(y, seq_lengths, num_batch_dims, time_major),
                                   outputs)
        return (carry, outputs) if return_carry else outputs


class RNNBase(Protocol):
    """What ``Bidirectional`` needs of each direction: ``RNN``'s call signature."""

    def __call__(self, inputs: Array, *, initial_carry: Carry | None = None, init_key: PRNGKey | None = None,
                 seq_lengths: Array | None = None, return_carry: bool | None = None,
                 time_major: bool | None = None, reverse: bool | None = None,
                 keep_order: bool | None = None) -> Output | tuple[Carry, Output]:
        ...


def _concatenate(a: Array, b: Array) -> Array:
    return jnp.concatenate([a, b], axis=-1)


class Bidirectional(Module):
    """Runs ``forward_rnn`` over the sequence and ``backward_rnn`` over it reversed, and merges
    the two outputs step by step with ``merge_fn`` (default: concatenate the features).

    The backward outputs are put back in input order before the merge (padding
    given by ``seq_lengths`` stays at the end).  The carry is ``(forward,
    backward)``, and so is ``initial_carry``; ``init_key`` is split between the
    directions.  Passing the same RNN object twice shares its parameters.
    """

    forward_rnn: RNNBase
    """The ``RNN`` run over the sequence forwards."""
    backward_rnn: RNNBase
    """The ``RNN`` run over the sequence backwards."""
    merge_fn: Callable[[Array, Array], Array] = _concatenate
    """Combines the two directions' outputs (concatenation on the last axis by default)."""
    time_major: bool = False
    """Whether time is the first axis of the inputs (``[time, batch, ...]``) rather than the one
    after the batch axes."""
    return_carry: bool = False
    """Whether to return ``(carry, outputs)`` rather than the outputs alone."""

    def __call__(self, inputs: Array, *, initial_carry: Carry | None = None, init_key: PRNGKey | None = None,
                 seq_lengths: Array | None = None, return_carry: bool | None = None,
                 time_major: bool | None = None, reverse: bool | None = None,
                 keep_order: bool | None = None) -> Output | tuple[Carry, Output]:
        time_major = self.time_major if time_major is None else time_major
        return_carry = self.return_carry if return_carry is None else return_carry
        keys = (None, None) if init_key is None else tuple(jax.random.split(init_key))
        carries = (None, None) if initial_carry is None else initial_carry
        carry_forward, outputs_forward = self.forward_rnn(
            inputs, initial_carry=carries[0], init_key=keys[0], seq_lengths=seq_lengths, return_carry=True,
            time_major=time_major, reverse=False)
        carry_backward, outputs_backward = self.backward_rnn(
            inputs, initial_carry=carries[1], init_key=keys[1], seq_lengths=seq_lengths, return_carry=True,
            time_major=time_major, reverse=True, keep_order=True)
        carry = (carry_forward, carry_backward)
        outputs = jax.tree.map(self.merge_fn, outputs_forward, outputs_backward)
        return (carry, outputs) if return_carry else outputs
