"""Issue 33, object mode: static data keyed by type, carries that change places, a scan
body that returns the carry alone, and branch writes of the wrong dtype."""
from typing import Any

import jax
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


# --- item 8: carry objects that change places are written back by object ------------------

class _Box:
    """A plain Python object with a ``value``: the oracle loops run on these."""

    def __init__(self, value):
        self.value = value


def _swap(c, x):
    p, q = c
    p.value += 1
    return (q, p), x


def _rotate(c, x):
    p, q, r = c
    p.value += 1
    q.value = q.value * 2
    return (r, p, q), x


def _python_scan(body, values, n):
    """The oracle: ``body`` looped in Python over boxes; the boxes, and the final carry."""
    boxes = tuple(_Box(v) for v in values)
    carry = boxes
    for x in range(n):
        carry, _ = body(carry, x)
    return [b.value for b in boxes], [b.value for b in carry]


@pytest.mark.parametrize("body, values, n", [(_swap, [0, 1], 3), (_rotate, [0, 10, 100], 4)],
                         ids=["swap", "three-cycle"])
def test_scan_carry_objects_that_change_places_are_written_back_by_object(body, values, n):
    objs = tuple(vj.Variable(jnp.array(v)) for v in values)
    carry, _ = vj.scan(body)(objs, jnp.arange(n))
    objects, final = _python_scan(body, values, n)
    assert [int(o.value) for o in objs] == objects       # each object, as in Python
    assert [int(c.value) for c in carry] == final


def test_fori_loop_carry_objects_that_change_places_are_written_back_by_object():
    a, b = vj.Variable(jnp.array(0)), vj.Variable(jnp.array(1))
    vj.fori_loop(0, 3, lambda i, c: _swap(c, i)[0], (a, b))
    objects, _ = _python_scan(_swap, [0, 1], 3)
    assert [int(a.value), int(b.value)] == objects == [2, 2]


def test_scan_carry_with_one_object_in_two_places_stays_one_object():
    a = vj.Variable(jnp.array(0))

    def body(c, x):
        p, q = c
        p.value += 1
        q.value += 10           # the same object: both updates land
        return (q, p), x
    vj.scan(body)((a, a), jnp.arange(3))
    assert int(a.value) == 33


def test_while_loop_carry_objects_that_change_places_raise_naming_the_body():
    a, b = vj.Variable(jnp.array(0)), vj.Variable(jnp.array(1))

    def swap_body(c):
        p, q, i = c
        p.value += 1
        return q, p, i + 1
    with pytest.raises(vj.errors.TransformError, match=r"swap_body writes carry object "
                       r"carry\[0\].*not known") as info:
        vj.while_loop(lambda c: c[2] < 3, swap_body, (a, b, 0))
    assert "test_object_round2.py" in info.value.source
    assert (int(a.value), int(b.value)) == (0, 1)


def test_scan_carry_object_written_then_dropped_raises():
    a, b = vj.Variable(jnp.array(0)), vj.Variable(jnp.array(1))

    def drop(c, x):
        p, q = c
        p.value += 1
        return (vj.Variable(p.value), q), x
    with pytest.raises(vj.errors.TransformError, match=r"drop writes carry object carry\[0\] "
                       r"and then leaves it out"):
        vj.scan(drop)((a, b), jnp.arange(2))
    assert int(a.value) == 0


def test_while_loop_cond_fun_that_writes_raises_naming_the_variable():
    counter = vj.Variable(jnp.array(0), collection="counts")

    def count_calls(c):
        c[0].value += 1         # JAX's while_loop would drop this write
        return c[1] < 2
    with pytest.raises(vj.errors.TransformError, match="cond_fun count_calls writes") as info:
        vj.while_loop(count_calls, lambda c: (c[0], c[1] + 1), (counter, 0))
    assert info.value.collection == "counts" and int(counter.value) == 0


# --- item 18: a scan body returning the carry alone ----------------------------------------

