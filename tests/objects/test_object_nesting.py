"""Object-mode transforms nest: the inner transform gets the objects the outer one bound to
its trace, and the updates reach the outermost arguments."""
import jax
import jax.numpy as jnp
import numpy as np
from object_models import MLP, Lin, X, assert_tree_close, bound

import varjax as vj


def _loss(m, x):
    return jnp.sum(m(x) ** 2)


def _ref_grad(params, x):
    return jax.grad(lambda p: jnp.sum(Lin().apply({"params": p}, x) ** 2))(params)


def test_jit_of_grad_sgd_step_matches_pure_jax():
    model, variables = bound(Lin())
    traces = []

    @vj.jit
    def step(model, x):
        traces.append(1)
        grads = vj.grad(_loss)(model, x)
        graphdef, params = vj.split(model, "params")
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, vj.state(grads, "params"))
        return vj.merge(graphdef, new)

    params = variables["params"]
    for _ in range(2):
        model = step(model, X)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, _ref_grad(params, X))
    assert len(traces) == 1
    assert type(model) is Lin
    assert_tree_close(model.variables["params"], params, atol=1e-5)


def test_jit_of_grad_writes_back_batch_stats_of_the_outer_argument():
    model, variables = bound(MLP(), mutable=["batch_stats"])
    vj.jit(lambda m, x: vj.grad(_loss)(m, x))(model, X)
    _, updates = MLP().apply(variables, X, mutable=["batch_stats"])
    assert_tree_close(model.variables["batch_stats"], updates["batch_stats"])


def test_jit_of_variable_update_through_grad():
    v = vj.Variable(jnp.arange(3.0))

    @vj.jit
    def step(v):
        g = vj.grad(lambda v: jnp.sum(v.value ** 2))(v)
        v.value = v.value - 0.1 * g.value
        return g.value
    np.testing.assert_allclose(step(v), [0.0, 2.0, 4.0])
    np.testing.assert_allclose(v.value, [0.0, 0.8, 1.6], atol=1e-6)


def test_vmap_of_grad_gives_per_example_gradients():
    model, variables = bound(Lin())
    per_example = vj.vmap(lambda m, x: vj.grad(_loss)(m, x), in_axes=(None, 0))(model, X)
    expected = jax.vmap(_ref_grad, in_axes=(None, 0))(variables["params"], X)
    assert type(per_example) is Lin
    assert_tree_close(per_example.variables["params"], expected, atol=1e-5)


def test_grad_through_scan_over_a_variable_carry():
    w = vj.Variable(jnp.array(2.0))

    def loss(w):
        def body(w, x):
            return w, w.value * x
        _, ys = vj.scan(body)(w, jnp.arange(3.0))
        return ys.sum()
    assert float(vj.grad(loss)(w).value) == 3.0


def test_grad_through_scan_over_a_bound_module_carry():
    model, variables = bound(Lin())

    def loss(m):
        def body(m, x):
            return m, jnp.sum(m(x) ** 2)
        _, ys = vj.scan(body)(m, X)
        return ys.sum()
    grads = vj.grad(loss)(model)
    assert_tree_close(grads.variables["params"], _ref_grad(variables["params"], X), atol=1e-5)


def test_jit_of_vmap_stacks_updates_into_the_outer_argument():
    v = vj.Variable(jnp.zeros(3), collection="c")

    def bump(v, x):
        v.value = v.value + x
        return x

    @vj.jit
    def step(v, xs):
        return vj.vmap(bump)(v, xs)
    step(v, jnp.arange(3.0))
    np.testing.assert_array_equal(v.value, [0.0, 1.0, 2.0])


def test_jit_of_cond_writes_back():
    v = vj.Variable(jnp.ones(()), collection="c")

    def add(v):
        v.value = v.value + 1.0
        return 0.0

    @vj.jit
    def step(v, pred):
        return vj.cond(pred, add, lambda v: 1.0, v)
    step(v, True)
    step(v, False)
    assert float(v.value) == 2.0


def test_a_variable_a_nested_grad_does_not_differentiate_is_read_and_written_there():
    # jax.grad hands its non-differentiated arguments over as they are: here the enclosing
    # trace's handle, which binding read under the nested trace (InvalidScopeError).
    count = vj.Variable(jnp.zeros(()), collection="counts")

    def loss(x, c):
        c.value = c.value + 1
        return jnp.sum(x ** 2)

    @vj.jit
    def step(c, x):
        return vj.grad(loss, argnums=0)(x, c)
    g = step(count, jnp.arange(3.0))
    np.testing.assert_array_equal(g, 2 * jnp.arange(3.0))
    assert float(count.value) == 1.0
