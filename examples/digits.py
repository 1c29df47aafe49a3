"""A small CNN on scikit-learn's 8x8 digits, written as a Flax Linen user would write it.

The model is ordinary Linen code with ``import varjax.nn as nn``: two ``ConvBlock``s
(Conv -> BatchNorm -> relu -> max_pool), then Dense -> Dropout -> Dense.  Training is the
usual Linen loop: one ``jax.jit`` step over the variables dict, ``batch_stats`` mutable,
an explicit dropout key per step, Optax ``adam``.  Evaluation uses the running averages
and no dropout.

Measured (2 CPU cores, seed 0, 15 epochs): 98.89% test accuracy in 9.2 s, about 18,000
examples/s once compiled; most of the time is start-up and the first epoch's compilation
(its examples/s counts the compile).  Seeds 1-3 give 98.89-99.16%.

Run: ``python examples/digits.py`` from the repository root (or ``make digits``).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import Progress, batches, digits, plot_losses

import varjax.nn as nn

BATCH_SIZE = 64


class ConvBlock(nn.Module):
    """Conv -> BatchNorm -> relu -> 2x2 max pool: the unit the demo prints the IR of."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = nn.Conv(self.features, (3, 3), use_bias=False)(x)   # BatchNorm's bias replaces it
        # momentum 0.9, not Linen's 0.99: an epoch is only 22 steps, and the running
        # averages must have caught up with the weights by the time we evaluate.
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.max_pool(nn.relu(x), (2, 2), strides=(2, 2))


class CNN(nn.Module):
    """8x8x1 -> 4x4x32 -> 2x2x64 -> 128 -> 10 logits."""

    dropout_rate: float = 0.3

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        x = ConvBlock(32)(x, train)
        x = ConvBlock(64)(x, train)
        x = nn.relu(nn.Dense(128)(x.reshape((x.shape[0], -1))))
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(10)(x)


def make_steps(model: CNN, tx: optax.GradientTransformation) -> tuple[Callable, Callable]:
    """The jitted train and eval steps.  Both take the whole variables dict, as Linen code
    does; only ``params`` is differentiated, ``batch_stats`` comes back as an update."""

    @jax.jit
    def train_step(variables: dict, opt_state: Any, x: jax.Array, y: jax.Array,
                   key: jax.Array) -> tuple[dict, Any, jax.Array, jax.Array]:
        def loss_fn(params: dict) -> tuple[jax.Array, tuple[jax.Array, dict]]:
            logits, updates = model.apply({**variables, "params": params}, x, train=True,
                                          mutable=["batch_stats"], rngs={"dropout": key})
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss, (logits, updates)

        (loss, (logits, updates)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            variables["params"])
        steps, opt_state = tx.update(grads, opt_state, variables["params"])
        variables = {"params": optax.apply_updates(variables["params"], steps), **updates}
        return variables, opt_state, loss, jnp.sum(jnp.argmax(logits, -1) == y)

    @jax.jit
    def accuracy(variables: dict, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = model.apply(variables, x, train=False)
        return jnp.mean(jnp.argmax(logits, -1) == y)

    return train_step, accuracy


def train(epochs: int = 15, seed: int = 0, quiet: bool = False) -> dict:
    """Trains from scratch; returns ``{'test_acc', 'seconds', 'variables', 'losses'}`` (the
    training loss of every step).

    Everything random comes from ``seed`` (init, shuffling, dropout), so a run is
    reproducible.  Dropout keys are ``fold_in(dropout_key, step)``: one key per step
    without carrying a key through the loop.
    """
    start = time.perf_counter()
    x_train, y_train, x_test, y_test = digits()
    model = CNN()
    init_key, dropout_key = jax.random.split(jax.random.key(seed))
    variables = model.init(init_key, x_train[:1])
    tx = optax.adam(2e-3)
    opt_state = tx.init(variables["params"])
    train_step, accuracy = make_steps(model, tx)
    shuffle = np.random.default_rng(seed)
    progress = Progress("digits")
    step, history = 0, []
    for epoch in range(1, epochs + 1):
        losses, correct, seen = [], 0, 0
        for idx in batches(len(y_train), BATCH_SIZE, shuffle):
            key = jax.random.fold_in(dropout_key, step)
            variables, opt_state, loss, hits = train_step(variables, opt_state, x_train[idx],
                                                          y_train[idx], key)
            losses.append(loss)
            correct += hits
            seen += len(idx)
            step += 1
        history += losses
        test_acc = float(accuracy(variables, x_test, y_test))
        if not quiet:
            progress.epoch(epoch, float(jnp.mean(jnp.stack(losses))), seen,
                           train_acc=float(correct) / seen, test_acc=test_acc)
    return {"test_acc": test_acc, "seconds": time.perf_counter() - start, "variables": variables,
            "losses": np.asarray(jnp.stack(history))}


def main() -> None:
    result = train()
    print(f"digits: test accuracy {result['test_acc']:.2%} in {result['seconds']:.1f} s")
    plot_losses("digits", {"CNN": result["losses"]}, log_y=True)


if __name__ == "__main__":
    main()
