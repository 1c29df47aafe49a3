"""Each optional pass preserves results: random effectful programs (the fuzzer's
generator) run through the minimal pipeline, ``lower-rng,discharge``, and through the
same plus one more pass; init variables and a mutable apply's outputs must agree.

The golden tests in test_builtin_passes.py show *what* each pass does; this shows it
changes nothing observable, on programs nesting jit/scan/while/cond/switch/checkpoint/
custom_jvp/custom_vjp.
"""
import os
import sys

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import varjax as vj
from varjax.passes import Pipeline

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from fuzz import programs as P  # noqa: E402

MINIMAL = ["lower-rng", "discharge"]
OPTIONAL = ["check-mutability", "forward-stores", "dead-reads", "cast-params{dtype=float32}"]


def _run(program, extra):
    f = vj.functionalize(P.build_varjax_fn(program))
    f.pipeline = Pipeline(MINIMAL + extra, verify=True)
    x, sel = P.make_args(program.shape, 0, 1)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = f.init(rngs, x, sel)
    out, updated = f.apply(variables, x, sel, rngs=rngs, mutable=True)
    return variables, out, updated


def _same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("extra", OPTIONAL)
def test_optional_pass_preserves_results(extra):
    @settings(max_examples=20, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(P.programs(max_depth=2, max_top=4))
    def check(program):
        _same(_run(program, []), _run(program, [extra]))

    check()


def test_dead_reads_counts_exactly_what_jax_dce_removes():
    """dead-reads skips DCE when its counting walk finds nothing to remove, so the
    count must be exact: on random nested programs (init, where forward-stores leaves
    dead reads, and apply, where usually nothing is dead) its ``removed`` statistic
    equals the equations JAX's DCE removes, and the pass returns DCE's jaxpr."""
    from varjax import _jax
    from varjax.ir.nested import walk_eqns

    def size(jaxpr):
        return sum(1 for _ in walk_eqns(jaxpr))

    @settings(max_examples=15, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(P.programs(max_depth=2, max_top=4))
    def check(program):
        f, args, calls = P.init_and_apply(program)
        for kwargs in calls:
            before, _ = f.run_pipeline(*args, pipeline=Pipeline(["lower-rng", "forward-stores"]),
                                       **kwargs)
            after, ctx = f.run_pipeline(*args, pipeline=Pipeline(["lower-rng", "forward-stores",
                                                                  "dead-reads"]), **kwargs)
            pruned, _ = _jax.dce_jaxpr(before.jaxpr, [True] * len(before.jaxpr.outvars),
                                       instantiate=True)
            removed = size(before) - size(pruned)
            assert ctx.stats.get("dead-reads.removed", 0) == removed
            assert size(after) == size(pruned)

    check()
