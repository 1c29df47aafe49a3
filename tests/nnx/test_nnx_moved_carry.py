"""Loop bodies returning their carry's objects in other places (two modules or Variables
swapped), against flax.nnx 0.12.8: flax.nnx refuses most with a ``ValueError``; where it
takes them (``fori_loop`` with graph updates, ``scan`` of bare Variables) its objects are
placed by one step's output whatever the trip count, so after an even number of swaps the
values are not the Python loop's.  varjax.nnx refuses every case with
``CarryIdentityError`` (a ``TransformError`` and a ``ValueError``) naming the place and the
user's line (``varjax/nnx/carry_moves.py``)."""
import jax.numpy as jnp
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx.control import fori_loop, while_loop
from varjax.nnx.iteration import Carry, scan

MODES = [dict(), dict(graph_updates=False), dict(graph=False)]


def _cells(lib):
    class Cell(lib.Module):
        def __init__(self, v):
            self.v = lib.BatchStat(jnp.array(v))
    return Cell(1.0), Cell(2.0)


def _fori_body(i, c):
    p, q = c
    p.v[...] = p.v[...] * 10 + i
    return q, p


def _scan_body(c, x):
    p, q = c
    p[...] = p[...] * 10 + x
    return (q, p), p[...]


def _python_loop(body, carry, n):
    for i in range(n):
        carry = body(i, carry)
    return carry


def test_fori_loop_moving_carry_objects_is_refused_as_flax_gives_not_the_loops_values():
    """flax.nnx with graph updates: after 2 swaps q comes first, and p holds what Python's
    loop leaves in q; after 3 it agrees with Python.  Without graph updates flax.nnx refuses
    it (a ValueError), as varjax does in every mode."""
    p, q = _cells(flax_nnx)
    out = flax_nnx.fori_loop(0, 2, _fori_body, (p, q))
    assert out[0] is q and (float(p.v[...]), float(q.v[...])) == (21.0, 10.0)
    a, b = _cells(flax_nnx)
    ref = _python_loop(_fori_body, (a, b), 2)
    assert ref[0] is a and (float(a.v[...]), float(b.v[...])) == (10.0, 21.0)
    with pytest.raises(ValueError, match="identity must be preserved"):
        flax_nnx.fori_loop(0, 2, _fori_body, _cells(flax_nnx), graph_updates=False)
    for mode in MODES:
        p, q = _cells(nnx)
        with pytest.raises(errors.CarryIdentityError, match=r"carry\[0\] holds the Cell "
                           r"given at carry\[1\]; flax.nnx 0.12.8 takes it") as e:
            fori_loop(0, 2, _fori_body, (p, q), **mode)
        assert isinstance(e.value, errors.TransformError) and isinstance(e.value, ValueError)
        assert "test_nnx_moved_carry.py" in e.value.source
        assert (float(p.v[...]), float(q.v[...])) == (1.0, 2.0)


def test_scan_moving_carry_modules_is_a_value_error_as_flax_raises():
    for mode in MODES:
        with pytest.raises(ValueError, match="Carry references must be the same|identity"):
            flax_nnx.scan(lambda c, x: ((c[1], c[0]), x), **mode)(_cells(flax_nnx),
                                                                   jnp.arange(2.0))
        with pytest.raises(errors.CarryIdentityError, match=r"carry\[0\] holds the Cell "
                           r"given at carry\[1\]; flax.nnx refuses it"):
            scan(lambda c, x: ((c[1], c[0]), x), **mode)(_cells(nnx), jnp.arange(2.0))


def test_scan_swapping_bare_variables_is_refused_as_flax_gives_not_the_loops_values():
    """flax.nnx takes swapped bare Variables in a scan carry with graph updates: after 2
    steps a holds what the Python loop leaves in b."""
    a, b = flax_nnx.Param(jnp.array(1.0)), flax_nnx.Param(jnp.array(2.0))
    (p, _), _ = flax_nnx.scan(_scan_body)((a, b), jnp.arange(1.0, 3.0))
    assert p is b and (float(a[...]), float(b[...])) == (22.0, 11.0)
    c, d = flax_nnx.Param(jnp.array(1.0)), flax_nnx.Param(jnp.array(2.0))
    carry = (c, d)
    for x in jnp.arange(1.0, 3.0):
        carry, _ = _scan_body(carry, x)
    assert carry[0] is c and (float(c[...]), float(d[...])) == (11.0, 22.0)
    with pytest.raises(errors.CarryIdentityError, match=r"carry\[0\] holds the Param given "
                       r"at carry\[1\]"):
        scan(_scan_body, in_axes=(Carry, 0), out_axes=(Carry, 0))(
            (nnx.Param(jnp.array(1.0)), nnx.Param(jnp.array(2.0))), jnp.arange(1.0, 3.0))


def test_while_loop_moving_carry_objects_is_a_value_error_as_flax_raises():
    with pytest.raises(ValueError, match="same reference"):
        flax_nnx.while_loop(lambda c: c[0].v[...] < 100, lambda c: _fori_body(0, c),
                            _cells(flax_nnx))
    with pytest.raises(errors.CarryIdentityError, match="number of steps is not known"):
        while_loop(lambda c: c[0].v[...] < 100, lambda c: _fori_body(0, c), _cells(nnx))


def test_swapping_variable_values_instead_gives_the_python_loops_values():
    """The fix the error names: swap the Variables' values, keep the objects in place."""
    def body(i, c):
        p, q = c
        p.v[...] = p.v[...] * 10 + i
        p.v[...], q.v[...] = q.v[...], p.v[...]
        return p, q
    p, q = _cells(nnx)
    out = fori_loop(0, 2, body, (p, q))
    a, b = _cells(flax_nnx)
    _python_loop(body, (a, b), 2)
    assert out[0] is p and out[1] is q
    assert (float(p.v[...]), float(q.v[...])) == (float(a.v[...]), float(b.v[...]))
