"""An eager ``apply(..., mutable=...)`` merges what it wrote inside its ``jax.jit``
(``varjax.functionalization.updates``): a warm call does not walk the variables dict in
Python, and what it did not write comes back as the caller gave it."""
import jax
import jax.numpy as jnp
import numpy as np

import varjax as vj
from varjax.functionalization import functionalized

X = jnp.ones((2, 3), jnp.float32)


@vj.functionalize
def counted(x):
    w = vj.param("w", jax.nn.initializers.ones, (x.shape[-1], 2))
    n = vj.variable("counters", "n", lambda: jnp.zeros((), jnp.int32))
    vj.variable("counters", "kept", lambda: jnp.zeros((), jnp.float32))   # never written
    n.value += 1
    return x @ w


def test_a_warm_eager_apply_with_mutable_does_not_walk_the_variables_in_python(monkeypatch):
    v = counted.init(jax.random.key(0), X)
    counted.apply(v, X, mutable=["counters"])     # warm: traced and compiled
    walks = []
    inputs = functionalized._inputs
    monkeypatch.setattr(functionalized, "_inputs", lambda *a: walks.append(a) or inputs(*a))
    _, updated = counted.apply(v, X, mutable=["counters"])
    assert walks == []
    assert int(updated["counters"]["n"]) == 2 and list(updated) == ["counters"]


def test_a_given_variable_the_call_did_not_write_comes_back_as_given():
    v = counted.init(jax.random.key(0), X)
    given = {"params": v["params"], "counters": {"n": np.int32(4), "kept": np.float64(0.5)}}
    _, updated = counted.apply(given, X, mutable=True)
    assert updated["params"]["w"] is given["params"]["w"]
    kept = updated["counters"]["kept"]
    assert type(kept) is np.float64 and kept == 0.5     # not through jax.jit (float32 there)
    assert list(updated["counters"]) == ["kept", "n"] and int(updated["counters"]["n"]) == 5
