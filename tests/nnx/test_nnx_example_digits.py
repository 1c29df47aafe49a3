"""``make nnx`` keeps working: ``examples/nnx_digits.py`` trains briefly and learns, and prints
its block's IR with the batch-statistics writes.  The full run (15 epochs, and the same program
on flax.nnx beside it) is ``make nnx``; ``tests/nnx/test_nnx_programs.py`` checks that the two
libraries train NNX programs the same, step by step."""
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import nnx_digits  # noqa: E402


@pytest.fixture(autouse=True)
def default_promotion():
    # The example is user code: JAX's default promotion, which Optax's Adam relies on.
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def test_nnx_digits_cnn_is_well_above_chance_after_one_epoch_and_shows_its_ir(capsys):
    result = nnx_digits.train(epochs=1, quiet=True)
    assert result["test_acc"] > 0.6          # chance is 0.1; a full run reaches 99.4%
    assert result["losses"].shape == (22,)   # 1,438 training images in batches of 64
    nnx_digits.show_ir(result["model"], jax.numpy.ones((2, 8, 8, 1)))
    ir = capsys.readouterr().out
    assert "var_get[params:block/conv/kernel]" in ir
    assert "var_set[batch_stats:block/norm/mean]" in ir
