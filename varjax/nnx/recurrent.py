"""flax.nnx's ``RNN``, which scans a recurrent cell over a sequence, and ``Bidirectional``.

``RNN`` runs its cell under ``nnx.compat.scan`` exactly as flax.nnx does: the cell is
carried through the loop whole (``state_axes``, default ``StateAxes({...: nnx.Carry})``),
except the RNG streams ``broadcast_rngs`` selects, which are broadcast to every step after
``nnx.split_rngs(splits=1, squeeze=True)`` gives them a fresh key per call.  The first carry
is drawn outside the loop from the RNN's own ``carry`` stream (``rngs=True``: a stream of
seed 0, as flax.nnx's; an ``nnx.Rngs``: its ``carry`` stream forked), so the same seed gives
flax.nnx's carry, outputs and stream counts.  Reversal keeps padding at the end
(``functional.recurrent.flip_sequences``, shared with ``varjax.nn``); with ``seq_lengths``
and ``return_carry`` the carry is each sequence's own last (``select_last_carry``).

The cells are in ``recurrent_cells`` and re-exported here, where flax.nnx keeps them.
"""
from __future__ import annotations

import logging
from typing import Callable, Mapping, Protocol

import jax
import jax.numpy as jnp

from varjax.functional.recurrent import flip_sequences as flip_sequences
from varjax.functional.recurrent import select_last_carry
from varjax.ir import errors
from varjax.ir.typing import Filter, PyTree
from varjax.nnx import compat
from varjax.nnx.filterlib import All
from varjax.nnx.iteration import Carry as CarryAxis
from varjax.nnx.module import Module
from varjax.nnx.pytree import data
from varjax.nnx.recurrent_cells import GRUCell as GRUCell
from varjax.nnx.recurrent_cells import LSTMCell as LSTMCell
from varjax.nnx.recurrent_cells import OptimizedLSTMCell as OptimizedLSTMCell
from varjax.nnx.recurrent_cells import RNNCellBase as RNNCellBase
from varjax.nnx.recurrent_cells import SimpleCell as SimpleCell
from varjax.nnx.recurrent_cells import modified_orthogonal as modified_orthogonal
from varjax.nnx.rnglib import split_rngs
from varjax.nnx.state_axes import StateAxes
from varjax.nnx.variablelib import RngState
from varjax.trace.rngs import Rngs, RngStream

__all__ = ["RNNCellBase", "LSTMCell", "OptimizedLSTMCell", "GRUCell", "SimpleCell", "RNN",
           "RNNBase", "Bidirectional", "flip_sequences", "modified_orthogonal"]

Array = jax.Array
Carry = PyTree
Output = PyTree
_log = logging.getLogger(__name__)


def _carry_stream(rngs: Rngs | RngStream | bool, layer: str, *, takes_stream: bool
                  ) -> RngStream | None:
    """The stream a layer keeps for initial carries, from its ``rngs=`` (flax.nnx's rules:
    ``True`` a new stream of seed 0 tagged ``carry``, an ``Rngs`` its ``carry`` stream forked,
    ``False`` none; ``Bidirectional`` also keeps a stream given as is)."""
    if rngs is True:
        return RngStream(0, tag="carry")
    if rngs is False:
        return data(None)
    if isinstance(rngs, Rngs):
        return rngs.carry.fork()
    if takes_stream and isinstance(rngs, RngStream):
        return rngs
    error = errors.ConfigError if not takes_stream else errors.InvalidVariablesError
    raise error(f"{layer}'s rngs must be an nnx.Rngs"
                f"{', an RngStream' if takes_stream else ''} or a bool, got "
                f"{type(rngs).__name__}.", path=("rngs",), **errors.where(),
                fix=f"pass rngs=nnx.Rngs(carry=...), or True/False, to {layer}")


