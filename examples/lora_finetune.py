"""LoRA fine-tuning through a pass: a char-LM pretrained on code learns prose, its source untouched.

The transformer of ``examples/char_lm.py`` (scan-over-layers of rematerialized blocks) is
pretrained on Python source (the same stdlib modules as there), then fine-tuned on English
prose: the Python Language Reference text that ships with the stdlib as
``pydoc_data/topics.py`` (what ``help('topics')`` shows).  The fine-tune trains low-rank
adapters only, and the model class is imported from ``char_lm`` unchanged: the ``lora``
pass adds ``W + A @ B`` to every matmul kernel it finds in the traced program,

    lora = model.init(key, x, passes="lora{rank=4}")["lora"]        # A random, B = 0
    model.apply({"params": pretrained, "lora": lora}, x, passes="lora{rank=4}")

and ``jax.grad`` with respect to the ``lora`` collection alone trains the adapters while
the pretrained ``params`` stay frozen.  Inside ``nn.scan`` the adapters are stacked per
layer like the kernels they adapt.  Afterwards ``varjax.passes.library.lora.merge`` folds them into
the kernels, and the plain model (no pass) computes what the adapted one does.

The script checks what LoRA promises: the adapters start as the identity (B = 0), the
base parameters are bitwise the same after fine-tuning, and the merged model's validation
loss equals the adapted model's; it exits with status 1 if any fails.  Both corpora use
one byte vocabulary (their union), so one embedding and output layer serve both.

Measured (Python 3.11: 400 KB of code, 400 KB of prose, 109 distinct bytes; steps of 32 x 64
characters; times include compiling; runs are deterministic given ``SEED``):

* Pretraining, all 168,237 parameters, 300 steps (Adam 3e-3): mean train loss 3.02 over
  steps 1-50 -> 2.23 over 251-300; validation loss 2.463 on code, 2.651 on prose.
* LoRA, rank 4 on every matmul kernel (a block's query, key, value, out and two MLP kernels,
  stacked over 3 layers, and the output layer): 14,516 trainable parameters, 8.63% of the
  model; 150 steps (Adam 1e-2): mean train loss 2.54 over steps 1-50 -> 2.44 over
  101-150; prose validation loss 2.651 -> 2.355 (perplexity 14.2 -> 10.5).  On code the
  adapted model does worse (2.611), and without the adapters the base model is exactly
  what it was (2.463): the base parameters are bitwise unchanged.  Merged, the plain
  model's prose loss equals the adapted one's (difference 0).
* The whole run took 220 s (158 s of CPU) on 2 cores heavily shared with other jobs (load
  average 5.6-7): pretraining 109 s, fine-tuning 64 s, about 0.3 s a step once compiled.
  ``char_lm.py``'s numbers, taken on lightly shared cores, give the same train step about
  0.06 s.

Run from the repository root: ``python examples/lora_finetune.py`` (``make lora``);
``--pretrain-steps`` / ``--finetune-steps`` shorten it (the test runs a few of each).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import char_lm
import jax
import jax.numpy as jnp
import numpy as np
import optax
from char_lm import TransformerLM
from common import OUT, plot_losses

from varjax.passes.library.lora import merge

SEED = 0
LORA = "lora{rank=4}"       # the pass's pipeline spelling: adapters of rank 4 on every matmul kernel
PRETRAIN_STEPS = 300
FINETUNE_STEPS = 150
PRETRAIN_LR = 3e-3
FINETUNE_LR = 1e-2           # adapters start at zero and are few: a larger step than pretraining
LOG_EVERY = 50
VAL_WINDOWS = 256            # both validation sets are cut to this many windows: one compile each
PROSE_BYTES = 400_000
SAMPLE_CHARS = 160
PROMPT = "The "
TOLERANCE = 1e-5             # merged vs adapted validation loss (float32)


# --------------------------------------------------------------------------- data

def code_text() -> bytes:
    """The pretraining slice: ``char_lm``'s stdlib modules, cut as there."""
    stdlib = Path(os.__file__).parent
    return b"".join((stdlib / f"{name}.py").read_bytes()
                    for name in sorted(char_lm.MODULES))[:char_lm.CORPUS_BYTES]


