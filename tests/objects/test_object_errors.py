"""Object-mode misuse raises the ``varjax.errors`` class that names the problem: Linen-only
options, a module of a running init/apply in a non-first position, two RNG states for one
stream, and a Variable handle used after its transform returned."""
import jax
import jax.numpy as jnp
import pytest
from object_models import Lin, X, bound

import varjax as vj
import varjax.nn as nn

LINEN_ONLY = {
    "vmap_variable_axes": lambda m: vj.vmap(lambda m, x: m(x), variable_axes={"params": 0})(m, X),
    "vmap_split_rngs": lambda m: vj.vmap(lambda m: 0.0, split_rngs={"params": True})(m),
    "jit_variables": lambda m: vj.jit(lambda m: 0.0, variables="params")(m),
    "remat_rngs": lambda m: vj.remat(lambda m: 0.0, rngs=False)(m),
    "scan_variable_axes": lambda m: vj.scan(lambda c, x: (c, x),
                                            variable_axes={"params": 0})(m, X),
    "while_loop_carry_variables": lambda m: vj.while_loop(lambda s: False, lambda s: s, m,
                                                          carry_variables="params"),
    "cond_variables": lambda m: vj.cond(True, lambda m: 1.0, lambda m: 2.0, m,
                                        variables="params"),
    "grad_variables": lambda m: vj.grad(lambda m: 0.0, variables="params")(m),
    "custom_vjp_grad_vars": lambda m: vj.custom_vjp(lambda m: 0.0, grad_vars="batch_stats"),
}


@pytest.mark.parametrize("call", list(LINEN_ONLY.values()), ids=list(LINEN_ONLY))
def test_linen_only_option_in_object_mode_raises_naming_it(call):
    model, _ = bound(Lin())
    with pytest.raises(vj.errors.TransformError) as info:
        call(model)
    assert "Linen's option" in str(info.value)


@pytest.mark.parametrize("transform", ["jit", "vmap"])
def test_module_of_running_init_in_a_non_first_position_raises(transform):
    wrap = getattr(vj, transform)

    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            return wrap(lambda x, m: x * 2)(x, self)
    with pytest.raises(vj.errors.TransformError) as info:
        Bad().init(jax.random.key(0), jnp.ones(3))
    assert "argument 1" in str(info.value)


def test_module_of_running_init_first_takes_the_lifted_form():
    class Good(nn.Module):
        @nn.compact
        def __call__(self, x):
            return vj.jit(lambda m, x: m.param("w", nn.initializers.ones, (3,)) * x)(self, x)
    variables = Good().init(jax.random.key(0), jnp.ones(3))
    assert jax.tree.map(jnp.shape, variables) == {"params": {"w": (3,)}}


def test_two_modules_with_their_own_rng_state_raise():
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(x)
    a = Drop().bind({}, rngs=vj.Rngs(dropout=1))
    b = Drop().bind({}, rngs=vj.Rngs(dropout=2))
    with pytest.raises(vj.errors.TransformError) as info:
        vj.jit(lambda a, b: a(jnp.ones(2)) + b(jnp.ones(2)))(a, b)
    assert info.value.collection == "rngs"


def _keep_handle():
    kept = []

    @vj.jit
    def keep(v):
        kept.append(v)
        return v.value
    keep(vj.Variable(jnp.ones(2)))
    return kept[0]


def test_handle_used_in_a_later_transform_raises_invalid_scope_error():
    stale = _keep_handle()
    with pytest.raises(vj.errors.InvalidScopeError) as info:
        vj.jit(lambda w: stale.value + w.value)(vj.Variable(jnp.ones(2)))
    assert info.value.path == ("v",)


def test_handle_used_after_its_transform_returned_raises_invalid_scope_error():
    stale = _keep_handle()
    with pytest.raises(vj.errors.InvalidScopeError):
        stale.value
