"""Variable writes under raw JAX transforms are written back or refused, never lost in silence
(``varjax/trace/raw_writes.py``): a closed-over Variable written inside ``jax.jit``,
``jax.vmap``, a ``jax.lax`` body or a transform it was not passed to is refused at the write;
a write to the copy JAX made of an argument that the function does not return is reported
at the original's next use.  flax.nnx refuses the first and drops the second silently."""
from __future__ import annotations

import flax.nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
from varjax import nnx

X = jnp.ones((1, 2))


def _counted(lib):
    class Count(lib.Variable):
        pass

    class Counted(lib.Module):
        def __init__(self, rngs):
            self.linear = lib.Linear(2, 2, rngs=rngs)
            self.calls = Count(jnp.array(0))

        def __call__(self, x):
            self.calls[...] += 1            # the write every test below looks for
            return self.linear(x)
    return Counted(lib.Rngs(0))


@pytest.fixture
def model():
    return _counted(nnx)


_WRITE_LINE = "test_raw_transform_writes.py:30"


@pytest.mark.parametrize("transform", [
    lambda m: jax.jit(lambda x: m(x))(X),
    lambda m: jax.vmap(lambda x: m(x))(jnp.ones((3, 1, 2))),       # the write is unbatched
    lambda m: jax.lax.scan(lambda c, _: (m(c), None), X, None, length=2),
    lambda m: jax.grad(lambda x: m(x).sum())(X),
    lambda m: nnx.jit(lambda x: m(x))(X),
    lambda m: nnx.vmap(lambda x: m(x))(jnp.ones((3, 1, 2))),
], ids=["jax.jit", "jax.vmap", "lax.scan", "jax.grad", "nnx.jit", "nnx.vmap"])
def test_a_closed_over_module_written_inside_a_transform_is_refused_at_the_write(model, transform):
    with pytest.raises(vj.errors.TransformError, match="holds it as a constant") as info:
        transform(model)
    # the class's collection: 'Count', or 'Count@...' after another test's Count class
    assert info.value.collection == model.calls.collection and _WRITE_LINE in info.value.source
    assert int(model.calls[...]) == 0            # no tracer was left in it


def test_a_closed_over_object_mode_variable_is_refused_and_an_argument_is_written_back():
    v = vj.Variable(jnp.array(1.0), collection="counts")

    def bump():
        v.value += 1
    with pytest.raises(vj.errors.TransformError, match="'counts' was written inside"):
        vj.jit(bump)()
    vj.jit(lambda v: setattr(v, "value", v.value + 1))(v)
    assert float(v.value) == 2.0


def test_the_module_passed_to_nnx_jit_is_written_back(model):
    nnx.jit(lambda m, x: m(x))(model, X)
    assert int(model.calls[...]) == 1


def test_a_write_to_jax_jits_copy_not_returned_is_reported_at_the_next_use(model):
    jax.jit(lambda m, x: m(x))(model, X)
    with pytest.raises(vj.errors.TransformError, match="was lost") as info:
        model.calls[...]
    assert info.value.collection == model.calls.collection and _WRITE_LINE in info.value.source
    assert int(model.calls[...]) == 0            # reported once; the model is as it was


def test_the_lost_write_is_reported_when_the_next_call_flattens_the_module(model):
    step = jax.jit(lambda m, x: m(x))
    step(model, X)
    with pytest.raises(vj.errors.TransformError, match="was lost"):
        step(model, X)                           # a cache hit: JAX only flattens the model


@pytest.mark.parametrize("transform", [
    lambda m: jax.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, jnp.ones((3, 1, 2))),
    lambda m: jax.grad(lambda m, x: m.linear(x).sum() + m(x).sum(), allow_int=True)(m, X),
], ids=["jax.vmap", "jax.grad"])
def test_other_raw_transforms_report_a_lost_write_to_their_copy(model, transform):
    transform(model)
    with pytest.raises(vj.errors.TransformError, match="was lost"):
        model.calls[...]


