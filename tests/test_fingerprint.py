"""Jit-cache fingerprints start lax and turn strict at the first variable operation inside
an inner trace (see "Inner jax.jit functions" in notes/architecture.md).

The switch is process-wide and one-way, so each check runs in a fresh interpreter.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_library_jits_are_shared_across_init_traces_until_a_variable_op_runs_inside_one():
    out = run_fresh("""
        import jax, jax.numpy as jnp
        import varjax as vj
        from varjax.trace import fingerprint
        traces = []

        @jax.jit
        def library(x):          # never touches a variable
            traces.append(1)
            return x * 2

        @vj.functionalize
        def model(x, flag):      # `flag` is static: every value is its own init trace
            w = vj.param('w', jax.nn.initializers.ones, (x.shape[-1],))
            return library(x * w)

        x = jnp.ones(3)
        model.init(jax.random.key(0), x, 1)
        model.init(jax.random.key(0), x, 2)
        print(len(traces), fingerprint.is_strict())
    """)
    assert out == "1 False"


def test_the_first_variable_op_in_an_inner_trace_makes_fingerprints_strict():
    out = run_fresh("""
        import jax, jax.numpy as jnp
        import varjax as vj
        from varjax.trace import fingerprint
        traces = []

        @jax.jit
        def count(x):
            traces.append(1)
            vj.variable('stats', 'n', jnp.zeros, (), jnp.int32).value += 1
            return x

        @vj.functionalize
        def h(x, flag):
            count(x)
            count(x)
            return vj.variable('stats', 'n').value

        x = jnp.ones(3)
        a = h.init(jax.random.key(0), x, True)
        b = h.init(jax.random.key(0), x, False)
        print(int(a['stats']['n']), int(b['stats']['n']), len(traces), fingerprint.is_strict())
    """)
    # each init creates n once and increments it twice; no trace reuses a stale helper
    assert out == "2 2 4 True"
