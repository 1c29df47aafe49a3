"""Data + tensor parallelism from Linen's logical axis annotations, on 8 CPU devices.

A small decoder-only transformer on ``char_lm.py``'s byte-level corpus (its ``Corpus`` and
loss, imported), written as a sharded Linen model is written, with ``varjax.nn`` in place of
``flax.linen``:

* every parameter is created through ``nn.with_logical_partitioning(init, names)`` with
  *logical* axis names (``'embed'``, ``'mlp'``, ``'heads'``, ``'vocab'``), and the
  activations are pinned with ``nn.with_logical_constraint(x, ('batch', 'length', 'embed'))``;
* the blocks are stacked by ``nn.scan(nn.remat(Block), variable_axes={'params': 0}, ...,
  metadata_params={nn.PARTITION_NAME: 'layers'})``, which adds ``'layers'`` to the names of
  every stacked parameter;
* ``RULES`` maps the logical names to the mesh once, Megatron-style: the batch over ``data``,
  the MLP's hidden units, the attention heads and the vocabulary over ``model``, the rest
  replicated.  So the first MLP kernel is split by columns and the second by rows, each
  attention layer keeps whole heads on a device, and the embedding and the output layer are
  split by vocabulary entry.

The parameters are initialized *sharded*, by Linen's recipe: ``nn.get_partition_spec`` of an
abstract ``init`` (``jax.eval_shape``), ``nn.logical_to_mesh_sharding`` to a tree of
``NamedSharding`` s, and ``jax.jit(model.init, out_shardings=...)``, so no device ever holds a
whole split parameter.  AdamW's moments take their parameters' boxes and so their shardings.
The train step is one ``jax.jit`` with those shardings, traced under ``jax.set_mesh`` and
``nn.logical_axis_rules``; varjax's ``shard-variables`` pass puts the sharding constraints on
the parameter reads from the boxes' names.

With no arguments the script trains the model twice in one process: on the ``('data',
'model') = (4, 2)`` mesh of 8 devices, and on a ``(1, 1)`` mesh of one device, with the same
batches, keys and code, and compares the losses.  ``--mesh 4x2`` or ``--mesh 1x1`` runs one of
them.  The 8 CPU devices come from ``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
which the script sets before JAX starts unless ``XLA_FLAGS`` is already set.

Measured (2 CPU cores shared with another test run, load average about 5; 60 AdamW steps of
32 x 64 bytes, dropout 0.1): the loss falls from 5.226459 at step 1 to 2.606287 at step 60 on
both meshes; the largest difference over the 60 steps is 4.8e-7, both read 2.60628748 after
step 60, and both 2.898594 on 256 validation windows.  On the (4, 2) mesh device 0 holds
343,872 of the 666,240 parameter bytes (52%: the LayerNorms and a few biases are replicated),
the shard-variables pass constrains all 22 parameter reads, and the compiled step has 11
all-reduces: 9 within ``model`` pairs and 2 across ``data``.  Init, trace and compile took
14.5 s and the 60 steps 13.6 s on 8 devices, against 13.7 s and 12.2 s on 1; 57 s in all.
The 8 "devices" are threads sharing the same 2 cores, so this shows the layout and the
numerics, not a speed-up.

Run from the repository root: ``python examples/parallel.py`` (``make parallel``).
See ``notes/scale-out.md``.
"""
from __future__ import annotations

import os

# XLA reads the device count once, when the CPU backend starts: before JAX is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from char_lm import SEED, SEQ_LEN, Corpus, cross_entropy  # noqa: E402
from common import OUT, plot_losses  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import varjax.nn as nn  # noqa: E402

STEPS = 60
LOG_EVERY = 10
LR = 3e-3
WEIGHT_DECAY = 1e-4
VAL_WINDOWS = 256         # a fixed slice of the validation windows, evaluated after training
TOLERANCE = 1e-5          # 8-device vs 1-device loss, absolute
VOCAB_MULTIPLE = 16       # the vocabulary is padded to this, so it splits evenly over `model`
MESH_AXES = ("data", "model")

# Logical axis name -> mesh axis (None: replicated).  The order matters only where one name
# could take several mesh axes; here each name has one rule.
RULES = (
    ("batch", "data"),
    ("length", None),
    ("embed", None),
    ("layers", None),
    ("heads", "model"),
    ("mlp", "model"),
    ("vocab", "model"),
)

zeros, ones = nn.initializers.zeros_init(), nn.initializers.ones_init()
dense_init = nn.initializers.lecun_normal()


