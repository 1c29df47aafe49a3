"""Training across two processes with JAX's multi-controller runtime, checked against one process.

varjax has no distributed runtime of its own: ``Module.apply`` is a pure function once
functionalized, so ``jax.distributed``, a global ``Mesh`` and ``jax.jit``'s shardings apply to
it unchanged.  This script shows that on one machine:

* **2 processes x 4 CPU devices** join through ``jax.distributed.initialize`` (coordinator on
  ``127.0.0.1``, collectives across processes through Gloo) and see one 8-device mesh
  ``('data', 'model') = (4, 2)``.  The ``data`` axis spans the processes (each holds two of its
  rows); the ``model`` axis stays inside a process, as tensor parallelism stays inside a host on a
  real cluster.
* A varjax MLP whose middle pair of layers is split Megatron-style over ``model`` (the first
  kernel by columns, the second by rows, by explicit ``NamedSharding``s) is trained with Optax
  Adam in one ``jax.jit`` step with ``in_shardings``/``out_shardings``.  Each process builds only
  its rows of every global batch (``jax.make_array_from_process_local_data``).
* Halfway, both processes save the sharded parameters and optimizer state with Orbax into one
  directory.  After the run, both restore it onto the same shardings, check every shard is
  bitwise the one saved, and train the second half again from it.
* The same script as **1 process x 8 devices** (same mesh shape) is the reference.

``python examples/multihost.py`` (``make multihost``) launches the two workers and the reference
together, as subprocesses, each with its own ``XLA_FLAGS``, and compares them.  A worker alone:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python examples/multihost.py --process-id 0 --num-processes 2 \\
        --coordinator 127.0.0.1:PORT --checkpoint-dir /tmp/ckpt

Measured (2 CPU cores shared with other work; 40 steps of 128 examples, checkpoint after step
20): loss 2.3347 -> 0.3817.  Step 1 is bitwise the same in both runs; from step 2 on some steps
differ in the last bit (Gloo sums the gradients across the processes in another order than one
process sums its devices), 2.4e-7 at most; after step 40 the 2 processes read 0.38171393 and
the 1 process 0.38171387.  The restored state is bitwise the saved one in every process, and
steps 21-40 after restoring repeat the uninterrupted ones bitwise.  25-34 s in all.
See ``notes/scale-out.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from common import OUT, plot_losses
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import varjax.nn as nn

SEED = 0
DEVICES = 8
MESH_SHAPE = (4, 2)
MESH_AXES = ("data", "model")
FEATURES = 32
CLASSES = 8
HIDDEN = 128
DATASET = 4096
BATCH = 128               # global; each process builds BATCH // process_count rows of it
STEPS = 40
LR = 3e-3
TOLERANCE = 1e-5          # multi- vs single-process loss, absolute
RESULT = "RESULT "        # a worker's last stdout line: this prefix, then its results as JSON

# The parameters' layout on the mesh, written by hand (the spec tree mirrors the params tree).
# ``up`` is column-parallel and ``down`` row-parallel: the hidden activations between them stay
# split over ``model`` and XLA inserts one all-reduce after ``down``.  The small first and last
# layers are replicated.
PARAM_SPECS = {
    "embed": {"kernel": P(), "bias": P()},
    "up": {"kernel": P(None, "model"), "bias": P("model")},
    "down": {"kernel": P("model", None), "bias": P()},
    "head": {"kernel": P(), "bias": P()},
}


# --------------------------------------------------------------------------- model and data

class MLP(nn.Module):
    """``embed -> up -> down -> head`` with GELUs and a residual around the up/down pair."""

    hidden: int = HIDDEN
    classes: int = CLASSES

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.gelu(nn.Dense(self.hidden, name="embed")(x))
        h = nn.gelu(nn.Dense(4 * self.hidden, name="up")(x))
        x = x + nn.Dense(self.hidden, name="down")(h)
        return nn.Dense(self.classes, name="head")(x)


def dataset() -> tuple[np.ndarray, np.ndarray]:
    """A fixed classification task: Gaussian inputs labelled by a random linear teacher.

    Every process builds the same arrays from ``SEED`` (they are small); a real job would
    have each process read only its files.
    """
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((DATASET, FEATURES)).astype(np.float32)
    teacher = rng.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    return x, np.argmax(x @ teacher, axis=-1).astype(np.int32)


def batch_indices(step: int) -> np.ndarray:
    """The dataset rows of global batch ``step``: the same in every process."""
    return np.random.default_rng([SEED, step]).choice(DATASET, BATCH, replace=False)


def process_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
    """The rows of a global array that this process's devices hold under ``sharding``.

    ``jax.make_array_from_process_local_data`` wants exactly these rows, in order.  They are
    contiguous because the ``data`` axis is laid out process by process.
    """
    rows = [index[0] for index in sharding.addressable_devices_indices_map(shape).values()]
    start, stop = min(r.start or 0 for r in rows), max(r.stop or shape[0] for r in rows)
    if stop - start != shape[0] // jax.process_count():
        raise ValueError(f"process {jax.process_index()} holds rows {rows}: not one contiguous block")
    return slice(start, stop)


def global_batch(step: int, data: tuple[np.ndarray, np.ndarray],
                 sharding: NamedSharding) -> tuple[jax.Array, jax.Array]:
    """Global batch ``step`` as two arrays sharded over ``data``, built from this process's rows."""
    rows = process_rows(sharding, (BATCH,))
    local = batch_indices(step)[rows]
    return tuple(jax.make_array_from_process_local_data(sharding, part[local], (BATCH,) + part.shape[1:])
                 for part in data)


