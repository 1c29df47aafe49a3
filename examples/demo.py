"""The headline example: a stateful function, its effectful IR, its pure IR, and results.

Run with `make demo`.  Set VARJAX_DUMP_DIR=<dir> (or `make dump`) to also get the IR
after every pass as numbered files.
"""
import os

import jax
import jax.numpy as jnp

import varjax as vj


@vj.functionalize
def model(x):
    w = vj.param("w", jax.nn.initializers.lecun_normal(), (x.shape[-1], 4))
    n = vj.variable("counters", "n", lambda: jnp.zeros((), jnp.int32))
    n.value += 1
    h = x @ w
    if vj.is_mutable_collection("intermediates"):
        vj.sow("intermediates", "h", h)
    keep = jax.random.bernoulli(vj.make_rng("dropout"), 0.9, h.shape)
    return jnp.where(keep, h / 0.9, 0.0)


def main() -> None:
    x = jnp.ones((2, 3), jnp.float32)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = model.init(rngs, x)
    print("variables:", jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", variables), "\n")

    apply_kwargs = dict(variables=variables, rngs={"dropout": jax.random.key(2)},
                        mutable=["counters"])
    print("== effectful jaxpr (as traced) ==")
    print(model.jaxpr(x, **apply_kwargs), "\n")
    print(f"== pure jaxpr after `{model.pipeline}` ==")
    print(model.functional_jaxpr(x, **apply_kwargs), "\n")

    y, updates = model.apply(variables, x, rngs={"dropout": jax.random.key(2)},
                             mutable=["counters"])
    print("output:\n", y)
    print("counters after one apply:", int(updates["counters"]["n"]))
    for _ in range(3):
        model.apply(variables, x, rngs={"dropout": jax.random.key(2)}, mutable=["counters"])
    print(f"traces so far: {model.trace_count} (init, apply; repeated applies hit the cache)")
    if os.environ.get("VARJAX_DUMP_DIR"):
        print("per-pass IR dumps written under", os.environ["VARJAX_DUMP_DIR"])


if __name__ == "__main__":
    main()