def test_a_copy_the_function_returns_is_not_lost(model):
    _, new = jax.jit(lambda m, x: (m(x), m))(model, X)
    assert int(new.calls[...]) == 1 and int(model.calls[...]) == 0


def test_a_scan_carry_module_comes_back_updated_and_nothing_is_reported(model):
    final, _ = jax.lax.scan(lambda m, _: (m, m(X)), model, None, length=3)
    assert int(final.calls[...]) == 3 and int(model.calls[...]) == 0


def test_a_module_made_and_written_inside_jax_jit_is_its_own(model):
    def make_and_call(x):
        m = _counted(nnx)
        return m(x), nnx.state(m)
    _, state = jax.jit(make_and_call)(X)
    assert int(state["calls"][...]) == 1


def test_tracing_only_blocks_report_nothing_for_make_jaxpr_and_eval_shape(model):
    with vj.tracing_only():
        jax.make_jaxpr(lambda m, x: m(x))(model, X)
        jax.eval_shape(lambda m, x: m(x), model, X)
    assert int(model.calls[...]) == 0
    jax.make_jaxpr(lambda m, x: m(x))(model, X)
    with pytest.raises(vj.errors.TransformError, match="vj.tracing_only"):
        model.calls[...]


def test_flax_nnx_drops_the_same_write_silently():
    theirs = _counted(flax.nnx)
    jax.jit(lambda m, x: m(x))(theirs, X)
    np.testing.assert_array_equal(theirs.calls[...], 0)     # no error, no update


# --- RNG streams: a draw writes the stream's count ---------------------------------------

def _dropped(lib):
    class Dropped(lib.Module):
        def __init__(self, rngs):
            self.drop = lib.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(x)
    return Dropped(lib.Rngs(0, dropout=1))


def test_a_closed_over_rngs_drawn_from_inside_jax_jit_is_refused_naming_the_stream():
    rngs = nnx.Rngs(0)
    with pytest.raises(vj.errors.TransformError, match="RNG stream 'default'"):
        jax.jit(lambda: rngs.normal(()))()
    assert int(rngs.default.count) == 0          # no tracer left in the count


def test_a_dropout_stream_copied_by_jax_jit_and_not_returned_is_reported():
    """Each call of the compiled step would draw the same mask: flax.nnx does so silently."""
    model, x = _dropped(nnx), jnp.ones((4,))
    jax.jit(lambda m, x: m(x))(model, x)
    with pytest.raises(vj.errors.TransformError, match="RNG stream 'dropout'.* was lost"):
        nnx.jit(lambda m, x: m(x))(model, x)
    theirs = _dropped(flax.nnx)
    step = jax.jit(lambda m, x: m(x))
    np.testing.assert_array_equal(step(theirs, x), step(theirs, x))    # the same mask twice


def test_a_stream_returned_from_jax_jit_draws_on():
    rngs = nnx.Rngs(0)
    key, rngs2 = jax.jit(lambda r: (r(), r))(rngs)
    assert int(rngs2.default.count) == 1 and int(rngs.default.count) == 0
    assert not np.array_equal(jax.random.key_data(rngs2()), jax.random.key_data(key))


def test_a_linen_apply_drawing_from_jax_jits_copy_of_an_rngs_reports_it_at_the_next_apply():
    from varjax import nn

    class Dropped(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(x)
    model, x, rngs = Dropped(), jnp.ones((4,)), vj.Rngs(0, dropout=1)
    variables = model.init(rngs, x)
    _, returned = jax.jit(lambda x, r: (model.apply(variables, x, rngs=r), r))(x, rngs)
    model.apply(variables, x, rngs=rngs)                   # the copy came back: nothing lost
    jax.jit(lambda x, r: model.apply(variables, x, rngs=r))(x, rngs)
    with pytest.raises(vj.errors.TransformError, match="RNG stream 'dropout'.* was lost"):
        model.apply(variables, x, rngs=rngs)
