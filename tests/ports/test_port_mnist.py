"""Port of Flax's MNIST example: a small CNN (conv, batch norm, dropout, average pooling,
two dense layers), written once as ``build(nn)`` and checked against ``flax.linen``.

Flax's current example is written in NNX; this is its architecture in Linen form, as a user
keeping a Linen codebase would write it.  Small config: 8x8 images, 4/8 channels.
"""
import jax
import jax.numpy as jnp
import optax
from port_checks import DROPOUT, KEY, Port, check_apply, check_init, check_train, normal, perturb


def build(nn):
    class CNN(nn.Module):
        """conv-bn-dropout-relu-pool, conv-bn-relu-pool, dense-dropout-relu, dense."""
        channels: tuple = (4, 8)
        hidden: int = 16
        classes: int = 10
        rate: float = 0.25

        @nn.compact
        def __call__(self, x, train: bool):
            def pool(y):
                # Linen's avg_pool divides by an int count, which the suite's strict
                # promotion (tests/conftest.py) rejects; the example runs unstrict.
                with jax.numpy_dtype_promotion("standard"):
                    return nn.avg_pool(y, window_shape=(2, 2), strides=(2, 2))

            x = nn.Conv(self.channels[0], kernel_size=(3, 3))(x)
            x = nn.Dropout(self.rate, deterministic=not train)(x)
            x = pool(nn.relu(nn.BatchNorm(use_running_average=not train)(x)))
            x = nn.Conv(self.channels[1], kernel_size=(3, 3))(x)
            x = pool(nn.relu(nn.BatchNorm(use_running_average=not train)(x)))
            x = x.reshape((x.shape[0], -1))
            x = nn.Dense(self.hidden)(x)
            x = nn.relu(nn.Dropout(self.rate, deterministic=not train)(x))
            return nn.Dense(self.classes)(x)

    return CNN


IMAGES = normal((2, 8, 8, 1))
LABELS = jnp.asarray([3, 7], jnp.int32)


def _loss(result):
    logits, _ = result
    return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()


def test_mnist_cnn_init_eval_train_and_grads_equal_linen():
    port = Port(build)
    variables = perturb(check_init(port, KEY, IMAGES, train=False))
    check_apply(port, variables, IMAGES, train=False)
    check_train(port, variables, _loss, IMAGES, train=True, rngs=DROPOUT, mutable=["batch_stats"])
