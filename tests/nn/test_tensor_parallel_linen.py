"""A Linen tensor-parallel transformer ports to ``varjax.nn`` by changing one import.

The model below is written once, against a module ``lib`` that is ``flax.linen`` or
``varjax.nn``, the way large Linen models are written: every parameter created through
``with_logical_partitioning``, activations pinned with ``with_logical_constraint``, the blocks
stacked by ``scan(remat(Block), ..., metadata_params={PARTITION_NAME: 'layers'})``, and the
logical names mapped to a ``('data', 'model')`` mesh by rules.  Both give the same
``PartitionSpec`` s, the same initial values bit for bit, the same sharded initial state by
Linen's recipe, and the same losses over a few AdamW steps on the suite's two host devices,
with dropout on.  ``examples/parallel.py`` is the full-size version, on 8 devices.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import flax.linen as linen
import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import varjax.nn as nn

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH = 16, 8, 2, 2, 6, 4
RULES = (("batch", "data"), ("length", None), ("embed", None), ("layers", None), ("heads", "model"),
         ("mlp", "model"), ("vocab", "model"))
STEPS = 4
# Compiling dominates this test on CPU; these options halve it.  Both libraries compile with
# them, so the comparison is unaffected.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def transformer(lib: ModuleType) -> Any:
    """A small pre-LayerNorm decoder LM written against ``lib`` (Linen's API)."""
    dense = lib.initializers.lecun_normal()

    def logical(init: Callable, *names: str) -> Callable:
        return lib.with_logical_partitioning(init, names)

    def layer_norm() -> Any:
        return lib.LayerNorm(scale_init=logical(lib.initializers.ones_init(), "embed"),
                             bias_init=logical(lib.initializers.zeros_init(), "embed"))

    class Block(lib.Module):
        deterministic: bool

        @lib.compact
        def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
            x = lib.with_logical_constraint(x, ("batch", "length", "embed"))
            # Two names for 3-d kernels: see examples/parallel.py's Block.
            h = lib.MultiHeadDotProductAttention(
                HEADS, dropout_rate=0.1, kernel_init=logical(dense, "embed", "heads"),
                bias_init=logical(lib.initializers.zeros_init(), "heads"),
                out_kernel_init=logical(dense, "heads", "embed"),
                out_bias_init=logical(lib.initializers.zeros_init(), "embed"),
            )(layer_norm()(x), mask=lib.make_causal_mask(x[..., 0]), deterministic=self.deterministic)
            x = x + lib.Dropout(0.1)(h, deterministic=self.deterministic)
            h = lib.Dense(4 * D_MODEL, kernel_init=logical(dense, "embed", "mlp"),
                          bias_init=logical(lib.initializers.normal(0.1), "mlp"))(layer_norm()(x))
            h = lib.with_logical_constraint(lib.gelu(h), ("batch", "length", "mlp"))
            h = lib.Dense(D_MODEL, kernel_init=logical(dense, "mlp", "embed"),
                          bias_init=logical(lib.initializers.normal(0.1), "embed"))(h)
            return x + lib.Dropout(0.1)(h, deterministic=self.deterministic), None

    class LM(lib.Module):
        @lib.compact
        def __call__(self, tokens: jax.Array, train: bool) -> jax.Array:
            embed = logical(lib.linear.default_embed_init, "vocab", "embed")
            x = lib.Embed(VOCAB, D_MODEL, embedding_init=embed)(tokens)
            x = lib.with_logical_constraint(x, ("batch", "length", "embed"))
            blocks = lib.scan(lib.remat(Block), variable_axes={"params": 0},
                              split_rngs={"params": True, "dropout": True}, length=LAYERS,
                              metadata_params={lib.PARTITION_NAME: "layers"})
            x, _ = blocks(deterministic=not train, name="blocks")(x)
            logits = lib.Dense(VOCAB, kernel_init=logical(dense, "embed", "vocab"),
                               bias_init=logical(lib.initializers.zeros_init(), "vocab"))(layer_norm()(x))
            return lib.with_logical_constraint(logits, ("batch", "length", "vocab"))

    return LM()


def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def abstract_init(lib: ModuleType, tokens: np.ndarray) -> Callable[[], Any]:
    """``init``'s parameters (boxed) as a function of nothing, for ``eval_shape`` and ``jit``."""
    model = transformer(lib)
    return lambda: model.init(jax.random.key(0), tokens, train=False)["params"]


def sharded_training(lib: ModuleType, windows: np.ndarray) -> dict:
    """Linen's recipe end to end with ``lib``: specs of an abstract init, a sharded init, and
    ``STEPS`` jitted AdamW steps on a ``('data', 'model') = (1, 2)`` mesh."""
    model, optimizer, devices = transformer(lib), optax.adamw(1e-2, weight_decay=1e-4), mesh()
    init = abstract_init(lib, windows[0, :, :-1])

    def loss_fn(params: Any, batch: jax.Array, key: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, batch[:, :-1], train=True, rngs={"dropout": key})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    def step(params: Any, opt_state: Any, batch: jax.Array, key: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with jax.set_mesh(devices), lib.logical_axis_rules(RULES):
        shardings = lib.logical_to_mesh_sharding(lib.get_partition_spec(jax.eval_shape(init)), devices, RULES)
        params = jax.jit(init, out_shardings=shardings, compiler_options=FAST_COMPILE)()
        init_values = jax.tree.map(np.asarray, lib.unbox(params))
        opt_state = optimizer.init(params)
        train_step = jax.jit(step, in_shardings=(shardings, None, NamedSharding(devices, P("data")), None),
                             compiler_options=FAST_COMPILE)
        losses = []
        for i, batch in enumerate(windows):
            params, opt_state, loss = train_step(params, opt_state, batch, jax.random.key(i + 1))
            losses.append(float(loss))
    return {"init": init_values, "params": params, "losses": losses}


def test_partition_specs_and_shardings_equal_linen_and_scan_adds_the_layers_axis():
    tokens = np.zeros((BATCH, SEQ), np.int32)
    ours = nn.get_partition_spec(jax.eval_shape(abstract_init(nn, tokens)))
    theirs = linen.get_partition_spec(jax.eval_shape(abstract_init(linen, tokens)))
    assert ours == theirs
    assert ours["blocks"]["Dense_0"]["kernel"] == P("layers", "embed", "mlp")
    assert ours["blocks"]["MultiHeadDotProductAttention_0"]["out"]["kernel"] == P("layers", "heads", "embed")
    assert ours["Embed_0"]["embedding"] == P("vocab", "embed")
    devices = mesh()
    assert (nn.logical_to_mesh_sharding(ours, devices, RULES)
            == linen.logical_to_mesh_sharding(theirs, devices, RULES))


def test_sharded_init_is_bitwise_linen_and_sharded_training_gives_linen_losses():
    windows = np.random.default_rng(0).integers(0, VOCAB, (STEPS, BATCH, SEQ + 1)).astype(np.int32)
    # User code (Optax's AdamW, Linen) under JAX's default promotion, not the suite's strict one.
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        ours, theirs = sharded_training(nn, windows), sharded_training(linen, windows)

    assert jax.tree.structure(ours["init"]) == jax.tree.structure(theirs["init"])
    for a, b in zip(jax.tree.leaves(ours["init"]), jax.tree.leaves(theirs["init"])):
        np.testing.assert_array_equal(a, b)

    np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-6)
    assert ours["losses"][-1] < ours["losses"][0]
    trained = zip(jax.tree.leaves(nn.unbox(ours["params"])), jax.tree.leaves(linen.unbox(theirs["params"])))
    for a, b in trained:
        assert a.sharding.spec == b.sharding.spec
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    kernel = nn.unbox(ours["params"])["blocks"]["Dense_0"]["kernel"]          # [layers, embed, mlp]
    assert kernel.sharding.spec == P(None, None, "model")
    assert [s.data.shape for s in kernel.addressable_shards] == [(LAYERS, D_MODEL, 2 * D_MODEL)] * 2