def logical(init: Callable, *names: str | None) -> Callable:
    """``init`` whose values are boxed with their logical axis names (Linen's idiom)."""
    return nn.with_logical_partitioning(init, names)


def layer_norm() -> nn.LayerNorm:
    return nn.LayerNorm(scale_init=logical(ones, "embed"), bias_init=logical(zeros, "embed"))


# --------------------------------------------------------------------------- model

class Block(nn.Module):
    """A pre-LayerNorm transformer block; ``(x) -> (x, None)``, the scan-over-layers body."""

    d_model: int
    heads: int
    dropout: float
    deterministic: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        mask = nn.make_causal_mask(x[..., 0])
        # Split by head: a device computes whole heads, and one all-reduce sums their
        # contributions to the output.  The query/key/value kernels are [embed, heads, head_dim]
        # and the output kernel [heads, head_dim, embed], but DenseGeneral calls the initializer
        # with the flattened [embed, heads * head_dim] shape, and Linen, under a mesh, constrains
        # that value to its names (at init, and on every apply, where it checks the shape): three
        # names would not fit it.  So the names describe the flat shape, and 'heads' lands on
        # the heads axis of the real kernel.
        h = nn.MultiHeadDotProductAttention(
            self.heads, dropout_rate=self.dropout,
            kernel_init=logical(dense_init, "embed", "heads"),
            bias_init=logical(zeros, "heads"),
            out_kernel_init=logical(dense_init, "heads", "embed"),
            out_bias_init=logical(zeros, "embed"),
        )(layer_norm()(x), mask=mask, deterministic=self.deterministic)
        x = x + nn.Dropout(self.dropout)(h, deterministic=self.deterministic)
        # Column-parallel then row-parallel: the hidden units stay split over `model`.
        h = nn.Dense(4 * self.d_model, kernel_init=logical(dense_init, "embed", "mlp"),
                     bias_init=logical(zeros, "mlp"))(layer_norm()(x))
        h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
        h = nn.Dense(self.d_model, kernel_init=logical(dense_init, "mlp", "embed"),
                     bias_init=logical(zeros, "embed"))(h)
        x = x + nn.Dropout(self.dropout)(h, deterministic=self.deterministic)
        return nn.with_logical_constraint(x, ("batch", "length", "embed")), None


class TransformerLM(nn.Module):
    """Token + learned position embeddings -> ``layers`` scanned, rematerialized blocks -> logits."""

    vocab_size: int
    d_model: int = 64
    heads: int = 4
    layers: int = 3
    dropout: float = 0.1

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool) -> jax.Array:
        init = nn.linear.default_embed_init
        tokens_embed = nn.Embed(self.vocab_size, self.d_model, embedding_init=logical(init, "vocab", "embed"))
        positions_embed = nn.Embed(SEQ_LEN, self.d_model, embedding_init=logical(init, "length", "embed"))
        x = tokens_embed(tokens) + positions_embed(jnp.arange(tokens.shape[-1]))
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        x = nn.Dropout(self.dropout)(x, deterministic=not train)
        blocks = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                         split_rngs={"params": True, "dropout": True}, length=self.layers,
                         metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = blocks(self.d_model, self.heads, self.dropout, deterministic=not train, name="blocks")(x)
        logits = nn.Dense(self.vocab_size, kernel_init=logical(dense_init, "embed", "vocab"),
                          bias_init=logical(zeros, "vocab"))(layer_norm()(x))
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


# --------------------------------------------------------------------------- training

def make_mesh(shape: tuple[int, int]) -> Mesh:
    """A ``('data', 'model')`` mesh over the first ``data * model`` devices.

    Auto axes: shardings flow through the layers by propagation, as Linen-style code expects
    (``jax.make_mesh``'s default, Explicit, would want an ``out_sharding`` on the row-parallel
    matmuls).
    """
    devices = jax.devices()[: shape[0] * shape[1]]
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 2, devices=devices)


def sharded_state(model: TransformerLM, optimizer: optax.GradientTransformation, mesh: Mesh,
                  sample: jax.Array) -> tuple[dict, dict]:
    """The boxed parameters and AdamW state, created directly in their shards.

    Returns the state and its shardings (the jitted step's ``in_``/``out_shardings``).
    """
    key = jax.random.key(SEED)

    def init_params() -> Any:
        return model.init(key, sample, train=False)["params"]

    def shardings_of(fn: Callable, *args: Any) -> Any:
        # Linen's recipe: the logical names of an abstract call's boxes, mapped by the rules.
        return nn.logical_to_mesh_sharding(nn.get_partition_spec(jax.eval_shape(fn, *args)), mesh, RULES)

    params_sharding = shardings_of(init_params)
    params = jax.jit(init_params, out_shardings=params_sharding)()
    # The moments are boxed like the parameters they follow, so they get the same shardings.
    opt_sharding = shardings_of(optimizer.init, params)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_sharding)(params)
    return ({"params": params, "opt_state": opt_state},
            {"params": params_sharding, "opt_state": opt_sharding})


