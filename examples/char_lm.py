"""Character-level language models on Python's own standard library, two ways.

The corpus is built at run time from ``.py`` files that ship with Python (a fixed,
sorted list of modules, cut at 400 KB), so nothing is downloaded.  Two models are
written with ``varjax.nn`` exactly as they would be in Flax Linen:

* **LSTM** — ``Embed -> nn.scan(LSTM cell) -> Dense``.  The scan is the lifted scan
  written out: the cell's parameters are broadcast to every step
  (``variable_broadcast='params'``) and the ``recurrent_dropout`` RNG stream is not
  split, so every step draws the *same* key and the hidden state gets one dropout
  mask for the whole sequence (variational / Gal & Ghahramani recurrent dropout).
* **Transformer** — a small decoder-only transformer (pre-LayerNorm blocks with
  causal ``SelfAttention`` and an MLP) whose blocks are stacked with scan-over-layers,
  ``nn.scan(nn.remat(Block), variable_axes={'params': 0}, split_rngs={'params':
  True, 'dropout': True}, length=n_layers)``: one block traced once, its parameters
  stacked on a leading layer axis, each layer with its own init and dropout keys,
  and its activations recomputed in the backward pass.

Each is trained with Optax Adam in a ``jax.jit`` step on random 64-character
windows, evaluated on a held-out split, and asked to continue ``def ``.

Measured (Python 3.11 stdlib: 400 KB, 96 distinct bytes; 500 steps of 32 x 64
characters each; 2 CPU cores, lightly shared; the times include compiling the train
step; the same run took 93 s in all on busier cores):

* LSTM (222k parameters): validation perplexity 96.1 untrained -> 6.27, 22 s.
* Transformer (3 layers, d=64, 167k parameters): 118 untrained -> 8.91, 30 s.

Mean train loss over steps 1-100 vs 401-500: 2.78 -> 1.58 (LSTM), 2.83 -> 2.03
(transformer).  The whole script took 64 s.  Runs are deterministic given ``SEED``.

Run from the repository root: ``python examples/char_lm.py``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import plot_losses

import varjax.nn as nn

SEED = 0
CORPUS_BYTES = 400_000
CHUNK = 2048              # the train/validation split is by chunk, so windows never straddle it
VAL_FRACTION = 0.1
SEQ_LEN = 64
BATCH = 32
STEPS = 500
LOG_EVERY = 100
SAMPLE_CHARS = 200
TEMPERATURE = 0.8
PROMPT = "def "

# A fixed list of ordinary, hand-written modules (no generated files like _sysconfigdata).
MODULES = ("abc", "argparse", "ast", "base64", "bisect", "calendar", "colorsys", "contextlib",
           "copy", "csv", "dataclasses", "difflib", "enum", "fnmatch", "fractions", "functools")


# --------------------------------------------------------------------------- data

class Corpus:
    """Bytes of stdlib sources (or of ``text``) as token ids, split by chunk into train and
    validation.

    Bytes rather than characters keep the vocabulary small and every file decodable;
    the vocabulary is only the byte values that occur.
    """

    def __init__(self, seed: int = SEED, text: bytes | None = None, vocab: np.ndarray | None = None):
        if text is None:         # the stdlib modules; other text (another slice) may be given
            stdlib = Path(os.__file__).parent
            text = b"".join((stdlib / f"{name}.py").read_bytes() for name in sorted(MODULES))[:CORPUS_BYTES]
        self.vocab = np.array(sorted(set(text)), np.uint8) if vocab is None else vocab
        lookup = np.zeros(256, np.int32)
        lookup[self.vocab] = np.arange(len(self.vocab))
        ids = lookup[np.frombuffer(text, np.uint8)]
        chunks = ids[: len(ids) // CHUNK * CHUNK].reshape(-1, CHUNK)
        order = np.random.default_rng(seed).permutation(len(chunks))
        n_val = int(round(len(chunks) * VAL_FRACTION))
        self.val, self.train = chunks[order[:n_val]], chunks[order[n_val:]]
        self.size = len(text)

    def encode(self, s: str) -> list[int]:
        """Token ids of ``s``'s UTF-8 bytes (each must occur in the corpus)."""
        return [int(np.searchsorted(self.vocab, b)) for b in s.encode()]

    def decode(self, ids: list[int]) -> str:
        """Text of token ids; a sample may split a multi-byte character, hence ``replace``."""
        return bytes(self.vocab[ids]).decode("utf-8", errors="replace")

    def train_batch(self, rng: np.random.Generator) -> np.ndarray:
        """``BATCH`` random windows of ``SEQ_LEN + 1`` tokens (inputs and shifted targets)."""
        rows = rng.integers(0, len(self.train), BATCH)
        starts = rng.integers(0, CHUNK - SEQ_LEN, BATCH)
        return self.train[rows[:, None], starts[:, None] + np.arange(SEQ_LEN + 1)]

    def val_windows(self) -> np.ndarray:
        """Every non-overlapping window of the validation chunks: a fixed evaluation set."""
        per_chunk = CHUNK // (SEQ_LEN + 1)
        return self.val[:, : per_chunk * (SEQ_LEN + 1)].reshape(-1, SEQ_LEN + 1)


