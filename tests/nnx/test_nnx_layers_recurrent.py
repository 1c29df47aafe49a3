"""flax.nnx's recurrent layers (``LSTMCell``, ``OptimizedLSTMCell``, ``GRUCell``,
``SimpleCell``, ``RNN``, ``Bidirectional``): the same parameters, carries, outputs and RNG
stream counts as flax.nnx 0.12.8, bit for bit, from the same seeds."""
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.recurrent import (
    RNN,
    Bidirectional,
    GRUCell,
    LSTMCell,
    OptimizedLSTMCell,
    RNNCellBase,
    SimpleCell,
)
from varjax.nnx.stochastic import Dropout

X = jax.random.normal(jax.random.key(1), (2, 3))
XS = jax.random.normal(jax.random.key(2), (2, 4, 3))
LENGTHS = jnp.array([2, 4])
CELLS = {"LSTMCell": LSTMCell, "OptimizedLSTMCell": OptimizedLSTMCell, "GRUCell": GRUCell,
         "SimpleCell": SimpleCell}


def standard(fn):
    """flax.nnx mixes dtypes implicitly, so the oracle runs under standard promotion; ours
    runs under the suite's strict promotion."""
    def call(*args, **kwargs):
        with jax.numpy_dtype_promotion("standard"):
            return fn(*args, **kwargs)
    return call


def _raw(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def same(ours, theirs):
    """Equal pytrees: structure, dtypes and every bit."""
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(_raw(a), _raw(b))


def same_state(ours, theirs):
    """``nnx.state`` of both: the same paths and values (streams' keys and counts too)."""
    mine = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(ours)))
    flax = jax.tree_util.tree_leaves_with_path(flax_nnx.to_pure_dict(flax_nnx.state(theirs)))
    assert [p for p, _ in mine] == [p for p, _ in flax]
    same([v for _, v in mine], [v for _, v in flax])


def both_cells(name, *args, seed=0, **kwargs):
    return (CELLS[name](*args, rngs=nnx.Rngs(seed), **kwargs),
            getattr(flax_nnx, name)(*args, rngs=flax_nnx.Rngs(seed), **kwargs))


# -- cells ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CELLS))
def test_cell_params_carry_and_step_match_flax_nnx(name):
    ours, theirs = both_cells(name, 3, 4)
    same_state(ours, theirs)
    carry = ours.initialize_carry(X.shape, nnx.Rngs(carry=5))
    flax_carry = theirs.initialize_carry(X.shape, flax_nnx.Rngs(carry=5))
    same(carry, flax_carry)
    same(ours(carry, X), theirs(flax_carry, X))
    assert ours.num_feature_axes == theirs.num_feature_axes == 1


@pytest.mark.parametrize("name, kwargs", [
    ("LSTMCell", dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)),
    ("GRUCell", dict(dtype=jnp.float16)),
    ("SimpleCell", dict(residual=True, activation_fn=nnx.relu)),
    ("OptimizedLSTMCell", dict(gate_fn=nnx.hard_sigmoid, activation_fn=nnx.soft_sign,
                               kernel_init=nnx.initializers.ones_init(),
                               bias_init=nnx.initializers.ones_init())),
])
def test_cell_options_match_flax_nnx(name, kwargs):
    ours, theirs = both_cells(name, 3, 4, seed=3, **kwargs)
    same_state(ours, theirs)
    x = X.astype(kwargs.get("dtype", X.dtype))
    carry = theirs.initialize_carry(x.shape, flax_nnx.Rngs(0))
    same(ours(carry, x), standard(theirs)(carry, x))


def test_cell_metadata_reaches_its_linears_as_in_flax_nnx():
    """``kernel_metadata`` goes to the input kernels, ``recurrent_kernel_metadata`` to the
    hidden ones, ``bias_metadata`` to the biases; ``nnx.with_partitioning`` initializers too."""
    def kwargs(nnx_):
        return dict(kernel_init=nnx_.with_partitioning(nnx_.initializers.lecun_normal(),
                                                       (None, "h")),
                    recurrent_kernel_metadata={"out_sharding": ("h", None)},
                    bias_metadata={"out_sharding": ("h",)})

    ours = LSTMCell(3, 4, rngs=nnx.Rngs(0), **kwargs(nnx))
    with jax.set_mesh(jax.make_mesh((1,), ("h",))):   # flax.nnx shards such Params eagerly
        theirs = flax_nnx.LSTMCell(3, 4, rngs=flax_nnx.Rngs(0), **kwargs(flax_nnx))
    for name in ("ii", "hi"):
        for param in ("kernel", "bias"):
            a, b = getattr(getattr(ours, name), param), getattr(getattr(theirs, name), param)
            if b is None:
                assert a is None
            else:
                assert a.out_sharding == b.out_sharding, (name, param)
    assert ours.ii.kernel.out_sharding == (None, "h") and ours.hi.bias.out_sharding == ("h",)


