"""What a module made by ``bind`` brings into object-mode transforms besides its variables:
its ``passes=``, its RNG keys (``rngs={...}``) and its ``mutable=``.

Each holds in every transform, nested ones included, as in an eager call of the module.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn

X = jnp.arange(8.0).reshape(2, 4) / 8


class Lin(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(3)(x)


LORA = "lora{rank=2}"
# trained adapters: the adapted model differs from the base one
ADAPTED = jax.tree.map(lambda a: a + 0.25, Lin().init(jax.random.key(0), X, passes=LORA))
BASE = {"params": ADAPTED["params"]}


def _transformed_calls() -> dict[str, object]:
    """Each object-mode transform calling the model once on X."""
    def body(i: jax.Array, carry: tuple) -> tuple:
        m, acc = carry
        return m, acc + m(X)
    return {
        "jit": lambda m: vj.jit(lambda m: m(X))(m),
        "remat": lambda m: vj.remat(lambda m: m(X))(m),
        "vmap": lambda m: vj.vmap(lambda m, x: m(x), in_axes=(None, 0))(m, X),
        "scan": lambda m: vj.scan(lambda m, x: (m, m(x)))(m, X)[1],
        "cond": lambda m: vj.cond(True, lambda m: m(X), lambda m: -m(X), m),
        "fori_loop": lambda m: vj.fori_loop(0, 1, body, (m, jnp.zeros((2, 3))))[1],
        "while_loop": lambda m: vj.while_loop(
            lambda c: c[2] < 1, lambda c: (c[0], c[1] + c[0](X), c[2] + 1),
            (m, jnp.zeros((2, 3)), 0))[1],
        "capture": lambda m: vj.capture(m, "intermediates")(X)[0],
        "jit(remat)": lambda m: vj.jit(lambda m: vj.remat(lambda n: n(X))(m))(m),
        "grad(jit) value": lambda m: vj.value_and_grad(lambda m: vj.jit(lambda n: n(X))(m).sum(),
                                                       )(m)[0],
    }


def test_bind_passes_follow_the_module_into_every_object_transform() -> None:
    adapted = Lin().apply(ADAPTED, X, passes=LORA)
    assert not np.allclose(adapted, Lin().apply(BASE, X))
    model = Lin().bind(ADAPTED, passes=LORA)
    np.testing.assert_allclose(model(X), adapted, rtol=1e-6)
    for name, call in _transformed_calls().items():
        out = call(model)
        want = adapted.sum() if name == "grad(jit) value" else adapted
        np.testing.assert_allclose(out, want, rtol=1e-6, err_msg=name)


def test_stop_gradient_bound_with_the_module_freezes_it_under_grad() -> None:
    model = Lin().bind(BASE, passes="stop-gradient{collection=params}")
    loss = lambda m: m(X).sum()   # noqa: E731
    for name, grads in [("grad", vj.grad(loss)(model)),
                        ("jit(grad)", vj.jit(lambda m: vj.grad(loss)(m))(model)),
                        ("grad(remat)", vj.grad(lambda m: vj.remat(loss)(m))(model))]:
        for leaf in jax.tree.leaves(vj.state(grads, "params")):
            np.testing.assert_array_equal(leaf, 0.0, err_msg=name)
    # the gradient of the same module bound without the pass is not zero
    assert np.abs(vj.state(vj.grad(loss)(Lin().bind(BASE)), "params")["params"]["Dense_0"]["bias"]).min() > 0


def test_modules_bound_with_different_passes_in_one_call_each_run_their_own() -> None:
    adapted = Lin().bind(ADAPTED, passes=LORA)
    base = Lin().bind(BASE)
    want = Lin().apply(ADAPTED, X, passes=LORA) - Lin().apply(BASE, X)
    got = vj.jit(lambda student, teacher: student(X) - teacher(X))(adapted, base)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # the same passes, written another way, are the same pipeline
    same = Lin().bind(ADAPTED, passes=[" lora{rank=2} "])
    np.testing.assert_allclose(vj.jit(lambda a, b: a(X) - b(X))(adapted, same), 0.0)


class Drop(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x))


DROP = Drop().init(jax.random.key(0), X)


def _drop_loss(m: nn.Module) -> jax.Array:
    return (m(X) ** 2).sum()


def _keyed() -> nn.Module:
    return Drop().bind(DROP, rngs={"dropout": jax.random.key(7)})


def test_bound_rng_keys_reach_nested_transforms_with_the_unnested_masks() -> None:
    once = _drop_loss
    grads = vj.state(vj.grad(once)(_keyed()), "params")
    value = vj.jit(once)(_keyed())
    nested_grads = {
        "jit(grad)": vj.jit(lambda b: vj.grad(once)(b))(_keyed()),
        "grad(jit)": vj.grad(lambda b: vj.jit(once)(b))(_keyed()),
    }
    for name, got in nested_grads.items():
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=name),
                     vj.state(got, "params"), grads)
    np.testing.assert_array_equal(vj.remat(lambda b: vj.jit(once)(b))(_keyed()), value)
    # the module's next call still draws fresh keys, nested or not
    model = _keyed()
    first = vj.jit(lambda b: vj.jit(once)(b))(model)
    assert float(first) == float(value)
    assert float(vj.jit(lambda b: vj.jit(once)(b))(model)) != float(first)


def test_two_nested_calls_in_one_trace_draw_different_masks() -> None:
    twice = vj.jit(lambda b: (vj.jit(_drop_loss)(b), vj.jit(_drop_loss)(b)))(_keyed())
    assert float(twice[0]) == float(vj.jit(_drop_loss)(_keyed()))
    assert float(twice[0]) != float(twice[1])


class Stats(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.BatchNorm(use_running_average=False)(x)


def test_immutable_write_of_a_bound_module_names_bind_in_the_fix() -> None:
    model = Stats().bind(Stats().init(jax.random.key(0), X))
    for call in (lambda: model(X), lambda: vj.jit(lambda m: m(X))(model)):
        with pytest.raises(vj.errors.ImmutableCollectionError) as caught:
            call()
        assert caught.value.fix == ("pass mutable=['batch_stats'] to bind: module.bind(variables, "
                                    "mutable=['batch_stats']), or mutable=True for every collection")
        assert "BatchNorm_0/mean" in str(caught.value)
    with pytest.raises(vj.errors.ImmutableCollectionError) as caught:
        Stats().apply(Stats().init(jax.random.key(0), X), X)
    assert caught.value.fix == "pass mutable=['batch_stats'] to apply"


def test_nested_call_after_a_draw_of_its_trace_draws_other_masks() -> None:
    def both(m: nn.Module) -> tuple[jax.Array, jax.Array]:
        return _drop_loss(m), vj.jit(_drop_loss)(m)
    own, nested = vj.jit(both)(_keyed())
    assert float(own) == float(vj.jit(_drop_loss)(_keyed()))
    assert float(nested) != float(own)


class _OnlyDropout(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(x)


def test_two_modules_bound_with_keys_of_one_stream_in_one_call_is_an_error():
    """One call draws from one key per stream: the first module would silently draw from
    the second's key (its own key ignored), so this is refused, as two Rngs are."""
    x = jnp.ones((1, 8))
    a = _OnlyDropout().bind({}, rngs={"dropout": jax.random.key(1)})
    b = _OnlyDropout().bind({}, rngs={"dropout": jax.random.key(2)})
    with pytest.raises(vj.errors.TransformError,
                       match=r"modules at p and q were both bound with a key for stream 'dropout'") as info:
        vj.jit(lambda p, q: (p(x), q(x)))(a, b)
    assert info.value.collection == "rngs" and "test_object_bound_root.py" in info.value.source


class _Caches(nn.Module):
    @nn.compact
    def __call__(self, x):
        self.put_variable("cache", "n", x)     # a new variable in an immutable collection
        return x


def test_creating_a_variable_in_an_immutable_collection_of_a_bound_module_names_bind():
    for call in (lambda m: m(X), lambda m: vj.jit(lambda m: m(X))(m)):
        with pytest.raises(vj.errors.ImmutableCollectionError) as caught:
            call(_Caches().bind({}))
        assert caught.value.fix == ("pass mutable=['cache'] to bind: module.bind(variables, "
                                    "mutable=['cache']), or mutable=True for every collection")
    with pytest.raises(vj.errors.ImmutableCollectionError) as caught:
        _Caches().apply({}, X)
    assert caught.value.fix == "pass mutable=['cache'] to apply"
