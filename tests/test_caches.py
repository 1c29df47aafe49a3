"""Cache keys tell static values apart by type and value, recursively (``1``, ``1.0`` and
``True`` are three programs, as under ``jax.jit(static_argnums=...)``); the per-function
caches are bounded LRUs that ``jax.clear_caches()`` / ``vj.clear_caches()`` release."""
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as nn
from varjax.ir import caches
from varjax.ir.statics import typed

X = jnp.ones(2)
# Pairs, not a dict: as dict keys 1, 1.0 and True are one key.
CASES = [(1, jnp.int32), (1.0, jnp.float32), (True, jnp.bool_)]


@vj.functionalize
def fill(x, c):
    return jnp.full((2,), c)


@pytest.mark.parametrize("via", ["apply", "jit", "jaxpr"])
def test_static_int_float_and_bool_are_three_programs(via):
    for c, dtype in CASES:
        if via == "apply":
            out = fill.apply({}, X, c)
        elif via == "jit":     # under a trace: the Python-keyed cache, not the eager dispatch
            out = jax.jit(lambda x, c=c: fill.apply({}, x, c))(X)
        else:
            out = fill.jaxpr(X, c).out_avals[0]
        assert out.dtype == dtype, c


def test_static_values_nested_in_tuples_and_dicts_keep_their_types():
    @vj.functionalize
    def f(x, cfg):
        return jnp.full((2,), cfg["fill"][0])

    for c, dtype in CASES:
        assert f.apply({}, X, {"fill": (c,)}).dtype == dtype


def test_lifted_call_keys_keep_static_types_apart():
    class Fill(nn.Module):
        @nn.compact
        def __call__(self, x, c):
            return jnp.full(x.shape, c)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x, c):
            return nn.jit(Fill)()(x, c)

    for c, dtype in CASES:
        assert Outer().apply({}, X, c).dtype == dtype


def test_init_function_closures_capturing_int_and_float_are_typed_apart():
    @vj.functionalize
    def f(x, c):
        return vj.param("w", lambda key, c=c: jnp.full((2,), c))

    for c, dtype in CASES[:2]:
        variables = f.init(jax.random.key(0), X, c)
        assert f.apply(variables, X, c).dtype == dtype


def test_typed_keys():
    assert typed(1) != typed(1.0) != typed(True)
    assert typed((1, [2.0], {"a": True})) == typed((1, [2.0], {"a": True}))
    assert typed((1,)) != typed([1])
    assert typed({"a": 1}) != typed({"a": 1.0})
    assert typed(frozenset({1})) != typed(frozenset({1.0}))
    with pytest.raises(TypeError):
        hash(typed([object.__new__(type("Unhashable", (), {"__hash__": None}))]))


def test_caches_are_bounded_lrus_released_by_jax_clear_caches():
    @vj.functionalize
    def f(x):
        return 2 * x

    old = caches.cache_size()
    caches.set_cache_size(4)
    try:
        for n in range(1, 8):
            jax.jit(f.apply)({}, jnp.ones(n))   # the keyed (traced) path
            f.apply({}, jnp.ones(n))            # the eager dispatch path
        # A compiled entry keeps the pure jaxpr only: the effectful trace went with it.
        assert len(f._cache) == 4 and len(f._traces) == 0
        for n in range(1, 8):
            f.jaxpr(jnp.ones(n), variables={})  # inspection keeps effectful traces, bounded
        assert len(f._traces) == 4
        f.apply({}, jnp.ones(4))                # a hit moves the entry to the front
        jax.jit(f.apply)({}, jnp.ones(8))
        assert len(f._cache) == 4
        jax.clear_caches()
        assert len(f._traces) == len(f._cache) == len(f._eager) == 0
        assert float(f.apply({}, jnp.ones(3))[0]) == 2.0   # still usable afterwards
        vj.clear_caches()
        assert len(f._traces) == len(f._cache) == len(f._eager) == 0
    finally:
        caches.set_cache_size(old)


def test_lru_drops_the_least_recently_used_entry():
    old = caches.cache_size()
    caches.set_cache_size(2)
    try:
        lru = caches.LRU()
        lru["a"], lru["b"] = 1, 2
        assert lru.get("a") == 1           # "b" is now the oldest
        lru["c"] = 3
        assert list(lru) == ["a", "c"]
    finally:
        caches.set_cache_size(old)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_cache_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="positive int"):
        caches.set_cache_size(bad)


class _Token:
    """Pytree metadata that can be watched: a weak reference tells when it is freed."""

    def __eq__(self, other):
        return isinstance(other, _Token)

    def __hash__(self):
        return 0


@jax.tree_util.register_pytree_node_class
class _Tagged:
    def __init__(self, value, token):
        self.value, self.token = value, token

    def tree_flatten(self):
        return (self.value,), self.token

    @classmethod
    def tree_unflatten(cls, token, children):
        return cls(children[0], token)


def _trace_a_model_reading(token: _Token) -> None:
    class Model(nn.Module):
        def __call__(self, x):
            return x * self.get_variable("stats", "tagged").value

    v = {"stats": {"tagged": _Tagged(jnp.ones(()), token)}}
    jax.make_jaxpr(lambda x: Model().apply(v, x))(jnp.ones(()))   # v is no input of this trace


def test_a_variables_treedef_is_freed_with_the_model_not_kept_by_jax_caches():
    """Variable equations carry the variable's treedef; JAX's abstract-evaluation cache
    (bounded, but at 2,048 entries) would keep it, and every path, alive after the model."""
    token = _Token()
    alive = weakref.ref(token)
    _trace_a_model_reading(token)
    del token
    gc.collect()
    assert alive() is None


def test_a_compiled_function_lets_its_effectful_trace_go():
    """After the pipeline has run, the cache keeps the pure jaxpr only: the effectful
    trace (its reads, their source lines) is freed, also when discharge wrapped custom
    rules that JAX traces later: a library one (relu's) and a user's."""
    @jax.custom_jvp
    def double(x):
        return 2 * x

    @double.defjvp
    def double_jvp(primals, tangents):
        return double(primals[0]), 2 * tangents[0]

    @vj.functionalize
    def f(x):
        return double(jax.nn.relu(x @ vj.param("w", jax.nn.initializers.ones, (3, 3))))

    v = f.init(jax.random.key(0), jnp.ones(3))
    traced = weakref.ref(f.jaxpr(jnp.ones(3), variables=v).jaxpr)
    f.apply(v, jnp.ones(3))           # compiled from that trace, which it then lets go
    gc.collect()
    assert traced() is None
    assert f.trace_count == 2         # init and apply: the apply reused the inspected trace
    g = jax.grad(lambda v: f.apply(v, jnp.ones(3)).sum())(v)   # relu's rule, traced now
    np.testing.assert_allclose(g["params"]["w"], 2 * np.ones((3, 3)))