def make_train_step(model: TransformerLM, optimizer: optax.GradientTransformation, state_sharding: dict,
                    batch_sharding: NamedSharding) -> Callable:
    """One jitted AdamW step; the parameters stay boxed, so the shard-variables pass sees their names."""
    def train_step(state: dict, windows: jax.Array, key: jax.Array) -> tuple[dict, jax.Array]:
        loss, grads = jax.value_and_grad(cross_entropy, argnums=1)(model, state["params"], windows, True, key)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    replicated = NamedSharding(batch_sharding.mesh, P())
    return jax.jit(train_step, in_shardings=(state_sharding, batch_sharding, replicated),
                   out_shardings=(state_sharding, replicated))


_COLLECTIVE = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
                         r"(?:-start)?\((.*)")


def group_size(attributes: str) -> int | None:
    """How many devices one collective's groups span, from its HLO attributes.

    XLA writes replica groups three ways: as an iota (``[groups,size]<=[n]``), as mesh axes
    (``mesh['axis_0'=4,...] {'axis_0'}``) or as lists (``{{0,1},{2,3}}``).
    """
    if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", attributes):
        return int(m[1])
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", attributes):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m[1]))
        return int(np.prod([int(sizes[axis]) for axis in re.findall(r"'(\w+)'", m[2])]))
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", attributes):
        return len(m[1].split(","))
    return None


def collectives(hlo: str) -> dict[str, int]:
    """The collectives in a compiled (partitioned) HLO module, counted by kind and by how many
    devices each spans: ``{'all-reduce over 2 devices': 9, ...}``.  Static counts: one in the
    scanned block's body runs once per layer."""
    found: dict[str, int] = {}
    for op, attributes in _COLLECTIVE.findall(hlo):
        name = f"{op} over {group_size(attributes) or '?'} devices"
        found[name] = found.get(name, 0) + 1
    return dict(sorted(found.items()))


def describe(params: Any) -> list[tuple[str, str, str, str, str]]:
    """Each parameter's path, shape, logical names, mesh spec and the shape of one shard."""
    names = jax.tree.leaves(nn.get_partition_spec(params), is_leaf=lambda x: isinstance(x, P))
    rows = []
    for (path, leaf), logical_names in zip(jax.tree_util.tree_leaves_with_path(nn.unbox(params)), names):
        rows.append((jax.tree_util.keystr(path, simple=True, separator="/"), str(leaf.shape),
                     str(tuple(logical_names)), str(leaf.sharding.spec),
                     str(leaf.addressable_shards[0].data.shape)))
    return rows


