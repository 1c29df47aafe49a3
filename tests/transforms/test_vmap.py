"""Lifted ``vmap`` (and its sharded siblings ``shard_map`` / ``pmap``) on every kind of target.

Targets: a Module class (``nn.vmap(MLP, ...)``), a function taking a module first, a
method decorated in a class body, and a plain ``vj.functionalize`` function using
``vj.param``.  Each test checks numbers, not just shapes: the vmapped output is compared
with the un-vmapped module applied member by member to its slice of the variables.
"""
from __future__ import annotations

import functools

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from transform_checks import close as _close
from transform_checks import data as _data
from transform_checks import layout as _layout
from transform_checks import shapes as _shapes

import varjax as vj
import varjax.nn as nn


def _differ(a, b):
    return not np.allclose(np.asarray(a), np.asarray(b))


def _take(tree, i, axis=0):
    return jax.tree.map(lambda x: jnp.take(x, i, axis=axis), tree)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(4)(x))
        return nn.Dense(1)(h)


def _vmapped_mlp(**kw):
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, xs):
            return nn.vmap(MLP, **kw)()(xs)
    return Outer()


XS = _data((3, 4))


def _per_member(params, xs, axis=0):
    """The un-vmapped MLP applied to member i's slice of the params and of xs."""
    return jnp.stack([MLP().apply({"params": _take(params, i, axis)}, xs[i])
                      for i in range(xs.shape[0])])


# --- targets ---------------------------------------------------------------------------


def test_vmap_module_class_is_auto_named_and_stacks_params_along_axis_0():
    model = _vmapped_mlp(variable_axes={"params": 0}, split_rngs={"params": True})
    v = model.init(jax.random.key(0), XS)
    assert _shapes(v) == {"params": {"VmapMLP_0": {
        "Dense_0": {"kernel": (3, 4, 4), "bias": (3, 4)},
        "Dense_1": {"kernel": (3, 4, 1), "bias": (3, 1)}}}}
    p = v["params"]["VmapMLP_0"]
    k = p["Dense_0"]["kernel"]
    assert _differ(k[0], k[1]) and _differ(k[1], k[2])   # split_rngs: members init differently
    _close(model.apply(v, XS), _per_member(p, XS))


def test_vmap_split_rngs_false_initializes_every_member_identically():
    model = _vmapped_mlp(variable_axes={"params": 0}, split_rngs={"params": False})
    v = model.init(jax.random.key(0), XS)
    k = v["params"]["VmapMLP_0"]["Dense_0"]["kernel"]
    assert k.shape == (3, 4, 4)
    np.testing.assert_array_equal(k[0], k[1])
    np.testing.assert_array_equal(k[0], k[2])
    assert bool(jnp.any(k[0] != 0))


def test_vmap_variable_axes_none_broadcasts_one_shared_copy():
    model = _vmapped_mlp(variable_axes={"params": None}, split_rngs={"params": False})
    v = model.init(jax.random.key(0), XS)
    p = v["params"]["VmapMLP_0"]
    assert _shapes(p) == {"Dense_0": {"kernel": (4, 4), "bias": (4,)},
                          "Dense_1": {"kernel": (4, 1), "bias": (1,)}}
    _close(model.apply(v, XS), MLP().apply({"params": p}, XS))


def test_vmap_variable_axes_1_stacks_params_along_axis_1():
    model = _vmapped_mlp(variable_axes={"params": 1}, split_rngs={"params": True})
    v = model.init(jax.random.key(0), XS)
    p = v["params"]["VmapMLP_0"]
    assert _shapes(p) == {"Dense_0": {"kernel": (4, 3, 4), "bias": (4, 3)},
                          "Dense_1": {"kernel": (4, 3, 1), "bias": (1, 3)}}
    assert _differ(p["Dense_0"]["kernel"][:, 0], p["Dense_0"]["kernel"][:, 1])
    _close(model.apply(v, XS), _per_member(p, XS, axis=1))


def test_vmap_function_taking_a_module_first_lifts_that_module():
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, xs):
            dense = nn.Dense(2)
            f = nn.vmap(lambda mdl, x: mdl(x) * 2.0, variable_axes={"params": 0},
                        split_rngs={"params": True})
            return f(dense, xs)

    model = Outer()
    v = model.init(jax.random.key(1), XS)
    p = v["params"]["Dense_0"]
    assert _shapes(p) == {"kernel": (3, 4, 2), "bias": (3, 2)}
    want = jnp.einsum("bi,bio->bo", XS, p["kernel"]) + p["bias"]
    _close(model.apply(v, XS), 2.0 * want)