# --------------------------------------------------------------------------- training

def shardings(mesh: Mesh, optimizer: optax.GradientTransformation, params_shape: Any) -> dict:
    """``NamedSharding``s of the training state: the params as ``PARAM_SPECS`` says, Adam's
    moments like their params (``optax.tree_map_params``), its step count replicated."""
    params = jax.tree.map(lambda spec: NamedSharding(mesh, spec), PARAM_SPECS)
    replicated = NamedSharding(mesh, P())
    opt_state = optax.tree_map_params(optimizer, lambda _, sharding: sharding,
                                      jax.eval_shape(optimizer.init, params_shape), params,
                                      transform_non_params=lambda _: replicated)
    return {"params": params, "opt_state": opt_state}


def make_train_step(model: MLP, optimizer: optax.GradientTransformation, state_sharding: dict,
                    batch_sharding: NamedSharding) -> Callable:
    """One jitted Adam step on a global batch; the loss comes back replicated, so every process
    can read it."""
    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def train_step(state: dict, x: jax.Array, y: jax.Array) -> tuple[dict, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    replicated = NamedSharding(batch_sharding.mesh, P())
    return jax.jit(train_step, in_shardings=(state_sharding, batch_sharding, batch_sharding),
                   out_shardings=(state_sharding, replicated))


def same_bits(a: jax.Array, b: jax.Array) -> bool:
    """Whether ``a`` and ``b`` have one sharding and bitwise-equal shards on this process."""
    return a.sharding.is_equivalent_to(b.sharding, a.ndim) and all(
        x.index == y.index and np.asarray(x.data).tobytes() == np.asarray(y.data).tobytes()
        for x, y in zip(a.addressable_shards, b.addressable_shards))


def train(process_id: int, num_processes: int, coordinator: str, checkpoint_dir: Path,
          steps: int, tag: str) -> dict:
    """Trains ``steps`` steps, saving the state halfway, then resumes from the checkpoint.

    Every process runs this same program (JAX's multi-controller model): the same jitted
    calls in the same order, each feeding its own rows.  Returns this process's losses.
    """
    if num_processes > 1:
        # CPU devices in different processes talk through Gloo.  It is already the default
        # on JAX 0.10 (older releases had no CPU collectives unless asked); GPUs and TPUs
        # bring their own (NCCL, ICI) and need no flag.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=60)
    if jax.device_count() != DEVICES or jax.process_count() != num_processes:
        raise RuntimeError(f"expected {DEVICES} devices in {num_processes} processes, found "
                           f"{jax.device_count()} in {jax.process_count()}: set XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={DEVICES // num_processes}")

    def log(line: str) -> None:
        print(f"[{tag}] {line}", flush=True)

    # Auto axes: shardings flow through the model by propagation, as Linen-style code expects.
    # (jax.make_mesh's default, Explicit, would want an out_sharding on the row-parallel matmul.)
    mesh = jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    log(f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} of "
        f"{jax.device_count()} devices; mesh {dict(mesh.shape)} of device ids "
        f"{mesh.device_ids.tolist()}")
    model, optimizer = MLP(), optax.adam(LR)
    data, batch_sharding = dataset(), NamedSharding(mesh, P("data"))
    sample = jnp.zeros((BATCH, FEATURES), jnp.float32)
    params_shape = jax.eval_shape(model.init, jax.random.key(SEED), sample)["params"]
    state_sharding = shardings(mesh, optimizer, params_shape)

    def init(key: jax.Array) -> dict:
        params = model.init(key, sample)["params"]
        return {"params": params, "opt_state": optimizer.init(params)}

    # Initialized under jit with out_shardings: each device computes only its own shards, and
    # no process ever holds a whole parameter that is split over ``model``.
    state = jax.jit(init, out_shardings=state_sharding)(jax.random.key(SEED))
    for path, leaf in jax.tree_util.tree_leaves_with_path(state["params"]):
        log(f"  {jax.tree_util.keystr(path):22} {str(leaf.shape):11} {leaf.sharding.spec}  "
            f"{len(leaf.addressable_shards)} local shards of {leaf.addressable_shards[0].data.shape}")

    train_step = make_train_step(model, optimizer, state_sharding, batch_sharding)
    checkpointer = ocp.StandardCheckpointer()
    save_at, losses, saved = steps // 2, [], None
    for step in range(1, steps + 1):
        state, loss = train_step(state, *global_batch(step, data, batch_sharding))
        losses.append(float(loss))
        if step == 1 or step % 10 == 0 or step == steps:
            log(f"step {step:3d}  loss {losses[-1]:.8f}")
        if step == save_at:
            # Every process calls save with the same tree: each writes its own shards, the
            # primary process (0) the metadata, and the barriers inside go through the
            # jax.distributed coordinator.  The save is asynchronous: wait before going on.
            checkpointer.save(checkpoint_dir / f"step_{step}", state)
            checkpointer.wait_until_finished()
            saved = state
            log(f"saved step {step} to {checkpoint_dir / f'step_{step}'}")

    # Restoring onto an abstract tree that carries the target shardings lays every array out
    # directly as training wants it; each process reads only its own shards.
    target = jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                      sharding=sharding),
                          saved, state_sharding)
    restored = checkpointer.restore(checkpoint_dir / f"step_{save_at}", target)
    bitwise = jax.tree.structure(restored) == jax.tree.structure(saved) and all(
        jax.tree.leaves(jax.tree.map(same_bits, restored, saved)))
    log(f"restored step {save_at}: bitwise equal to the saved state on this process: {bitwise}")
    resumed, state = [], restored
    for step in range(save_at + 1, steps + 1):
        state, loss = train_step(state, *global_batch(step, data, batch_sharding))
        resumed.append(float(loss))
    log(f"resumed steps {save_at + 1}-{steps}: final loss {resumed[-1]:.8f}")
    checkpointer.close()
    return {"process": jax.process_index(), "losses": losses, "save_at": save_at,
            "restored_bitwise": bitwise, "resumed": resumed}


