"""Port of Flax's seq2seq example (learning addition): an LSTM encoder run by ``nn.RNN``
with per-example sequence lengths and ``return_carry=True``, and an LSTM decoder cell (an
``RNNCellBase`` subclass) run by ``nn.RNN`` with ``split_rngs={'params': False, 'lstm':
True}``, which samples each next token with ``make_rng('lstm')`` and feeds it back unless
teacher forcing.

Small config: vocabulary 6, hidden size 8, inputs of 5 steps, outputs of 4.  As in the
example, the decoder cell is given the one-hot width (6) as its feature count while its
carry, the encoder's, has the hidden size (8): Linen's ``LSTMCell`` sizes its hidden
layers from the carry, and so must varjax's.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from port_checks import KEY, Port, check_init, check_train, perturb


def build(nn):
    class DecoderLSTMCell(nn.RNNCellBase):
        features: int
        teacher_force: bool
        vocab_size: int

        @nn.compact
        def __call__(self, carry, x):
            lstm_state, last_prediction = carry
            if not self.teacher_force:
                x = last_prediction
            lstm_state, y = nn.LSTMCell(self.features)(lstm_state, x)
            logits = nn.Dense(self.vocab_size)(y)
            token = jax.random.categorical(self.make_rng("lstm"), logits)
            prediction = jax.nn.one_hot(token, self.vocab_size, dtype=jnp.float32)
            return (lstm_state, prediction), (logits, prediction)

        @property
        def num_feature_axes(self) -> int:
            return 1

    class Seq2seq(nn.Module):
        teacher_force: bool
        hidden_size: int = 8
        vocab_size: int = 6
        eos_id: int = 1

        @nn.compact
        def __call__(self, encoder_inputs, decoder_inputs):
            encoder = nn.RNN(nn.LSTMCell(self.hidden_size), return_carry=True, name="encoder")
            decoder = nn.RNN(DecoderLSTMCell(decoder_inputs.shape[-1], self.teacher_force,
                                             self.vocab_size),
                             split_rngs={"params": False, "lstm": True}, name="decoder")
            lengths = jnp.argmax(jnp.argmax(encoder_inputs, -1) == self.eos_id, axis=-1)
            encoder_state, _ = encoder(encoder_inputs, seq_lengths=lengths)
            return decoder(decoder_inputs[:, :-1],
                           initial_carry=(encoder_state, decoder_inputs[:, 0]))

    return Seq2seq


def _one_hot(ids):
    return jax.nn.one_hot(jnp.asarray(ids, jnp.int32), 6, dtype=jnp.float32)


ENCODER_IN = _one_hot([[2, 3, 4, 1, 0], [5, 2, 1, 0, 0]])
DECODER_IN = _one_hot(np.random.default_rng(0).integers(2, 6, (2, 4)))
LSTM = {"lstm": jax.random.key(3, impl="rbg")}


def _loss(result):
    logits, _ = result
    return optax.softmax_cross_entropy(logits, DECODER_IN[:, 1:]).mean()


def test_seq2seq_init_sampling_and_grads_equal_linen():
    # Without teacher forcing, each sampled token is the next step's input: a draw that
    # differs from Linen's changes the whole rest of the output.
    port = Port(build, teacher_force=False)
    rngs = {"params": KEY, **LSTM}
    variables = perturb(check_init(port, rngs, ENCODER_IN, DECODER_IN))
    check_train(port, variables, _loss, ENCODER_IN, DECODER_IN, rngs=LSTM)
