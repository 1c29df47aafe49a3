"""Golden comparison of printed IR: on mismatch, print the new text so it can be pasted in."""
import textwrap

import jax

import varjax as vj
from varjax.ir.primitives import VarType
from varjax.passes import PassContext, get_pass
from varjax.trace.variable_dicts import flatten_variables


def context(variables=None, rngs=None, mutable=True) -> PassContext:
    """The PassContext functionalize would build for these inputs."""
    types = {k: VarType.of_leaves(t, ls) for k, (t, ls) in flatten_variables(variables or {}).items()}
    rng_avals = {s: jax.typeof(k) for s, k in (rngs or {}).items()}
    return PassContext.for_inputs(types, mutable, rng_avals)


def run_pass(name, fn, *args, variables=None, rngs=None, mutable=True, **options):
    """(effectful jaxpr of fn, the same after pass `name`)."""
    before = vj.functionalize(fn).jaxpr(*args, variables=variables or {}, rngs=rngs, mutable=mutable)
    ctx = context(variables, rngs, mutable)
    return before, get_pass(name)(**options).run(before, ctx)


def assert_ir(jaxpr, expected: str) -> None:
    found = str(jaxpr).strip()
    want = textwrap.dedent(expected).strip()
    if found != want:
        print("Found:\n" + found)
    assert found == want
