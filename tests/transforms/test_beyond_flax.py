"""What varjax's lifting does beyond Flax Linen (issue 4, items 3a, 3e, 3f).

(a) Closures: a lifted body may use a module or a ``self.variable`` handle it closes over;
    Linen forbids this (the closed-over scope escapes the transformation).  varjax reads the
    body's variable traffic off the IR, so the closed-over variables are lifted like any other.
(e) Raw JAX transformations (``jax.jit``, ``lax.scan``, ``lax.cond``, ``lax.while_loop``,
    ``jax.checkpoint``) over stateful code inside a module's ``__call__``: they just work,
    also inside a lifted ``vj.vmap`` body.
(f) Raw ``jax.vmap`` over code that *writes* a variable raises ``TransformError`` pointing at
    ``vj.vmap``; raw ``jax.grad`` over stateful code treats variables as constants.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transform_checks import close as _close
from transform_checks import data as _data
from transform_checks import shapes as _shapes

import varjax.nn as nn
from varjax.errors import TransformError

XS = _data((3, 4))

# --- (a) closures ----------------------------------------------------------------------


class ClosesOverSetupModule(nn.Module):
    def setup(self):
        self.dense = nn.Dense(2)

    def __call__(self, xs):
        def inner(x):                    # self.dense is not an argument: it is closed over
            return self.dense(x) * 2.0
        return nn.vmap(inner, variable_axes={"params": 0}, split_rngs={"params": True})(xs)


class ClosesOverCompactModule(nn.Module):
    @nn.compact
    def __call__(self, xs):
        dense = nn.Dense(2)

        def inner(x):
            return dense(x) * 2.0
        return nn.vmap(inner, variable_axes={"params": 0}, split_rngs={"params": True})(xs)


@pytest.mark.parametrize("model", [ClosesOverSetupModule(), ClosesOverCompactModule()],
                         ids=["setup", "compact"])
def test_closed_over_submodule_is_lifted_with_the_vmapped_axis(model):
    v = model.init(jax.random.key(0), XS)
    (name,) = v["params"]
    assert name in ("dense", "Dense_0")
    p = v["params"][name]
    assert _shapes(p) == {"kernel": (3, 4, 2), "bias": (3, 2)}
    assert not np.allclose(p["kernel"][0], p["kernel"][1])
    want = jnp.einsum("bi,bio->bo", XS, p["kernel"]) + p["bias"]
    _close(model.apply(v, XS), 2.0 * want)


def test_closed_over_submodule_shared_when_its_collection_is_broadcast():
    class Shared(nn.Module):
        @nn.compact
        def __call__(self, xs):
            dense = nn.Dense(2)
            return nn.vmap(lambda x: dense(x), variable_axes={"params": None},
                           split_rngs={"params": False})(xs)

    model = Shared()
    v = model.init(jax.random.key(0), XS)
    p = v["params"]["Dense_0"]
    assert _shapes(p) == {"kernel": (4, 2), "bias": (2,)}
    _close(model.apply(v, XS), XS @ p["kernel"] + p["bias"][None])


def test_closed_over_variable_handle_is_read_and_written_through_the_region():
    class Accumulate(nn.Module):
        @nn.compact
        def __call__(self, xs):
            scale = self.variable("consts", "scale", jnp.ones, ())
            totals = self.variable("state", "totals", jnp.zeros, (xs.shape[0],))

            def inner(x):                # reads one handle, writes the other: neither passed
                totals.value = totals.value + jnp.sum(x)
                return x * scale.value
            return nn.vmap(inner, variable_axes={"consts": None, "state": 0})(xs)

    model = Accumulate()
    v = model.init(jax.random.key(0), XS)
    _close(v["state"]["totals"], XS.sum(1))
    v = {"consts": {"scale": jnp.float32(3.0)}, "state": {"totals": jnp.ones(3)}}
    out, upd = model.apply(v, XS, mutable=["state"])
    _close(out, 3.0 * XS)
    _close(upd["state"]["totals"], 1.0 + XS.sum(1))


def test_closed_over_variable_handle_under_a_lifted_jit():
    class Counted(nn.Module):
        @nn.compact
        def __call__(self, x):
            count = self.variable("state", "count", jnp.zeros, ())

            def step(x):
                count.value = count.value + 1.0
                return x * count.value
            return nn.jit(step)(x) + nn.jit(step)(x)

    model = Counted()
    v = model.init(jax.random.key(0), XS)
    assert float(v["state"]["count"]) == 2.0
    out, upd = model.apply(v, XS, mutable=["state"])
    assert float(upd["state"]["count"]) == 4.0
    _close(out, 3.0 * XS + 4.0 * XS)


# --- (e) raw JAX transformations over stateful code --------------------------------------


class RawOps(nn.Module):
    """Every raw transform over code that reads params and bumps a 'state' counter."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(x.shape[-1])
        count = self.variable("state", "count", jnp.zeros, ())
        h = dense(x)                                   # params created outside any loop

        def bump(by=1.0):
            count.value = count.value + by

        def layer(h):
            bump()
            return jnp.tanh(dense(h))

        h = jax.jit(layer)(h)
        h, _ = jax.lax.scan(lambda c, _: (layer(c), None), h, None, length=2)
        h = jax.lax.cond(jnp.sum(h) > 0, layer, lambda h: (bump(10.0), -h)[1], h)
        h = jax.lax.while_loop(lambda c: c[1] < 2, lambda c: (layer(c[0]), c[1] + 1),
                               (h, jnp.int32(0)))[0]
        h = jax.checkpoint(layer)(h)
        return h