def test_scan_body_returning_the_carry_alone_names_the_body():
    acc = vj.Variable(jnp.array(0))

    def carry_only(c, x):
        c.value += x
        return c
    with pytest.raises(vj.errors.TransformError, match=r"the body carry_only returned a "
                       r"Variable; a scan body returns a pair \(carry, y\)") as info:
        vj.scan(carry_only)(acc, jnp.arange(2))
    assert "test_object_round2.py" in info.value.source and "carry_only" in info.value.source


# --- item 20: a branch writing another dtype; object-mode tracebacks ----------------------

def _int_to_float(v):
    v.value = v.value.astype(jnp.float32)
    return jnp.zeros(())


def _keep(v):
    return jnp.zeros(())


def test_object_cond_branch_writing_another_dtype_names_the_variable_and_branch():
    count = vj.Variable(jnp.array(0), collection="counts")
    with pytest.raises(vj.errors.VariableStructureError,
                       match=r"variable v of collection 'counts' is int32\[\] after false_fun "
                             r"\(_keep\) but float32\[\] after true_fun \(_int_to_float\)"):
        vj.cond(True, _int_to_float, _keep, count)
    assert count.value.dtype == jnp.int32


def test_functional_cond_branch_writing_another_dtype_names_the_variable_and_branch():
    def bump():
        n = vj.variable("counts", "n", jnp.zeros, (), jnp.int32)
        n.value = n.value.astype(jnp.float32)
        return jnp.zeros(())

    @vj.functionalize
    def f(x):
        vj.variable("counts", "n", jnp.zeros, (), jnp.int32)
        return vj.cond(x > 0, bump, lambda: jnp.zeros(()), None)
    with pytest.raises(vj.errors.VariableStructureError,
                       match=r"variable n of collection .counts. is float32\[\] after true_fun \(bump\) "
                             r"but int32\[\] after false_fun") as info:
        f.init({}, 1.0)
    assert info.value.collection == "counts" and "test_object_round2.py" in info.value.source


class _Writes(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.ones, (2,))
        self.put_variable("params", "w", w + 1)     # params not mutable: an error
        return x * w


_X = jnp.ones(2)


@pytest.mark.parametrize("call", [
    lambda m: vj.jit(lambda m: m(_X))(m),
    lambda m: vj.grad(lambda m: m(_X).sum())(m),
    lambda m: vj.cond(True, lambda m: m(_X), lambda m: m(_X), m),
    lambda m: vj.scan(lambda m, x: (m, m(x)))(m, jnp.ones((2, 2))),
    lambda m: vj.fori_loop(0, 2, lambda i, m: (m(_X), m)[1], m),
    lambda m: vj.while_loop(lambda m: False, lambda m: (m(_X), m)[1], m),
], ids=["jit", "grad", "cond", "scan", "fori_loop", "while_loop"])
def test_object_mode_traceback_shows_no_varjax_frame_but_the_raise_site(call, monkeypatch):
    import os
    import traceback
    monkeypatch.delenv(vj.errors.TRACEBACK_FILTERING_ENV, raising=False)
    model = _Writes().bind(_Writes().init(jax.random.key(0), _X))
    with pytest.raises(vj.errors.ImmutableCollectionError) as info:
        call(model)
    files = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    inside = os.path.dirname(vj.__file__)
    ours = [f for f in files if f.startswith(inside) or f.startswith("<varjax")]
    assert ours == [files[-1]], files


def test_scan_carry_shared_differently_after_a_step_raises():
    a, b = vj.Variable(jnp.array(0)), vj.Variable(jnp.array(1))

    def twice(c, x):
        p, _ = c
        return (p, p), x        # two objects came in, one goes on in both places
    with pytest.raises(vj.errors.TransformError, match="twice returns a new carry whose "
                       "objects are shared differently"):
        vj.scan(twice)((a, b), jnp.arange(2))