def test_vmap_as_method_decorator_in_a_class_body():
    class Members(nn.Module):
        @functools.partial(nn.vmap, variable_axes={"params": 0}, split_rngs={"params": True})
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, use_bias=False)(x)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, xs):
            return Members()(xs)

    model = Outer()
    v = model.init(jax.random.key(2), XS)
    k = v["params"]["Members_0"]["Dense_0"]["kernel"]
    assert k.shape == (3, 4, 3) and _differ(k[0], k[1])
    _close(model.apply(v, XS), jnp.einsum("bi,bio->bo", XS, k))


def test_vmap_plain_function_with_vj_param():
    def body(x):
        w = vj.param("w", jax.nn.initializers.normal(1.0), (4,))
        return jnp.sum(x * w)

    @vj.functionalize
    def f(xs):
        return vj.vmap(body, variable_axes={"params": 0}, split_rngs={"params": True})(xs)

    v = f.init(jax.random.key(3), XS)
    w = v["params"]["w"]
    assert w.shape == (3, 4) and _differ(w[0], w[1])
    _close(f.apply(v, XS), jnp.sum(XS * w, axis=1))


def test_vmap_leaves_alone_params_of_modules_outside_the_body():
    # The enclosing trace's other params ('params' too, but without the member axis) are
    # no input of the vmapped body: they neither break jax.vmap nor change.
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, xs):
            h = nn.Dense(4, name="before")(xs)
            h = nn.vmap(MLP, variable_axes={"params": 0}, split_rngs={"params": True})()(h)
            return nn.Dense(2, name="after")(h)

    model = Outer()
    v = model.init(jax.random.key(0), XS)
    assert _shapes(v["params"]["before"]) == {"kernel": (4, 4), "bias": (4,)}
    assert _shapes(v["params"]["after"]) == {"kernel": (1, 2), "bias": (2,)}
    out, upd = model.apply(v, XS, mutable=["params"])
    p = v["params"]
    h = XS @ p["before"]["kernel"] + p["before"]["bias"][None]
    want = _per_member(p["VmapMLP_0"], h) @ p["after"]["kernel"] + p["after"]["bias"][None]
    _close(out, want)
    jax.tree.map(np.testing.assert_array_equal, upd["params"], p)


def test_vmap_of_a_plain_function_passes_the_module_s_other_variables_through():
    # The body's groups hold every 'params' variable of the module, also `scale`, which has
    # no member axis: it is not handed to jax.vmap, and comes back unchanged.
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, xs):
            scale = self.param("scale", nn.initializers.ones, (5,))

            def body(x):
                return x * self.param("w", nn.initializers.normal(1.0), (4,))
            y = nn.vmap(body, variable_axes={"params": 0}, split_rngs={"params": True})(xs)
            return y, scale

    model = Outer()
    v = model.init(jax.random.key(0), XS)
    assert _shapes(v) == {"params": {"scale": (5,), "w": (3, 4)}}
    v = {"params": {"scale": jnp.arange(5.0), "w": v["params"]["w"]}}
    (y, scale), upd = model.apply(v, XS, mutable=["params"])
    _close(y, XS * v["params"]["w"])
    np.testing.assert_array_equal(scale, jnp.arange(5.0))
    jax.tree.map(np.testing.assert_array_equal, upd["params"], v["params"])


# --- axes ------------------------------------------------------------------------------


def test_vmap_in_axes_none_broadcasts_an_argument_and_out_axes_moves_the_output():
    def body(x, y):
        b = vj.param("b", jax.nn.initializers.normal(1.0), (2,))
        return x[:, None] * y[None, :] + b[None, :]      # (4, 2)

    @vj.functionalize
    def f(xs, y):
        return vj.vmap(body, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=(0, None), out_axes=1)(xs, y)

    y = _data((2,), seed=1)
    v = f.init(jax.random.key(0), XS, y)
    b = v["params"]["b"]
    assert b.shape == (3, 2)
    out = f.apply(v, XS, y)
    assert out.shape == (4, 3, 2)                  # member axis moved to 1
    _close(out, XS.T[:, :, None] * y[None, None, :] + b[None])


def test_vmap_axis_size_without_mapped_input_splits_the_init_key():
    @vj.functionalize
    def f():
        return vj.vmap(lambda: vj.param("w", jax.nn.initializers.normal(1.0), (2,)),
                       variable_axes={"params": 0}, split_rngs={"params": True}, axis_size=3)()

    v = f.init(jax.random.key(0))
    w = v["params"]["w"]
    assert w.shape == (3, 2)
    assert _differ(w[0], w[1]) and _differ(w[1], w[2])
    np.testing.assert_array_equal(f.apply(v), w)


