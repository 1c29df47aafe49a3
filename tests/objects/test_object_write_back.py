"""``Graph.write_back``: a call's updates reach every node of its arguments, whatever its
kind (a graph's Variables are set in one loop, other nodes by their kind's writer), on the
first call, which walks the arguments, and on the calls after it, which reuse the kept
graph; a variable the call did not write keeps its value object."""
import jax.numpy as jnp
import numpy as np
from object_models import MLP, X, assert_tree_close, bound

import varjax as vj


def _step(variables, rngs, model, x):
    variables[0].value = variables[0].value + 1.0      # written
    doubled = variables[1].value * 2.0                 # read, not written
    return model(x).sum() + doubled + rngs.normal(())  # batch_stats and the stream move


def _objects():
    variables = [vj.Variable(jnp.zeros(2)), vj.Variable(jnp.ones(2))]
    model, _ = bound(MLP(), mutable="batch_stats")
    return variables, vj.Rngs(0), model


def test_every_kind_of_node_is_written_back_as_an_eager_call_writes_it():
    jitted_objects, eager_objects = _objects(), _objects()
    step = vj.jit(_step)
    for _ in range(3):         # the first call walks the arguments, the next reuse the graph
        got = step(*jitted_objects, X)
        want = _step(*eager_objects, X)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for jitted, eager in zip(jitted_objects[0], eager_objects[0]):
        np.testing.assert_array_equal(jitted.value, eager.value)
    assert_tree_close(vj.state(jitted_objects[2]), vj.state(eager_objects[2]))
    np.testing.assert_array_equal(jitted_objects[1].normal(()), eager_objects[1].normal(()))


def test_a_variable_the_call_does_not_write_keeps_its_value_object():
    variables, rngs, model = _objects()
    read_only = variables[1].value
    step = vj.jit(_step)
    for _ in range(2):
        step(variables, rngs, model, X)
    assert variables[1].value is read_only
    np.testing.assert_array_equal(variables[0].value, [2.0, 2.0])
