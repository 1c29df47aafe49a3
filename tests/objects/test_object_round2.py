"""Issue 33, object mode: static data keyed by type, carries that change places, a scan
body that returns the carry alone, and branch writes of the wrong dtype."""
from typing import Any

import jax.numpy as jnp
import pytest

import varjax as vj
import varjax.nn as nn

VALUES = [1, 1.0, True]        # equal, and of equal hash, in Python
DTYPES = [jnp.int32, jnp.float32, jnp.bool_]


class Fill(nn.Module):
    v: Any

    @nn.compact
    def __call__(self):
        return jnp.full((2,), self.v)


# --- item 9: static data keyed by type ---------------------------------------------------

@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
def test_module_fields_equal_in_value_but_not_in_type_trace_apart(keyword):
    traces = []

    @vj.jit
    def fill(m):
        traces.append(m.v)
        return m()
    models = [Fill(v).bind({}) for v in VALUES] + [Fill(1).bind({})]
    outs = [fill(m=m) if keyword else fill(m) for m in models]
    assert [o.dtype for o in outs] == DTYPES + [jnp.int32]
    assert [type(v) for v in traces] == [int, float, bool]   # an equal module: no new trace


def test_variable_metadata_equal_in_value_but_not_in_type_trace_apart():
    traces = []

    @vj.jit
    def fill(var):
        traces.append(var.tag)
        return jnp.full((2,), var.tag)
    outs = [fill(vj.Variable(jnp.zeros(()), tag=t)) for t in VALUES + [1]]
    assert [o.dtype for o in outs] == DTYPES + [jnp.int32]
    assert [type(v) for v in traces] == [int, float, bool]
