"""What the examples share: the digits data, minibatches, the progress line, loss curves.

scikit-learn ships the UCI digits (1,797 8x8 grey images, 10 classes) inside the
package, so the examples need no download.  The split is fixed (seeded), so every
run of every example sees the same train and test sets.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np


def digits(test_fraction: float = 0.2, seed: int = 0):
    """``(x_train, y_train, x_test, y_test)``: images as float32 ``(n, 8, 8, 1)`` in
    ``[0, 1]``, labels as int32, split with a seeded permutation."""
    # The examples extra; never a varjax dependency.  Imported here: the char-LM examples,
    # which import this module for its plots, need no scikit-learn.
    from sklearn.datasets import load_digits

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


OUT = Path(__file__).resolve().parent / "out"


def plot_losses(name: str, curves: dict[str, Sequence[float]], path: str | Path | None = None,
                xlabel: str = "training step", ylabel: str = "training loss",
                log_y: bool = False) -> Path | None:
    """Draw ``curves`` (label -> loss per step, steps counted from 1) into one PNG with
    matplotlib and print where it went; ``path`` defaults to ``examples/out/<name>_loss.png``.

    Without matplotlib (the ``examples`` extra installs it) this prints a line saying so and
    returns None: the curve is a picture of the run, never a reason for it to fail.
    """
    try:
        import matplotlib
    except ImportError:
        print(f"[{name}] matplotlib is not installed, so no loss curve "
              "(pip install matplotlib, or the examples extra)", flush=True)
        return None
    matplotlib.use("Agg")   # no display needed
    import matplotlib.pyplot as plt

    path = Path(path) if path is not None else OUT / f"{name}_loss.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for label, losses in curves.items():
        ax.plot(np.arange(1, len(losses) + 1), np.asarray(losses, dtype=np.float64),
                label=label, linewidth=1.2)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=f"examples/{name}.py")
    if log_y:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"[{name}] loss curve: {shown(path)}", flush=True)
    return path


def shown(path: Path) -> str:
    """``path`` relative to the current folder (as ``../..`` when outside it)."""
    return os.path.relpath(path)