# --------------------------------------------------------------------------- launcher

def free_port() -> int:
    """A TCP port free now on 127.0.0.1 (another program could take it before the coordinator
    binds it; unlikely on one machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Worker:
    """A launched worker: its process, and the files its stdout and stderr go to (files, not
    pipes, so a chatty worker never blocks on a full pipe)."""

    name: str
    proc: subprocess.Popen
    log: Path                 # <log>.out and <log>.err

    def output(self, stream: str = "out") -> str:
        return self.log.with_suffix(f".{stream}").read_text()


def spawn(name: str, process_id: int, num_processes: int, coordinator: str, checkpoint_dir: Path,
          steps: int, logs: Path) -> Worker:
    """This script as a worker, with its own device count: XLA reads ``XLA_FLAGS`` once, when
    JAX starts, so it goes in the worker's environment."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES // num_processes}")
    command = [sys.executable, __file__, "--process-id", str(process_id), "--num-processes",
               str(num_processes), "--coordinator", coordinator, "--checkpoint-dir",
               str(checkpoint_dir), "--steps", str(steps)]
    log = logs / name
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        return Worker(name, subprocess.Popen(command, env=env, stdout=out, stderr=err), log)


def collect(workers: list[Worker], deadline: float) -> list[dict]:
    """Each worker's results, once all have exited.

    A worker whose peer died waits in its next collective, so the first failure (or the
    deadline) kills them all, with SIGKILL: ``jax.distributed`` catches SIGTERM (its
    preemption notifier) and a hung worker would outlive it.
    """
    try:
        while any(w.proc.poll() is None for w in workers):
            failed = [w for w in workers if w.proc.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                culprit = failed[0] if failed else next(w for w in workers if w.proc.poll() is None)
                raise RuntimeError(f"worker {culprit.name} {'failed' if failed else 'timed out'}:\n"
                                   f"{culprit.output('err')[-4000:]}")
            time.sleep(0.1)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    results = []
    for w in workers:
        if w.proc.returncode != 0:
            raise RuntimeError(f"worker {w.name} exited with {w.proc.returncode}:\n{w.output('err')[-4000:]}")
        line = next(line for line in reversed(w.output().splitlines()) if line.startswith(RESULT))
        results.append(json.loads(line[len(RESULT):]))
    return results


def compare(steps: int = STEPS, timeout: float = 300.0, echo: bool = False) -> dict:
    """Runs 2 processes x 4 devices and, at the same time, 1 process x 8 devices; compares
    their losses.

    Returns both runs' results and ``max_diff``, the largest loss difference over all steps.
    ``echo`` prints process 0's and the reference's progress lines (not Gloo's own).
    """
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="varjax-multihost-") as name:
        root = Path(name)
        coordinator = f"127.0.0.1:{free_port()}"
        workers = [spawn(f"p{i}", i, 2, coordinator, root / "two-processes", steps, root) for i in range(2)]
        workers.append(spawn("single", 0, 1, "", root / "one-process", steps, root))
        *results, reference = collect(workers, deadline)
        if echo:
            for w in (workers[0], workers[2]):
                print("\n".join(line for line in w.output().splitlines()
                                if line.startswith(f"[{w.name}]")), flush=True)
    max_diff = max(abs(a - b) for worker in results for a, b in zip(worker["losses"], reference["losses"]))
    return {"workers": results, "reference": reference, "max_diff": max_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--process-id", type=int, help="run as this worker (otherwise launch them)")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--coordinator", default="", help="host:port of process 0's coordinator")
    parser.add_argument("--checkpoint-dir", type=Path, help="shared by all workers of one run")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--plot", type=Path, default=OUT / "multihost_loss.png",
                        help="the loss curves' PNG (needs matplotlib; default: %(default)s)")
    args = parser.parse_args()
    if args.process_id is not None:
        if args.checkpoint_dir is None:
            parser.error("a worker needs --checkpoint-dir")
        tag = "single" if args.num_processes == 1 else f"p{args.process_id}"
        result = train(args.process_id, args.num_processes, args.coordinator, args.checkpoint_dir,
                       args.steps, tag)
        print(RESULT + json.dumps(result), flush=True)
        return

    start = time.perf_counter()
    result = compare(args.steps, echo=True)
    workers, reference = result["workers"], result["reference"]
    save_at = reference["save_at"]
    print(f"loss after step {args.steps}: 2 processes " +
          " / ".join(f"{w['losses'][-1]:.8f}" for w in workers) +
          f", 1 process {reference['losses'][-1]:.8f}; largest difference over all steps "
          f"{result['max_diff']:.2g} (tolerance {TOLERANCE:g})")
    for name, run in [(f"process {w['process']} of 2", w) for w in workers] + [("1 process", reference)]:
        repeated = run["resumed"] == run["losses"][save_at:]
        print(f"{name}: restored state bitwise equal to the saved one: {run['restored_bitwise']}; "
              f"steps {save_at + 1}-{args.steps} after restoring repeat the run bitwise: {repeated}")
    ok = result["max_diff"] <= TOLERANCE and all(
        run["restored_bitwise"] and run["resumed"] == run["losses"][save_at:]
        for run in workers + [reference])
    print(f"multihost: {'OK' if ok else 'MISMATCH'} in {time.perf_counter() - start:.1f} s")
    plot_losses("multihost", {"2 processes x 4 devices": workers[0]["losses"],
                              "1 process x 8 devices": reference["losses"]}, args.plot)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
