"""Port of Flax's VAE example: an MLP encoder to a mean and log-variance, the
reparameterization trick with a key passed in as an argument, an MLP decoder, and a
``generate`` method; submodules made in ``setup``.  Small config: 12 inputs, 8 hidden,
3 latents.
"""
import jax
import jax.numpy as jnp
import optax
from port_checks import Port, check_apply, check_init, check_train, normal, perturb


def build(nn):
    class Encoder(nn.Module):
        hidden: int
        latents: int

        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(self.hidden, name="fc1")(x))
            return (nn.Dense(self.latents, name="fc2_mean")(x),
                    nn.Dense(self.latents, name="fc2_logvar")(x))

    class Decoder(nn.Module):
        hidden: int
        outputs: int

        @nn.compact
        def __call__(self, z):
            z = nn.relu(nn.Dense(self.hidden, name="fc1")(z))
            return nn.Dense(self.outputs, name="fc2")(z)

    class VAE(nn.Module):
        hidden: int = 8
        latents: int = 3
        outputs: int = 12

        def setup(self):
            self.encoder = Encoder(self.hidden, self.latents)
            self.decoder = Decoder(self.hidden, self.outputs)

        def __call__(self, x, z_rng):
            mean, logvar = self.encoder(x)
            eps = jax.random.normal(z_rng, logvar.shape)
            z = mean + eps * jnp.exp(0.5 * logvar)
            return self.decoder(z), mean, logvar

        def generate(self, z):
            return nn.sigmoid(self.decoder(z))

    return VAE


X = jax.nn.sigmoid(normal((4, 12)))
Z_RNG = jax.random.key(2, impl="rbg")


def _loss(result):
    logits, mean, logvar = result
    bce = optax.sigmoid_binary_cross_entropy(logits, X).sum(-1).mean()
    kld = -0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar), -1).mean()
    return bce + kld


def test_vae_init_outputs_generate_and_grads_equal_linen():
    port = Port(build)
    # The default (threefry) key, as users pass it; the other ports use RBG keys, which
    # XLA:CPU compiles about twice as fast, with the same derivation.
    variables = perturb(check_init(port, jax.random.key(0), X, Z_RNG))
    # No dropout or batch norm: the training step's forward pass is the eval output.
    check_apply(port, variables, normal((4, 3), seed=3), method="generate")
    check_train(port, variables, _loss, X, Z_RNG)
