"""An eager ``init`` evaluates operation by operation, as Linen's does: no whole-model compile.

Under ``jax.jit`` (``jax.jit(model.init)``, or ``init`` inside a traced function) it is one
program as before.  The eager form equals Linen's eager ``init`` bit for bit (XLA may round an
initializer differently inside one compiled program, so eager is compared with eager and
jitted with jitted: tests/ports/ compare the jitted forms).
"""
from __future__ import annotations

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np

from varjax import nn

X = jnp.ones((1, 3))


def _stack(lib, depth):
    class Stack(lib.Module):
        @lib.compact
        def __call__(self, x):
            for _ in range(depth):
                x = lib.Dense(3, kernel_init=lib.initializers.normal(0.5))(x)
                x = lib.LayerNorm()(x)
            return x
    return Stack()


def _compiles(fn):
    """How many XLA programs ``fn()`` compiles (JAX's backend-compile events)."""
    events = []
    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        jax.block_until_ready(fn())
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(events)


def test_eager_init_equals_linens_eager_init_bit_for_bit():
    got = _stack(nn, 2).init(jax.random.key(0), X)
    want = _stack(linen, 2).init(jax.random.key(0), X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


def test_a_deeper_eager_init_compiles_nothing_new_and_jit_init_compiles_one_program():
    _stack(nn, 1).init(jax.random.key(0), X)      # every operation of one layer, cached
    assert _compiles(lambda: _stack(nn, 4).init(jax.random.key(0), X)) == 0
    jitted = jax.jit(_stack(nn, 4).init)
    assert _compiles(lambda: jitted(jax.random.key(0), X)) == 1