def test_vmap_axis_name_collectives_see_every_member():
    class Centered(nn.Module):
        @nn.compact
        def __call__(self, x):
            s = self.param("s", nn.initializers.ones, (4,))
            total = jax.lax.psum(x, "members")
            return (x - jax.lax.pmean(x, "members")) * s, total

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, xs):
            return nn.vmap(Centered, variable_axes={"params": None}, split_rngs={"params": False},
                           axis_name="members")()(xs)

    model = Outer()
    v = model.init(jax.random.key(0), XS)
    assert v["params"]["VmapCentered_0"]["s"].shape == (4,)
    v = {"params": {"VmapCentered_0": {"s": jnp.full((4,), 2.0)}}}
    centered, total = model.apply(v, XS)
    _close(centered, (XS - XS.mean(0)[None]) * 2.0)
    _close(total, jnp.broadcast_to(XS.sum(0), XS.shape))


def test_nested_vmap_stacks_params_with_both_axes():
    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, xss):
            inner = nn.vmap(Inner, variable_axes={"params": 0}, split_rngs={"params": True})
            outer = nn.vmap(inner, variable_axes={"params": 0}, split_rngs={"params": True})
            return outer()(xss)

    xss = _data((2, 3, 4))
    model = Outer()
    v = model.init(jax.random.key(0), xss)
    p = v["params"]["VmapVmapInner_0"]["Dense_0"]      # Linen's name for a vmap of a vmap
    assert _shapes(p) == {"kernel": (2, 3, 4, 2), "bias": (2, 3, 2)}
    flat = p["kernel"].reshape(6, 4, 2)
    assert len({np.asarray(k).tobytes() for k in flat}) == 6     # every member its own init
    want = jnp.einsum("abi,abio->abo", xss, p["kernel"]) + p["bias"]
    _close(model.apply(v, xss), want)


def test_vmap_mutable_batch_stats_are_vectorized_per_member():
    class Normed(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False, momentum=0.5)(x)

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, xs):
            return nn.vmap(Normed, variable_axes={"params": 0, "batch_stats": 0},
                           split_rngs={"params": True})()(xs)

    xs = _data((3, 5, 2))          # 3 members, each a batch of 5
    model = Outer()
    v = model.init(jax.random.key(0), xs)
    stats = v["batch_stats"]["VmapNormed_0"]["BatchNorm_0"]
    assert _shapes(stats) == {"mean": (3, 2), "var": (3, 2)}
    out, upd = model.apply(v, xs, mutable=["batch_stats"])
    new = upd["batch_stats"]["VmapNormed_0"]["BatchNorm_0"]
    _close(new["mean"], 0.5 * stats["mean"] + 0.5 * xs.mean(1))
    _close(new["var"], 0.5 * stats["var"] + 0.5 * xs.var(1), atol=1e-4)
    _close(out, (xs - xs.mean(1, keepdims=True)) / jnp.sqrt(xs.var(1, keepdims=True) + 1e-5),
           atol=1e-4)


# --- same source under flax.linen and varjax.nn ------------------------------------------


@functools.cache
def _parity_program(lib):
    class MLP(lib.Module):
        train: bool = True

        @lib.compact
        def __call__(self, x):
            h = lib.Dense(4)(x)
            h = lib.BatchNorm(use_running_average=not self.train, momentum=0.9)(h)
            return lib.Dense(1)(lib.relu(h))

    class Outer(lib.Module):
        train: bool = True

        @lib.compact
        def __call__(self, xs):
            VmapMLP = lib.vmap(MLP, variable_axes={"params": 0, "batch_stats": 0},
                               split_rngs={"params": True})
            return lib.Dense(2)(VmapMLP(train=self.train)(xs))

    return Outer


def test_vmap_layout_and_outputs_match_flax_linen_for_the_same_source():
    xs = _data((3, 5, 4))
    key = jax.random.key(0)
    flax_model, vj_model = _parity_program(flax_nn)(), _parity_program(nn)()
    flax_vars = jax.eval_shape(flax_model.init, key, xs)
    vj_vars = vj_model.init(key, xs)
    assert _layout(vj_vars) == _layout(flax_vars)
    assert set(vj_vars["params"]) == {"VmapMLP_0", "Dense_0"}
    assert set(vj_vars["batch_stats"]["VmapMLP_0"]) == {"BatchNorm_0"}
    # Apply both to the *same* (perturbed) variables.
    rng = np.random.default_rng(1)
    variables = jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x) + 0.3 * rng.standard_normal(x.shape), x.dtype), vj_vars)
    flax_out, flax_upd = flax_model.apply(variables, xs, mutable=["batch_stats"])
    vj_out, vj_upd = vj_model.apply(variables, xs, mutable=["batch_stats"])
    _close(vj_out, flax_out)
    assert _layout(vj_upd) == _layout(flax_upd)
    jax.tree.map(_close, dict(vj_upd), dict(flax_upd))


