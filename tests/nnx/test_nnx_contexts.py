"""``split_context``/``merge_context``/``update_context``: splits and merges sharing their
numbering, and NNX's four-call update protocol, against flax.nnx."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

from varjax import errors, nnx
from varjax.nnx import contexts

LIBS = [(nnx, contexts), (flax_nnx, flax_nnx)]


def _foo(lib):
    class Foo(lib.Module):
        def __init__(self):
            self.x = lib.Param(jnp.ones(1))
    return Foo()


def _holder(lib, child):
    class Holder(lib.Module):
        def __init__(self, child):
            self.child = child
    return Holder(child)


@pytest.mark.parametrize("lib, ctxs", LIBS)
def test_the_update_protocol_refills_the_callers_object_in_place_as_flax_nnx(lib, ctxs):
    m1 = _foo(lib)
    x = m1.x
    with ctxs.update_context("tag"):
        with ctxs.split_context("tag") as ctx:
            g, s = ctx.split(m1)

        @jax.jit
        def f(g, s):
            with ctxs.merge_context("tag", inner=True) as ctx:
                m2 = ctx.merge(g, s)
            m2.a = 1                       # a new static attribute
            m2.ref = m2                    # a cycle
            m2.x[...] = m2.x[...] + 1
            m2.new = lib.Param(jnp.zeros(2))
            with ctxs.split_context("tag") as ctx:
                return ctx.split(m2)
        g_out, s_out = f(g, s)
        with ctxs.merge_context("tag", inner=False) as ctx:
            m3 = ctx.merge(g_out, s_out)
    assert m3 is m1 and m1.a == 1 and m1.ref is m1 and m1.x is x
    np.testing.assert_array_equal(m1.x[...], [2.0])
    assert type(m1.new) is lib.Param and m1.new[...].shape == (2,)


@pytest.mark.parametrize("lib, ctxs", LIBS)
def test_splits_in_one_context_share_objects_and_merges_rebuild_them_shared(lib, ctxs):
    a = _foo(lib)
    holder = _holder(lib, a)
    with ctxs.split_context() as ctx:
        ga, sa = ctx.split(a)
        gh, sh = ctx.split(holder)
    assert sorted(sa) == ["x"] and sorted(sh) == []     # a was split before: a reference
    with ctxs.merge_context() as ctx:
        a2 = ctx.merge(ga, sa)
        h2 = ctx.merge(gh, sh)
    assert h2.child is a2 and a2 is not a and a2.x is not a.x     # merges copy Variables
    with ctxs.split_context() as ctx:
        g, values = ctx.flatten(a, with_paths=False)
        g2, flat = ctx.flatten(holder)
    assert isinstance(values[0], jax.Array) and list(flat) == []
    with ctxs.merge_context() as ctx:
        a3 = ctx.unflatten(g, values)
        assert ctx.unflatten(g2, flat).child is a3 and type(a3.x) is lib.Param


def test_update_context_is_a_decorator_and_contexts_refuse_misuse_clearly():
    @contexts.update_context("deco")
    def inside():
        return contexts.current_update_context("deco")
    assert isinstance(inside(), contexts.UpdateContext)
    with pytest.raises(errors.TransformError, match="no update_context with tag 'deco'"):
        contexts.current_update_context("deco")
    with pytest.raises(errors.ConfigError, match="inner="):
        with contexts.merge_context("deco"):
            pass
    with contexts.split_context() as ctx, pytest.raises(errors.ConfigError, match="filters"):
        ctx.flatten(_foo(nnx), nnx.Param, with_paths=False)