def train(mesh_shape: tuple[int, int], steps: int, corpus: Corpus, verbose: bool) -> dict:
    """Trains ``steps`` AdamW steps on a ``mesh_shape`` mesh; returns the losses and what the
    run shows about its sharding.  ``verbose`` prints the parameter table."""
    tag = "x".join(map(str, mesh_shape))

    def log(line: str) -> None:
        print(f"[{tag}] {line}", flush=True)

    start = time.perf_counter()
    mesh = make_mesh(mesh_shape)
    log(f"mesh {dict(mesh.shape)} of device ids {mesh.device_ids.tolist()}, "
        f"axis types {tuple(t.name for t in mesh.axis_types)}")
    model = TransformerLM(-(-len(corpus.vocab) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
    optimizer = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    batch_sharding = NamedSharding(mesh, P("data"))
    batch_rng, dropout_key = np.random.default_rng(SEED), jax.random.key(SEED + 1)
    batches = [corpus.train_batch(batch_rng) for _ in range(steps)]

    # The mesh and the rules are read while tracing, by nn.with_logical_constraint and by the
    # shard-variables pass: everything that traces the model runs inside both.
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        state, state_sharding = sharded_state(model, optimizer, mesh, batches[0][:, :-1])
        table = describe(state["params"])
        if verbose:
            widths = [max(len(row[i]) for row in table) for i in range(4)]
            for row in [("parameter", "shape", "logical names", "sharding", "shard")] + table:
                log("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths + [0])))
        params = nn.unbox(state["params"])
        total = sum(p.nbytes for p in jax.tree.leaves(params))
        local = sum(p.addressable_shards[0].data.nbytes for p in jax.tree.leaves(params))
        log(f"{sum(p.size for p in jax.tree.leaves(params)):,} parameters, {total:,} bytes; "
            f"device 0 holds {local:,} of them ({local / total:.0%})")
        # The pass's own count: parameter reads it constrained from the boxes' names.
        traced = model.functionalize().traced(batches[0][:, :-1], variables={"params": state["params"]},
                                              rngs={"dropout": dropout_key}, train=True)
        constrained = traced.stats.get("shard-variables.constrained", 0)
        log(f"shard-variables pass: {constrained} parameter reads constrained to their shardings")
        # Compiled ahead of time, to read its HLO; the loop calls this executable, as a call
        # of the jitted function would compile it again.
        train_step = make_train_step(model, optimizer, state_sharding, batch_sharding).lower(
            state, batches[0], dropout_key).compile()
        counts = collectives(train_step.as_text())
        log(f"compiled train step: {sum(counts.values())} collectives"
            + "".join(f", {n} {name}" for name, n in counts.items()))
        setup = time.perf_counter() - start
        log(f"init, trace and compile: {setup:.1f} s")

        losses = []
        for step in range(1, steps + 1):
            windows = jax.device_put(batches[step - 1], batch_sharding)
            state, loss = train_step(state, windows, jax.random.fold_in(dropout_key, step))
            losses.append(float(loss))
            if step == 1 or step % LOG_EVERY == 0 or step == steps:
                log(f"step {step:3d}  loss {losses[-1]:.6f}")
        seconds = time.perf_counter() - start - setup
        val = jax.device_put(corpus.val_windows()[:VAL_WINDOWS], batch_sharding)
        val_loss = float(jax.jit(lambda p, w: cross_entropy(model, p, w, False))(state["params"], val))
    log(f"{steps} steps in {seconds:.1f} s ({1000 * seconds / steps:.0f} ms a step); "
        f"validation loss {val_loss:.6f} on {VAL_WINDOWS} windows")
    return {"mesh": tag, "losses": losses, "val_loss": val_loss,
            "specs": {row[0]: row[3] for row in table}, "collectives": counts, "constrained": constrained,
            "param_bytes": total, "device0_bytes": local, "setup_seconds": setup, "train_seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", choices=["4x2", "1x1"], action="append",
                        help="run only this mesh (default: both, and compare)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--result-file", type=Path, help="write the runs' results here as JSON")
    parser.add_argument("--plot", type=Path, default=OUT / "parallel_loss.png",
                        help="the loss curves' PNG (needs matplotlib; default: %(default)s)")
    args = parser.parse_args()
    meshes = args.mesh or ["4x2", "1x1"]
    if jax.device_count() < 8 and "4x2" in meshes:
        sys.exit(f"the 4x2 mesh needs 8 devices, found {jax.device_count()}: "
                 f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
    start = time.perf_counter()
    corpus = Corpus()
    print(f"corpus: {corpus.size:,} bytes, vocabulary {len(corpus.vocab)}; "
          f"{jax.device_count()} {jax.devices()[0].platform.upper()} devices", flush=True)
    runs = {name: train(tuple(map(int, name.split("x"))), args.steps, corpus, verbose=name == meshes[0])
            for name in meshes}
    result: dict[str, Any] = {"runs": runs}
    ok = True
    if len(runs) == 2:
        sharded, single = runs["4x2"], runs["1x1"]
        diffs = [abs(a - b) for a, b in zip(sharded["losses"], single["losses"])]
        result["max_diff"] = max(diffs)
        result["val_diff"] = abs(sharded["val_loss"] - single["val_loss"])
        ok = result["max_diff"] <= TOLERANCE and result["val_diff"] <= TOLERANCE
        print(f"loss after step {args.steps}: 8 devices {sharded['losses'][-1]:.8f}, 1 device "
              f"{single['losses'][-1]:.8f}; largest difference over all steps {result['max_diff']:.2g}, "
              f"validation {result['val_diff']:.2g} (tolerance {TOLERANCE:g})")
    if args.result_file:
        args.result_file.write_text(json.dumps(result))
    print(f"parallel: {'OK' if ok else 'MISMATCH'} in {time.perf_counter() - start:.1f} s")
    labels = {"4x2": "8 devices, (data, model) = (4, 2)", "1x1": "1 device"}
    plot_losses("parallel", {labels[name]: run["losses"] for name, run in runs.items()}, args.plot)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