def prose_text() -> bytes:
    """The fine-tuning slice: the Language Reference topics that ``pydoc`` shows, by name."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)).encode()[:PROSE_BYTES]


class Slice(char_lm.Corpus):
    """``char_lm.Corpus`` of given bytes over a given vocabulary (shared by both slices).

    ``Corpus`` splits it by chunk into train and validation; its batch, window, encode and
    decode helpers are used as they are."""

    def __init__(self, text: bytes, vocab: np.ndarray, seed: int = SEED):
        super().__init__(seed, text, vocab)

    def val_windows(self) -> np.ndarray:
        return super().val_windows()[:VAL_WINDOWS]


# --------------------------------------------------------------------------- steps

def cross_entropy(model: TransformerLM, variables: dict[str, Any], windows: jax.Array,
                  passes: str = "", key: jax.Array | None = None) -> jax.Array:
    """Mean next-byte cross-entropy (nats); dropout on when ``key`` is given."""
    logits = model.apply(variables, windows[:, :-1], train=key is not None,
                         rngs={} if key is None else {"dropout": key}, passes=passes)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def make_lora_step(model: TransformerLM, optimizer: optax.GradientTransformation) -> Callable:
    """One Adam step on ``variables['lora']``; ``variables['params']`` only pass through."""
    @jax.jit
    def step(variables: dict[str, Any], opt_state: Any, windows: jax.Array,
             key: jax.Array) -> tuple[dict[str, Any], Any, jax.Array]:
        def loss(lora: Any) -> jax.Array:
            return cross_entropy(model, {**variables, "lora": lora}, windows, LORA, key)
        value, grads = jax.value_and_grad(loss)(variables["lora"])
        updates, opt_state = optimizer.update(grads, opt_state, variables["lora"])
        return {**variables, "lora": optax.apply_updates(variables["lora"], updates)}, opt_state, value
    return step


def run_steps(name: str, steps: int, step: Callable, state: Any, opt_state: Any,
              corpus: Slice, key: jax.Array, log_every: int) -> tuple[Any, list[float], float]:
    """``steps`` calls of ``step`` on random train windows, printing the mean loss every
    ``log_every``; returns the final state, every step's loss and the seconds taken."""
    batch_rng = np.random.default_rng(SEED)
    start = window_start = time.perf_counter()
    losses: list[jax.Array] = []
    for i in range(1, steps + 1):
        state, opt_state, loss = step(state, opt_state, corpus.train_batch(batch_rng),
                                      jax.random.fold_in(key, i))
        losses.append(loss)
        if i % log_every == 0 or i == steps:
            recent = losses[-(i % log_every or log_every):]
            mean = float(jnp.mean(jnp.stack(recent)))                   # waits for the steps
            rate = len(recent) / (time.perf_counter() - window_start)
            print(f"[{name}] step {i:4d}  train loss {mean:.4f}  {rate:5.1f} steps/s", flush=True)
            window_start = time.perf_counter()
    return state, [float(v) for v in losses], time.perf_counter() - start


