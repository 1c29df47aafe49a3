"""``examples/lora_finetune.py``: LoRA through the pass fine-tunes adapters only, and merges.

The script runs as a subprocess, as a user runs it, with a few steps of each phase (pretrain
on code, fine-tune adapters on prose) and no samples; ``make lora`` is the full run.  The XLA
flags lower the CPU optimization level, which roughly halves the compile time that dominates
so short a run.  Checked: the parameter counts it prints (the adapters' count worked out from
the model's shapes), the base parameters bitwise unchanged by fine-tuning, the merged model's
validation loss equal to the adapted one's, and the fine-tune lowering the loss on the new slice.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def expected_counts(vocab: int, d: int = 64, layers: int = 3, rank: int = 4,
                    seq_len: int = 64) -> tuple[int, int]:
    """``(params, lora)`` of ``char_lm.TransformerLM`` with its defaults: every matmul kernel
    ``(in, out)`` gets ``A: (in, rank)`` and ``B: (rank, out)``; an attention kernel's ``in``
    / ``out`` is the model width (heads x head_dim flattened)."""
    block = (2 * 2 * d                          # two LayerNorms
             + 4 * (d * d + d)                  # query, key, value, out (heads x head_dim = d)
             + (d * 4 * d + 4 * d) + (4 * d * d + d))   # the MLP
    params = vocab * d + seq_len * d + layers * block + 2 * d + d * vocab + vocab
    lora_block = 4 * rank * (d + d) + rank * (d + 4 * d) + rank * (4 * d + d)
    return params, layers * lora_block + rank * (d + vocab)


def test_lora_finetune_trains_adapters_only_and_merges(tmp_path):
    result_file, plot = tmp_path / "result.json", tmp_path / "loss.png"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FLAGS)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lora_finetune.py"), "--pretrain-steps", str(STEPS),
         "--finetune-steps", str(STEPS), "--log-every", "5", "--sample-chars", "0",
         "--result-file", str(result_file), "--plot", str(plot)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0 and result_file.exists(), out[-3000:] + proc.stderr[-3000:]
    result = json.loads(result_file.read_text())

    # The counts, printed and recorded, match the model's shapes.
    vocab = int(re.search(r"vocabulary (\d+)", out).group(1))
    n_params, n_lora = expected_counts(vocab)
    assert (result["params"], result["lora"]) == (n_params, n_lora)
    assert (f"trainable parameters: full fine-tune {n_params:,}, LoRA adapters {n_lora:,} "
            f"({n_lora / n_params:.2%} of the model)") in out
    assert n_lora < 0.1 * n_params

    # A loss line every 5 steps of each phase, and every step's loss recorded.
    assert len(re.findall(r"\[pretrain\] step +\d+  train loss", out)) == STEPS // 5
    assert len(re.findall(r"\[lora\] step +\d+  train loss", out)) == STEPS // 5
    assert len(result["pretrain_losses"]) == len(result["finetune_losses"]) == STEPS

    # LoRA's promises: identity at init, base params untouched, merge == adapted.
    assert result["identity_diff"] <= 1e-6
    assert result["params_unchanged"] and "base params bitwise unchanged after fine-tuning: yes" in out
    assert result["code_val"]["dropped"] == result["code_val"]["base"]
    prose = result["prose_val"]
    assert result["merge_diff"] == abs(prose["merged"] - prose["adapted"]) <= 1e-5

    # The fine-tune learns the new slice.
    assert prose["adapted"] < prose["base"] - 0.05
    assert result["finetune_losses"][-1] < result["finetune_losses"][0]
    assert "lora_finetune: OK" in out

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert plot.read_bytes().startswith(b"\x89PNG")
