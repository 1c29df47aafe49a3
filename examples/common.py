"""What the examples share: the digits data, minibatches, and the progress line.

scikit-learn ships the UCI digits (1,797 8x8 grey images, 10 classes) inside the
package, so the examples need no download.  The split is fixed (seeded), so every
run of every example sees the same train and test sets.
"""
from __future__ import annotations

import time
from typing import Iterator

import numpy as np
from sklearn.datasets import load_digits  # the examples extra; never a varjax dependency


def digits(test_fraction: float = 0.2, seed: int = 0):
    """``(x_train, y_train, x_test, y_test)``: images as float32 ``(n, 8, 8, 1)`` in
    ``[0, 1]``, labels as int32, split with a seeded permutation."""
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[..., None]
    y = data.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def batches(n: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Index arrays of one shuffled epoch; the last partial batch is dropped, so every
    batch has the same shape and the jitted step compiles once."""
    order = rng.permutation(n)
    for start in range(0, n - batch_size + 1, batch_size):
        yield order[start:start + batch_size]


class Progress:
    """Prints one line per epoch: loss, accuracy and training throughput."""

    def __init__(self, name: str):
        self.name = name
        self.start = time.perf_counter()
        self.epoch_start = self.start

    def epoch(self, epoch: int, loss: float, examples: int, **metrics: float) -> None:
        now = time.perf_counter()
        rate = examples / (now - self.epoch_start)
        shown = "  ".join(f"{k} {v:.2%}" if k.endswith("acc") else f"{k} {v:.4g}"
                          for k, v in metrics.items())
        print(f"[{self.name}] epoch {epoch:2d}  loss {loss:.4f}  {shown}  {rate:,.0f} examples/s",
              flush=True)
        self.epoch_start = now

    def elapsed(self) -> float:
        return time.perf_counter() - self.start