def test_carry_init_at_the_call_or_warned_at_construction_as_flax_nnx():
    normal = nnx.initializers.normal(1.0)
    ours, theirs = both_cells("LSTMCell", 3, 4)
    same(ours.initialize_carry(X.shape, nnx.Rngs(carry=1), carry_init=normal),
         theirs.initialize_carry(X.shape, flax_nnx.Rngs(carry=1), carry_init=normal))
    with pytest.warns(UserWarning, match="carry_init is provided in __init__"):
        ours = GRUCell(3, 4, carry_init=normal, rngs=nnx.Rngs(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = flax_nnx.GRUCell(3, 4, carry_init=normal, rngs=flax_nnx.Rngs(0))
    stream = nnx.Rngs(carry=2).carry     # a stream itself is drawn from directly
    same(ours.initialize_carry(X.shape, stream),
         theirs.initialize_carry(X.shape, flax_nnx.Rngs(carry=2).carry))
    assert int(stream.count[...]) == 1


def test_keep_rngs_keeps_a_forked_carry_stream_as_flax_nnx():
    with pytest.warns(UserWarning, match="keep_rngs argument is deprecated"):
        ours = SimpleCell(3, 4, keep_rngs=True, carry_init=None, rngs=nnx.Rngs(0, carry=4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = flax_nnx.SimpleCell(3, 4, keep_rngs=True, rngs=flax_nnx.Rngs(0, carry=4))
    normal = nnx.initializers.normal(1.0)
    same(ours.initialize_carry(X.shape, carry_init=normal),
         theirs.initialize_carry(X.shape, carry_init=normal))
    same_state(ours, theirs)


def test_initialize_carry_without_rngs_is_a_value_error_naming_rngs():
    cell = LSTMCell(3, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError):
        flax_nnx.LSTMCell(3, 4, rngs=flax_nnx.Rngs(0)).initialize_carry(X.shape)
    with pytest.raises(errors.ConfigError, match="rngs") as caught:
        cell.initialize_carry(X.shape)
    assert isinstance(caught.value, ValueError)
    assert caught.value.path == ("rngs",) and __file__ in caught.value.source


def test_the_base_cell_leaves_its_methods_to_subclasses():
    cell = RNNCellBase()
    with pytest.raises(NotImplementedError):
        cell.initialize_carry((1, 3), nnx.Rngs(0))
    with pytest.raises(NotImplementedError):
        cell.num_feature_axes


# -- RNN --------------------------------------------------------------------------------

def both_rnns(cell="LSTMCell", seed=0, **kwargs):
    ours, theirs = both_cells(cell, 3, 4, seed=seed)
    return (RNN(ours, rngs=nnx.Rngs(carry=7), **kwargs),
            flax_nnx.RNN(theirs, rngs=flax_nnx.Rngs(carry=7), **kwargs))


@pytest.mark.parametrize("cell, options, call", [
    ("LSTMCell", {}, {}),
    ("GRUCell", dict(reverse=True, keep_order=True, return_carry=True),
     dict(seq_lengths=LENGTHS)),
    ("SimpleCell", dict(time_major=True, unroll=2),
     dict(reverse=True, seq_lengths=LENGTHS, return_carry=True)),
])
def test_rnn_over_a_sequence_matches_flax_nnx(cell, options, call):
    ours, theirs = both_rnns(cell, **options)
    same_state(ours, theirs)
    xs = jnp.swapaxes(XS, 0, 1) if options.get("time_major") else XS
    same(ours(xs, **call), theirs(xs, **call))
    same_state(ours, theirs)         # the carry stream drew the same number of keys


def test_rnn_initial_carry_and_call_rngs_match_flax_nnx():
    ours, theirs = both_rnns("OptimizedLSTMCell")
    carry = theirs.cell.initialize_carry((2, 3), flax_nnx.Rngs(carry=3, params=0))
    same(ours(XS, initial_carry=carry, return_carry=True),
         theirs(XS, initial_carry=carry, return_carry=True))
    same(ours(XS, rngs=nnx.Rngs(carry=9)), theirs(XS, rngs=flax_nnx.Rngs(carry=9)))
    same_state(ours, theirs)


def test_rnn_broadcasts_the_recurrent_dropout_stream_as_flax_nnx():
    """flax.nnx's recurrent dropout: one mask for every step (the stream broadcast), a fresh
    one per call (split_rngs(splits=1) draws the stream once)."""
    def model(nnx_, cell_cls, dropout_cls, rnn_cls):
        class DroppedCell(cell_cls):
            def __init__(self, rngs):
                super().__init__(3, 4, rngs=rngs)
                self.drop = dropout_cls(0.5, rng_collection="recurrent", rngs=rngs)

            def __call__(self, carry, x):
                (c, h), _ = super().__call__(carry, x)
                h = self.drop(h)
                return (c, h), h

        return rnn_cls(DroppedCell(nnx_.Rngs(0, recurrent=1)), broadcast_rngs="recurrent",
                       rngs=nnx_.Rngs(carry=2))

    ours = model(nnx, OptimizedLSTMCell, Dropout, RNN)
    theirs = model(flax_nnx, flax_nnx.OptimizedLSTMCell, flax_nnx.Dropout, flax_nnx.RNN)
    for _ in range(2):
        same(ours(XS), theirs(XS))
    same_state(ours, theirs)
    assert int(ours.cell.drop.rngs.count[...]) == 2


def test_rnn_carries_a_cell_holding_its_rngs_as_flax_nnx():
    """A custom cell keeping an ``Rngs`` (flax.nnx's custom-cell test): the whole cell is the
    loop's carry (``StateAxes({...: nnx.Carry})``), so its stream advances once per step."""
    def cell_class(base):
        class Noisy(base):
            def __init__(self, rngs):
                self.rngs = rngs

            def __call__(self, h, x):
                return h, self.rngs.noise.normal(h.shape)

            def initialize_carry(self, input_shape, rngs):
                return jnp.zeros((input_shape[0], 4))

            @property
            def num_feature_axes(self):
                return 1
        return Noisy

    ours = RNN(cell_class(RNNCellBase)(nnx.Rngs(0, noise=1)))
    theirs = flax_nnx.RNN(cell_class(flax_nnx.RNNCellBase)(flax_nnx.Rngs(0, noise=1)))
    same(ours(XS), theirs(XS))
    same_state(ours, theirs)
    assert int(ours.cell.rngs.noise.count[...]) == XS.shape[1]


def test_rnn_rngs_of_another_type_is_flax_nnx_value_error():
    with pytest.raises(ValueError):
        flax_nnx.RNN(flax_nnx.GRUCell(3, 4, rngs=flax_nnx.Rngs(0)), rngs=3)
    with pytest.raises(errors.ConfigError, match="RNN's rngs") as caught:
        RNN(GRUCell(3, 4, rngs=nnx.Rngs(0)), rngs=3)
    assert isinstance(caught.value, ValueError) and __file__ in caught.value.source


def test_rnn_under_nnx_jit_and_nnx_grad_matches_flax_nnx():
    ours, theirs = both_rnns("GRUCell")
    same(nnx.jit(lambda m, x: m(x))(ours, XS), flax_nnx.jit(lambda m, x: m(x))(theirs, XS))
    grads = nnx.grad(lambda m: jnp.sum(m(XS)))(ours)
    flax_grads = flax_nnx.grad(lambda m: jnp.sum(m(XS)))(theirs)
    same(jax.tree.leaves(nnx.to_pure_dict(grads)),
         jax.tree.leaves(flax_nnx.to_pure_dict(flax_grads)))
    same_state(ours, theirs)


def test_cell_under_nnx_vmap_over_inputs_matches_flax_nnx():
    ours, theirs = both_cells("SimpleCell", 3, 4)
    h = jnp.zeros((2, 4))
    step = lambda cell, h, x: cell(h, x)[1]   # noqa: E731
    same(nnx.vmap(step, in_axes=(None, 0, 0))(ours, h, X),
         flax_nnx.vmap(step, in_axes=(None, 0, 0))(theirs, h, X))


# -- Bidirectional ----------------------------------------------------------------------

def test_bidirectional_matches_flax_nnx():
    def layer(nnx_, cells, rnn, bidirectional):
        forward = rnn(cells.GRUCell(3, 4, rngs=nnx_.Rngs(0)), rngs=False)
        backward = rnn(cells.GRUCell(3, 4, rngs=nnx_.Rngs(1)), rngs=False)
        return bidirectional(forward, backward, return_carry=True, rngs=nnx_.Rngs(carry=3))

    import varjax.nnx.recurrent as ours_module
    ours = layer(nnx, ours_module, RNN, Bidirectional)
    theirs = layer(flax_nnx, flax_nnx, flax_nnx.RNN, flax_nnx.Bidirectional)
    same_state(ours, theirs)
    same(ours(XS, seq_lengths=LENGTHS), theirs(XS, seq_lengths=LENGTHS))
    summed = lambda a, b: a + b   # noqa: E731
    ours.merge_fn = theirs.merge_fn = summed
    carries = (jnp.ones((2, 4)), jnp.zeros((2, 4)))
    same(ours(XS, initial_carry=carries, return_carry=False),
         theirs(XS, initial_carry=carries, return_carry=False))
    same_state(ours, theirs)


def test_bidirectional_over_one_rnn_shares_it_and_logs(caplog):
    rnn = RNN(SimpleCell(3, 4, rngs=nnx.Rngs(0)))
    layer = Bidirectional(rnn, rnn, rngs=nnx.Rngs(carry=0).carry)
    with caplog.at_level(logging.WARNING):
        out = layer(XS)
    assert "share parameters" in caplog.text
    assert out.shape == (2, 4, 8)
    same(out[..., :4], rnn(XS))    # zero first carries: the forward pass alone


def test_bidirectional_rngs_of_another_type_is_flax_nnx_type_error():
    flax_rnn = flax_nnx.RNN(flax_nnx.SimpleCell(3, 4, rngs=flax_nnx.Rngs(0)))
    with pytest.raises(TypeError):
        flax_nnx.Bidirectional(flax_rnn, flax_rnn, rngs=3)
    rnn = RNN(SimpleCell(3, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(errors.InvalidVariablesError, match="Bidirectional's rngs") as caught:
        Bidirectional(rnn, rnn, rngs=3)
    assert isinstance(caught.value, TypeError) and __file__ in caught.value.source