def _raw_ops_reference(p, x, count):
    """RawOps in NumPy (float64)."""
    k, b = np.asarray(p["kernel"], np.float64), np.asarray(p["bias"], np.float64)
    layer = lambda h: np.tanh(h @ k + b)  # noqa: E731
    h = np.asarray(x, np.float64) @ k + b
    h = layer(h)                                        # jit
    h = layer(layer(h))                                 # scan, length 2
    if h.sum() > 0:                                     # cond
        h, count = layer(h), count + 1.0
    else:
        h, count = -h, count + 10.0
    h = layer(layer(h))                                 # while_loop, 2 iterations
    h = layer(h)                                        # checkpoint
    return h, count + 6.0


def test_raw_jax_transforms_inside_a_module_read_params_and_update_state():
    model = RawOps()
    x = _data((4,))
    v = model.init(jax.random.key(0), x)
    assert _shapes(v) == {"params": {"Dense_0": {"kernel": (4, 4), "bias": (4,)}},
                          "state": {"count": ()}}
    for start in (0.0, 100.0):
        v = {"params": v["params"], "state": {"count": jnp.float32(start)}}
        out, upd = model.apply(v, x, mutable=["state"])
        want, count = _raw_ops_reference(v["params"]["Dense_0"], x, start)
        _close(out, want)
        assert float(upd["state"]["count"]) == count


def test_raw_jax_transforms_inside_a_lifted_vmap_body():
    class Members(nn.Module):
        @nn.compact
        def __call__(self, xs):
            return nn.vmap(RawOps, variable_axes={"params": 0, "state": 0},
                           split_rngs={"params": True})()(xs)

    model = Members()
    v = model.init(jax.random.key(0), XS)
    p = v["params"]["VmapRawOps_0"]["Dense_0"]
    assert _shapes(p) == {"kernel": (3, 4, 4), "bias": (3, 4)}
    counts = jnp.array([0.0, 5.0, 50.0])
    v = {"params": v["params"], "state": {"VmapRawOps_0": {"count": counts}}}
    out, upd = model.apply(v, XS, mutable=["state"])
    got = upd["state"]["VmapRawOps_0"]["count"]
    # The members' lax.cond went both ways (+1 and +10 on top of the other six bumps).
    assert {float(got[i] - counts[i]) for i in range(3)} == {7.0, 16.0}
    for i in range(3):     # each member runs its own control flow (the cond may differ)
        want, count = _raw_ops_reference(jax.tree.map(lambda a: a[i], p), XS[i], float(counts[i]))
        _close(out[i], want)
        assert float(got[i]) == count


# --- (f) raw jax.vmap / jax.grad over stateful code --------------------------------------


def test_raw_jax_vmap_over_a_variable_write_raises_pointing_at_vj_vmap():
    class Writes(nn.Module):
        @nn.compact
        def __call__(self, xs):
            total = self.variable("state", "total", jnp.zeros, ())

            def per_example(x):
                total.value = total.value + jnp.sum(x)
                return x
            return jax.vmap(per_example)(xs)

    with pytest.raises(TransformError) as info:
        Writes().init(jax.random.key(0), XS)
    err = info.value
    assert err.collection == "state" and err.path == ("total",)
    assert "vj.vmap" in str(err)
    assert "test_beyond_flax.py:" in str(err)


def test_raw_jax_vmap_over_a_variable_read_broadcasts_it():
    class Reads(nn.Module):
        @nn.compact
        def __call__(self, xs):
            w = self.param("w", nn.initializers.ones, (4,))
            return jax.vmap(lambda x: x * w)(xs)

    model = Reads()
    v = model.init(jax.random.key(0), XS)
    v = {"params": {"w": jnp.arange(4.0)}}
    _close(model.apply(v, XS), XS * jnp.arange(4.0)[None])


def test_raw_jax_grad_over_stateful_code_holds_variables_constant():
    class GradInside(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.ones, (4,))
            seen = self.variable("state", "seen", jnp.zeros, (4,))

            def energy(x):
                seen.value = x               # a write inside grad stores the primal
                return jnp.sum(jnp.sin(x * w) * self.get_variable("params", "w"))
            return jax.grad(energy)(x)

    model = GradInside()
    x = _data((4,))
    v = model.init(jax.random.key(0), x)
    w = jnp.array([0.5, -1.0, 2.0, 3.0])
    v = {"params": {"w": w}, "state": {"seen": jnp.zeros(4)}}
    g, upd = model.apply(v, x, mutable=["state"])
    # d/dx sum(sin(x*w) * w) = cos(x*w) * w * w, with w a constant (no d/dw term).
    _close(g, jnp.cos(x * w) * w * w)
    _close(upd["state"]["seen"], x)
