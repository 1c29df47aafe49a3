"""Port of Flax's PPO example's actor-critic: three strided convolutions on uint8 frames
scaled to [0, 1], a shared dense layer, a log-softmax policy head and a value head.
Small config: 24x24x2 frames, 4/8/8 channels, 16 hidden units, 3 actions.
"""
import jax.numpy as jnp
import numpy as np
from port_checks import KEY, Port, check_init, check_train, perturb


def build(nn):
    class ActorCritic(nn.Module):
        num_outputs: int = 3
        channels: tuple = (4, 8, 8)
        hidden: int = 16

        @nn.compact
        def __call__(self, x):
            x = x.astype(jnp.float32) / 255.0
            shapes = (((8, 8), (4, 4)), ((4, 4), (2, 2)), ((3, 3), (1, 1)))
            for i, (features, (kernel, strides)) in enumerate(zip(self.channels, shapes)):
                x = nn.relu(nn.Conv(features, kernel, strides, name=f"conv{i + 1}",
                                    dtype=jnp.float32)(x))
            x = x.reshape((x.shape[0], -1))
            x = nn.relu(nn.Dense(self.hidden, name="hidden", dtype=jnp.float32)(x))
            logits = nn.Dense(self.num_outputs, name="logits", dtype=jnp.float32)(x)
            value = nn.Dense(1, name="value", dtype=jnp.float32)(x)
            return nn.log_softmax(logits), value

    return ActorCritic


FRAMES = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24, 24, 2)), jnp.uint8)
ACTIONS = jnp.asarray([0, 2], jnp.int32)
RETURNS = jnp.asarray([[0.5], [-1.0]], jnp.float32)


def _loss(result):
    log_probs, value = result
    chosen = jnp.take_along_axis(log_probs, ACTIONS[:, None], axis=1)
    return -jnp.mean(chosen) + jnp.mean(jnp.square(value - RETURNS))


def test_ppo_actor_critic_init_outputs_and_grads_equal_linen():
    port = Port(build)
    variables = perturb(check_init(port, KEY, FRAMES))
    # No dropout or batch norm: the training step's forward pass is the eval output.
    check_train(port, variables, _loss, FRAMES)