def count(tree: Any) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretrain-steps", type=int, default=PRETRAIN_STEPS)
    parser.add_argument("--finetune-steps", type=int, default=FINETUNE_STEPS)
    parser.add_argument("--log-every", type=int, default=LOG_EVERY)
    parser.add_argument("--sample-chars", type=int, default=SAMPLE_CHARS,
                        help="bytes sampled before and after fine-tuning (0: no samples)")
    parser.add_argument("--result-file", type=Path, help="write the measurements here as JSON")
    parser.add_argument("--plot", type=Path, default=OUT / "lora_finetune_loss.png",
                        help="the loss curves' PNG (needs matplotlib; default: %(default)s)")
    args = parser.parse_args()
    start = time.perf_counter()

    code, prose = code_text(), prose_text()
    vocab = np.array(sorted(set(code) | set(prose)), np.uint8)
    old, new = Slice(code, vocab), Slice(prose, vocab)
    print(f"pretraining slice: {old.size:,} bytes of {len(char_lm.MODULES)} stdlib modules; "
          f"fine-tuning slice: {new.size:,} bytes of pydoc_data/topics.py prose; "
          f"vocabulary {len(vocab)}", flush=True)

    model = TransformerLM(len(vocab))
    init_key, pretrain_key, lora_key, finetune_key, sample_key = jax.random.split(jax.random.key(SEED), 5)
    x = old.train_batch(np.random.default_rng(SEED))[:, :-1]
    evaluate = {passes: jax.jit(lambda v, w, passes=passes: cross_entropy(model, v, w, passes))
                for passes in ("", LORA)}
    old_val, new_val = old.val_windows(), new.val_windows()

    # ---- 1. pretrain every parameter on code, with char_lm's own train step
    params = jax.jit(lambda key: model.init(key, x, train=False))(init_key)["params"]
    optimizer = optax.adam(PRETRAIN_LR)
    params, pre_losses, pre_seconds = run_steps(
        "pretrain", args.pretrain_steps, char_lm.make_train_step(model, optimizer), params,
        optimizer.init(params), old, pretrain_key, args.log_every)
    base = {"params": params}
    base_old, base_new = (float(evaluate[""](base, w)) for w in (old_val, new_val))
    print(f"[pretrain] {args.pretrain_steps} steps in {pre_seconds:.1f} s; validation loss: "
          f"code {base_old:.4f}, prose {base_new:.4f}", flush=True)
    if args.sample_chars:
        text = char_lm.sample(model, params, new, sample_key, args.sample_chars, PROMPT)
        print(f"[pretrain] sample:\n{text}\n", flush=True)

    # ---- 2. fine-tune adapters only, on prose, through the pass
    # A fresh init with the pass: the adapters, beside new params that go unused.
    lora = jax.jit(lambda key: model.init(key, x, train=False, passes=LORA))(lora_key)["lora"]
    n_params, n_lora = count(params), count(lora)
    print(f"trainable parameters: full fine-tune {n_params:,}, LoRA adapters {n_lora:,} "
          f"({n_lora / n_params:.2%} of the model)", flush=True)
    adapted = {"params": params, "lora": lora}
    identity_diff = abs(float(evaluate[LORA](adapted, new_val)) - base_new)
    print(f"adapters at init (B = 0): prose validation loss differs from the base model's by "
          f"{identity_diff:.2g}", flush=True)
    frozen = jax.tree.map(np.array, params)                             # a host copy to compare
    optimizer = optax.adam(FINETUNE_LR)
    adapted, ft_losses, ft_seconds = run_steps(
        "lora", args.finetune_steps, make_lora_step(model, optimizer), adapted,
        optimizer.init(lora), new, finetune_key, args.log_every)
    dropped = {"params": adapted["params"]}
    lora_new, lora_old = (float(evaluate[LORA](adapted, w)) for w in (new_val, old_val))
    dropped_old = float(evaluate[""](dropped, old_val))
    print(f"[lora] {args.finetune_steps} steps in {ft_seconds:.1f} s; prose validation loss "
          f"{base_new:.4f} -> {lora_new:.4f}; code validation loss {base_old:.4f} -> "
          f"{lora_old:.4f} with the adapters, {dropped_old:.4f} without", flush=True)

    # ---- 3. what LoRA promises
    before, after = jax.tree.leaves(frozen), jax.tree.leaves(jax.tree.map(np.asarray, adapted["params"]))
    unchanged = all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(before, after))
    print(f"base params bitwise unchanged after fine-tuning: {'yes' if unchanged else 'NO'}", flush=True)
    merged = merge(adapted)
    merged_new = float(evaluate[""](merged, new_val))
    merge_diff = abs(merged_new - lora_new)
    print(f"merged (no pass) prose validation loss {merged_new:.6f} vs adapted {lora_new:.6f}: "
          f"difference {merge_diff:.2g} (tolerance {TOLERANCE:g})", flush=True)
    if args.sample_chars:
        text = char_lm.sample(model, merged["params"], new, sample_key, args.sample_chars, PROMPT)
        print(f"[lora] sample (merged model):\n{text}\n", flush=True)

    seconds = time.perf_counter() - start
    ok = unchanged and merge_diff <= TOLERANCE and identity_diff <= TOLERANCE
    if args.result_file:
        args.result_file.write_text(json.dumps({
            "params": n_params, "lora": n_lora, "pretrain_losses": pre_losses,
            "finetune_losses": ft_losses,
            "code_val": {"base": base_old, "adapted": lora_old, "dropped": dropped_old},
            "prose_val": {"base": base_new, "adapted": lora_new, "merged": merged_new},
            "identity_diff": identity_diff, "merge_diff": merge_diff, "params_unchanged": unchanged,
            "seconds": {"pretrain": pre_seconds, "finetune": ft_seconds, "total": seconds}}))
    # The fine-tune's curve continues the pretraining's on one step axis.
    plot_losses("lora_finetune", {"pretrain (code, all params)": pre_losses,
                                  "LoRA fine-tune (prose, adapters)": [np.nan] * len(pre_losses) + ft_losses},
                args.plot)
    print(f"lora_finetune: {'OK' if ok else 'FAILED'}: prose validation loss {base_new:.3f} -> "
          f"{lora_new:.3f} training {n_lora:,} of {n_params:,} parameters, in {seconds:.1f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