# --------------------------------------------------------------------------- models

class DropoutLSTMCell(nn.Module):
    """One LSTM step whose incoming hidden state goes through recurrent dropout.

    The mask comes from the ``recurrent_dropout`` stream, which the enclosing scan
    does not split, so it is the same at every step.
    """

    features: int
    rate: float
    deterministic: bool

    @nn.compact
    def __call__(self, carry: tuple[jax.Array, jax.Array],
                 x: jax.Array) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        c, h = carry
        h = nn.Dropout(self.rate, rng_collection="recurrent_dropout")(h, deterministic=self.deterministic)
        return nn.LSTMCell(self.features)((c, h), x)


class LSTMLM(nn.Module):
    """Embed -> scanned ``DropoutLSTMCell`` over the time axis (axis 1) -> Dense to logits."""

    vocab_size: int
    embed: int = 64
    hidden: int = 192
    dropout: float = 0.1

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool) -> jax.Array:
        x = nn.Embed(self.vocab_size, self.embed)(tokens)                  # [batch, time, embed]
        scanned = nn.scan(DropoutLSTMCell, variable_broadcast="params",
                          split_rngs={"params": False, "recurrent_dropout": False},
                          in_axes=1, out_axes=1)
        zeros = jnp.zeros((tokens.shape[0], self.hidden), x.dtype)
        _, h = scanned(self.hidden, self.dropout, deterministic=not train, name="lstm")((zeros, zeros), x)
        h = nn.Dropout(self.dropout)(h, deterministic=not train)
        return nn.Dense(self.vocab_size)(h)


class Block(nn.Module):
    """A pre-LayerNorm transformer block; ``(x) -> (x, None)``, the scan-over-layers body."""

    d_model: int
    heads: int
    dropout: float
    deterministic: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
        mask = nn.make_causal_mask(x[..., 0])
        h = nn.SelfAttention(self.heads, dropout_rate=self.dropout)(
            nn.LayerNorm()(x), mask=mask, deterministic=self.deterministic)
        x = x + nn.Dropout(self.dropout)(h, deterministic=self.deterministic)
        h = nn.Dense(4 * self.d_model)(nn.LayerNorm()(x))
        h = nn.Dense(self.d_model)(nn.gelu(h))
        return x + nn.Dropout(self.dropout)(h, deterministic=self.deterministic), None


class TransformerLM(nn.Module):
    """Token + learned position embeddings -> ``layers`` scanned, rematerialized blocks -> logits."""

    vocab_size: int
    d_model: int = 64
    heads: int = 4
    layers: int = 3
    dropout: float = 0.1

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool) -> jax.Array:
        positions = jnp.arange(tokens.shape[-1])
        x = nn.Embed(self.vocab_size, self.d_model)(tokens) + nn.Embed(SEQ_LEN, self.d_model)(positions)
        x = nn.Dropout(self.dropout)(x, deterministic=not train)
        blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                         split_rngs={"params": True, "dropout": True}, length=self.layers)
        x, _ = blocks(self.d_model, self.heads, self.dropout, deterministic=not train, name="blocks")(x)
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


# --------------------------------------------------------------------------- steps

