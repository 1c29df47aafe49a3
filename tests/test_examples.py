"""The examples keep working: each one's training code runs briefly and learns.

The full runs and their numbers are ``make digits`` / ``make ensemble`` / ``make char_lm``
(README); here each trains for a moment, so an API change that breaks an example fails CI.
The examples are user code and run under JAX's default promotion rules (standard dtype
promotion, which Optax's Adam relies on; implicit rank broadcasting), not under the suite's
strict ones.
"""
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import char_lm  # noqa: E402
import digits  # noqa: E402
import ensemble  # noqa: E402


@pytest.fixture(autouse=True)
def default_promotion():
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def test_digits_cnn_is_well_above_chance_after_one_epoch():
    result = digits.train(epochs=1, quiet=True)
    assert result["test_acc"] > 0.6          # chance is 0.1; a full run reaches 98.9%
    assert set(result["variables"]) == {"params", "batch_stats"}


def test_ensemble_members_differ_and_their_average_beats_the_mean_member_after_one_epoch():
    result = ensemble.train(ensemble.Ensemble(), epochs=1)
    members = result["member_acc"]
    assert len(members) == 8 and len(set(members)) > 1    # own initialisations: members differ
    assert result["ensemble_acc"] > np.mean(members) > 0.2


@pytest.mark.parametrize("name", ["lstm", "transformer"])
def test_char_lm_loss_falls_within_a_few_steps(name, monkeypatch):
    monkeypatch.setattr(char_lm, "CORPUS_BYTES", 30_000)
    monkeypatch.setattr(char_lm, "STEPS", 20)
    monkeypatch.setattr(char_lm, "LOG_EVERY", 20)
    monkeypatch.setattr(char_lm, "SAMPLE_CHARS", 8)
    corpus = char_lm.Corpus()
    model = {"lstm": char_lm.LSTMLM, "transformer": char_lm.TransformerLM}[name](len(corpus.vocab))
    val_ppl, _ = char_lm.train(name, model, corpus, 3e-3)
    assert np.isfinite(val_ppl) and val_ppl < len(corpus.vocab)   # better than uniform