# --- shard_map / pmap ------------------------------------------------------------------


def _mesh():
    assert len(jax.devices()) == 2, "tests/conftest.py provides 2 CPU devices"
    return jax.sharding.Mesh(jax.devices(), ("d",))


def test_shard_map_replicated_params_and_data_sharded_along_the_mesh():
    mesh = _mesh()

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            f = nn.shard_map(lambda mdl, x: mdl(x), mesh=mesh, in_specs=P("d"),
                             out_specs=P("d"), variable_specs={"params": P()})
            return f(nn.Dense(3), x)

    x = _data((4, 5))
    model = Outer()
    v = model.init(jax.random.key(0), x)
    p = v["params"]["Dense_0"]
    assert _shapes(p) == {"kernel": (5, 3), "bias": (3,)}   # replicated: no shard axis
    _close(model.apply(v, x), x @ p["kernel"] + p["bias"][None])


def test_shard_map_split_rngs_gives_each_shard_its_own_key():
    mesh = _mesh()

    def noisy(x):
        return x + jax.random.normal(vj.make_rng("noise"), x.shape)

    def run(split):
        @vj.functionalize
        def f(x):
            return vj.shard_map(noisy, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                split_rngs={"noise": split})(x)
        return f.apply({}, jnp.zeros((2, 3)), rngs={"noise": jax.random.key(7)})

    split, shared = run(True), run(False)
    assert _differ(split[0], split[1])                  # one key per shard
    np.testing.assert_array_equal(shared[0], shared[1])  # the same key on every shard
    assert _differ(shared[0], jnp.zeros(3))


def test_pmap_variable_axes_0_gives_each_device_its_own_params():
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            scale = self.param("scale", nn.initializers.ones, (3,))   # no device axis
            y = nn.pmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True})(3)(x)
            return y * scale[None]

    x = _data((2, 5))
    model = Outer()
    v = model.init(jax.random.key(0), x)
    p = v["params"]["PmapDense_0"]
    assert _shapes(p) == {"kernel": (2, 5, 3), "bias": (2, 3)}
    assert _differ(p["kernel"][0], p["kernel"][1])
    v = {"params": {**v["params"], "scale": jnp.array([1.0, 2.0, 3.0])}}
    want = jnp.einsum("bi,bio->bo", x, p["kernel"]) + p["bias"]
    _close(model.apply(v, x), want * jnp.array([[1.0, 2.0, 3.0]]))


@pytest.mark.parametrize("axis", [0, None])
def test_pmap_in_axes_none_broadcasts_the_argument(axis):
    @vj.functionalize
    def f(x, y):
        def body(x, y):
            return x * y
        return vj.pmap(body, in_axes=(0, axis))(x, y)

    x = _data((2, 3))
    y = _data((2, 3), seed=1) if axis == 0 else _data((3,), seed=1)
    _close(f.apply({}, x, y), x * (y if axis == 0 else y[None]))


def _autoencoder_source(lib):
    """The same model source for flax.linen and varjax.nn: a vmapped class whose lifted
    ``__call__`` calls its lifted ``encode``/``decode``."""
    class AE(lib.Module):
        def setup(self):
            self.enc = lib.Dense(2)
            self.dec = lib.Dense(4)

        def encode(self, x):
            return self.enc(x)

        def decode(self, z):
            return self.dec(z)

        def __call__(self, x):
            return self.decode(self.encode(x))

    class Top(lib.Module):
        def setup(self):
            self.ae = lib.vmap(AE, variable_axes={"params": 0}, split_rngs={"params": True},
                               methods=["__call__", "encode", "decode"])()

        def __call__(self, x):
            return self.ae(x), self.ae.encode(x)
    return Top()


def test_lifted_methods_calling_each_other_apply_the_transform_once_as_in_linen():
    x = _data((3, 4))
    ours, theirs = _autoencoder_source(nn), _autoencoder_source(flax_nn)
    v_theirs = theirs.init(jax.random.key(0), x)
    v_ours = ours.init(jax.random.key(0), x)
    assert _shapes(v_ours) == _shapes(jax.tree.map(np.asarray, v_theirs))
    assert _shapes(v_ours)["params"]["ae"]["enc"]["kernel"] == (3, 4, 2)
    (y, z), (y_ref, z_ref) = ours.apply(v_theirs, x), theirs.apply(v_theirs, x)
    _close(y, y_ref)
    _close(z, z_ref)
    assert y.shape == (3, 4) and z.shape == (3, 2)