def cross_entropy(model: nn.Module, params: Any, windows: jax.Array, train: bool,
                  key: jax.Array | None = None) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of ``windows[:, :-1]`` predicting ``windows[:, 1:]``.

    Both dropout streams are drawn from ``key``; the transformer simply never asks
    for ``recurrent_dropout``.
    """
    rngs = {} if key is None else dict(zip(("dropout", "recurrent_dropout"), jax.random.split(key)))
    logits = model.apply({"params": params}, windows[:, :-1], train=train, rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation) -> Callable:
    @jax.jit
    def train_step(params: Any, opt_state: Any, windows: jax.Array,
                   key: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(cross_entropy, argnums=1)(model, params, windows, True, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step


def make_eval(model: nn.Module) -> Callable:
    """Cross-entropy with dropout off, on the whole validation set in one call."""
    return jax.jit(lambda params, windows: cross_entropy(model, params, windows, train=False))


def make_next_token(model: nn.Module) -> Callable:
    """One sampling step on a fixed ``SEQ_LEN`` window (so it compiles once).

    Both models are causal, so the logits at ``pos`` depend only on ``window[:pos+1]``
    and whatever fills the rest of the window does not matter.
    """
    @jax.jit
    def next_token(params: Any, window: jax.Array, pos: jax.Array, key: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, window[None], train=False)[0, pos]
        return jax.random.categorical(key, logits / TEMPERATURE)
    return next_token


def sample(model: nn.Module, params: Any, corpus: Corpus, key: jax.Array,
           chars: int = SAMPLE_CHARS, prompt: str = PROMPT) -> str:
    """``prompt`` continued by ``chars`` bytes, each drawn at ``TEMPERATURE``."""
    next_token = make_next_token(model)
    ids = corpus.encode(prompt)
    for step_key in jax.random.split(key, chars):
        context = ids[-SEQ_LEN:]
        window = np.zeros(SEQ_LEN, np.int32)
        window[: len(context)] = context
        ids.append(int(next_token(params, window, len(context) - 1, step_key)))
    return corpus.decode(ids)


def train(name: str, model: nn.Module, corpus: Corpus, lr: float,
          curves: dict[str, np.ndarray] | None = None) -> tuple[float, float]:
    """Trains ``model`` for ``STEPS`` steps, then evaluates and samples it.

    Returns the validation perplexity and the training time (compiling included); with
    ``curves``, also puts the training loss of every step in ``curves[name]``.
    """
    key = jax.random.key(SEED)
    init_key, dropout_key, sample_key = jax.random.split(key, 3)
    batch_rng = np.random.default_rng(SEED)
    params = model.init(init_key, corpus.train_batch(batch_rng)[:, :-1], train=False)["params"]
    n_params = sum(p.size for p in jax.tree.leaves(params))
    optimizer = optax.adam(lr)
    opt_state = optimizer.init(params)
    train_step, evaluate = make_train_step(model, optimizer), make_eval(model)
    val = corpus.val_windows()
    print(f"[{name}] {n_params:,} parameters; validation perplexity before training "
          f"{np.exp(float(evaluate(params, val))):.2f}", flush=True)

    start = window_start = time.perf_counter()
    losses, history = [], []
    for step in range(1, STEPS + 1):
        params, opt_state, loss = train_step(params, opt_state, corpus.train_batch(batch_rng),
                                             jax.random.fold_in(dropout_key, step))
        losses.append(loss)
        if step % LOG_EVERY == 0:
            mean = float(jnp.mean(jnp.stack(losses)))
            rate = LOG_EVERY * BATCH * SEQ_LEN / (time.perf_counter() - window_start)
            print(f"[{name}] step {step:4d}  loss {mean:.4f}  perplexity {np.exp(mean):7.2f}  "
                  f"{rate:,.0f} chars/s", flush=True)
            history += losses
            losses, window_start = [], time.perf_counter()
    seconds = time.perf_counter() - start
    if curves is not None:
        curves[name] = np.asarray(jnp.stack(history + losses))
    val_ppl = float(np.exp(float(evaluate(params, val))))
    print(f"[{name}] validation perplexity {val_ppl:.2f} ({len(val)} windows)", flush=True)
    print(f"[{name}] sample:\n{sample(model, params, corpus, sample_key)}\n", flush=True)
    return val_ppl, seconds


def main() -> None:
    corpus = Corpus()
    print(f"corpus: {corpus.size:,} bytes of {len(MODULES)} stdlib modules, vocabulary "
          f"{len(corpus.vocab)}, {len(corpus.train)} train / {len(corpus.val)} validation chunks "
          f"of {CHUNK}", flush=True)
    results, curves = {}, {}
    for name, model, lr in (("lstm", LSTMLM(len(corpus.vocab)), 3e-3),
                            ("transformer", TransformerLM(len(corpus.vocab)), 3e-3)):
        results[name] = train(name, model, corpus, lr, curves)
    for name, (val_ppl, seconds) in results.items():
        print(f"char_lm[{name}]: val perplexity {val_ppl:.2f} after {STEPS} steps in {seconds:.1f} s")
    plot_losses("char_lm", curves)


if __name__ == "__main__":
    main()
