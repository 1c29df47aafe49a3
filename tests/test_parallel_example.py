"""``examples/parallel.py``: data + tensor parallelism on 8 devices trains as one device does.

The script needs 8 CPU devices and the suite's process has 2 (``conftest.py``), and XLA fixes
the count when it starts, so the script runs as a subprocess with its own ``XLA_FLAGS``: a few
steps on the ``('data', 'model') = (4, 2)`` mesh, then the same steps on a ``(1, 1)`` mesh in
the same process.  The flags also lower XLA's CPU optimization level, which roughly halves the
compile time that dominates so short a run; both meshes compile with the same flags, so the
comparison is unaffected.  Nothing here skips.  ``make parallel`` is the full run.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4
FLAGS = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
         "--xla_llvm_disable_expensive_passes=true")


def test_eight_devices_train_as_one_with_the_parameters_sharded_by_the_rules(tmp_path):
    result_file = tmp_path / "result.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=FLAGS)
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "parallel.py"), "--steps", str(STEPS),
                           "--result-file", str(result_file)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert result_file.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(result_file.read_text())
    sharded, single = result["runs"]["4x2"], result["runs"]["1x1"]

    # The bound: the 8-device loss equals the 1-device loss to 1e-5, at every step.
    assert len(sharded["losses"]) == len(single["losses"]) == STEPS
    assert result["max_diff"] <= 1e-5 and result["val_diff"] <= 1e-5
    assert sharded["losses"][-1] < sharded["losses"][0]
    assert proc.returncode == 0, proc.stdout[-3000:]

    # The parameters are laid out as RULES say (stacked kernels carry scan's 'layers' axis first).
    specs = sharded["specs"]
    assert specs["blocks/Dense_0/kernel"] == "P(None, None, 'model')"           # column-parallel
    assert specs["blocks/Dense_1/kernel"] == "P(None, 'model', None)"           # row-parallel
    assert specs["blocks/MultiHeadDotProductAttention_0/query/kernel"] == "P(None, None, 'model')"  # by head
    assert specs["Embed_0/embedding"] == "P('model', None)"                     # by vocabulary entry
    assert specs["LayerNorm_0/scale"] == "P(None,)"
    assert sharded["device0_bytes"] < sharded["param_bytes"] == single["device0_bytes"]
    # The shard-variables pass constrained every parameter read (all are annotated).
    assert sharded["constrained"] == len(specs) == 22

    # The compiled step is partitioned: all-reduces within `model` pairs and across `data`.
    assert sharded["collectives"].get("all-reduce over 2 devices", 0) > 0
    assert sharded["collectives"].get("all-reduce over 4 devices", 0) > 0
    assert single["collectives"] == {}