class RNN(Module):
    """Applies ``cell`` over the time axis of ``inputs``, ``[*batch, time, *features]``
    (``[time, *batch, *features]`` with ``time_major``); the outputs keep that layout.

    ``reverse`` runs from the last valid step to the first and, unless ``keep_order``,
    returns outputs in processing order; ``seq_lengths`` (``[batch]``) marks padding at the
    end of each sequence.  Declares nothing but the cell and its carry stream; scans with
    ``nnx.compat.scan`` (module docstring).
    """

    def __init__(self, cell: RNNCellBase, *, time_major: bool = False,
                 return_carry: bool = False, reverse: bool = False, keep_order: bool = False,
                 unroll: int = 1, state_axes: Mapping[Filter, int | type | None] | None = None,
                 broadcast_rngs: Filter = None, rngs: Rngs | RngStream | bool = True):
        self.cell = cell
        self.time_major, self.return_carry = time_major, return_carry
        self.reverse, self.keep_order, self.unroll = reverse, keep_order, unroll
        self.rngs = _carry_stream(rngs, "RNN", takes_stream=False)
        self.state_axes = state_axes or StateAxes({...: CarryAxis})
        self.broadcast_rngs = broadcast_rngs

    def __call__(self, inputs: Array, *, initial_carry: Carry | None = None,
                 seq_lengths: Array | None = None, return_carry: bool | None = None,
                 time_major: bool | None = None, reverse: bool | None = None,
                 keep_order: bool | None = None, rngs: Rngs | RngStream | None = None
                 ) -> Output | tuple[Carry, Output]:
        return_carry = self.return_carry if return_carry is None else return_carry
        time_major = self.time_major if time_major is None else time_major
        reverse = self.reverse if reverse is None else reverse
        keep_order = self.keep_order if keep_order is None else keep_order

        feature_axes = self.cell.num_feature_axes
        time_axis = 0 if time_major else inputs.ndim - (feature_axes + 1)
        num_batch_dims = inputs.ndim - feature_axes - 1
        if reverse:
            inputs = flip_sequences(inputs, seq_lengths, num_batch_dims, time_major)
        if rngs is None:
            rngs = self.rngs
        if isinstance(rngs, Rngs):
            rngs = rngs.carry.fork()
        carry = initial_carry if initial_carry is not None else self.cell.initialize_carry(
            inputs.shape[:time_axis] + inputs.shape[time_axis + 1:], rngs)

        # With seq_lengths the carry after each sequence's own last step is picked from the
        # per-step carries afterwards, so they are stacked too.
        keep_carries = seq_lengths is not None and return_carry
        state_axes = StateAxes({All(RngState, self.broadcast_rngs): None,
                                **self.state_axes})

        @split_rngs(splits=1, only=self.broadcast_rngs, squeeze=True, graph=True,
                    graph_updates=True)
        @compat.scan(in_axes=(state_axes, CarryAxis, time_axis),
                     out_axes=(CarryAxis, (0, time_axis) if keep_carries else time_axis),
                     unroll=self.unroll)
        def scan_fn(cell: RNNCellBase, carry: Carry, x: Array) -> tuple[Carry, Output]:
            carry, y = cell(carry, x)
            return carry, ((carry, y) if keep_carries else y)

        carry, outputs = scan_fn(self.cell, carry, inputs)
        if keep_carries:
            carries, outputs = outputs
            carry = select_last_carry(carries, seq_lengths)
        if reverse and keep_order:
            outputs = jax.tree.map(
                lambda y: flip_sequences(y, seq_lengths, num_batch_dims, time_major), outputs)
        return (carry, outputs) if return_carry else outputs


class RNNBase(Protocol):
    """What ``Bidirectional`` needs of each direction: ``RNN``'s call signature."""

    def __call__(self, inputs: Array, *, initial_carry: Carry | None = None,
                 rngs: Rngs | RngStream | None = None, seq_lengths: Array | None = None,
                 return_carry: bool | None = None, time_major: bool | None = None,
                 reverse: bool | None = None, keep_order: bool | None = None
                 ) -> Output | tuple[Carry, Output]:
        ...


def _concatenate(a: Array, b: Array) -> Array:
    """Bidirectional's default merge: the two directions' features side by side."""
    return jnp.concatenate([a, b], axis=-1)


class Bidirectional(Module):
    """Runs ``forward_rnn`` over the sequence and ``backward_rnn`` over it reversed (its
    outputs put back in input order, padding kept at the end) and merges the two step by
    step with ``merge_fn`` (default: concatenate the features).  The carry is ``(forward,
    backward)``, and so is ``initial_carry``; both directions draw their first carry from the
    one stream (``rngs``).  Passing the same RNN twice shares its parameters (logged)."""

    def __init__(self, forward_rnn: RNNBase, backward_rnn: RNNBase, *,
                 merge_fn: Callable[[Array, Array], Array] = _concatenate,
                 time_major: bool = False, return_carry: bool = False,
                 rngs: Rngs | RngStream | bool = True):
        self.forward_rnn, self.backward_rnn = forward_rnn, backward_rnn
        self.merge_fn, self.time_major, self.return_carry = merge_fn, time_major, return_carry
        self.rngs = _carry_stream(rngs, "Bidirectional", takes_stream=True)

    def __call__(self, inputs: Array, *, initial_carry: tuple[Carry, Carry] | None = None,
                 rngs: Rngs | RngStream | None = None, seq_lengths: Array | None = None,
                 return_carry: bool | None = None, time_major: bool | None = None,
                 reverse: bool | None = None, keep_order: bool | None = None
                 ) -> Output | tuple[tuple[Carry, Carry], Output]:
        """``reverse`` and ``keep_order`` are taken and ignored (``RNNBase``'s signature):
        each direction has its own."""
        time_major = self.time_major if time_major is None else time_major
        return_carry = self.return_carry if return_carry is None else return_carry
        if rngs is None:
            rngs = self.rngs
        if isinstance(rngs, Rngs):
            rngs = rngs.carry
        forward_carry, backward_carry = initial_carry if initial_carry is not None \
            else (None, None)
        if self.forward_rnn is self.backward_rnn:
            _log.warning("forward_rnn and backward_rnn is the same object, so they will share "
                         "parameters.")
        carry_forward, outputs_forward = self.forward_rnn(
            inputs, initial_carry=forward_carry, rngs=rngs, seq_lengths=seq_lengths,
            return_carry=True, time_major=time_major, reverse=False)
        carry_backward, outputs_backward = self.backward_rnn(
            inputs, initial_carry=backward_carry, rngs=rngs, seq_lengths=seq_lengths,
            return_carry=True, time_major=time_major, reverse=True, keep_order=True)
        outputs = jax.tree.map(self.merge_fn, outputs_forward, outputs_backward)
        return ((carry_forward, carry_backward), outputs) if return_carry else outputs
