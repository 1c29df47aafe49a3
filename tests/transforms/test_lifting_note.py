"""The examples of Flax's design notes, written with ``varjax.nn``.

* "Lifted transformations" (docs/developer_notes/lift.md): ``NaiveVmapMLP`` (raw
  ``jax.vmap`` over a module), ``ManualVmapMLP`` (manual functionalization), the ``nn.vmap``
  MLP, the stateful MLP with ``BatchNorm`` and the tied auto-encoder that motivates
  ``map_variables`` (here as in Flax's own ``test_map_variables_tied_autoencoder``).
* "Module lifecycle" (docs/developer_notes/module_lifecycle.rst), "Practical consequences":
  ``Foo`` whose method ``inner`` is vmapped with ``nn.vmap``, once with a plain closure over
  a submodule (Flax rejects it) and once with the closure as a ``Partial`` pytree.

Where the same source runs on ``flax.linen``, it is run on both: same variable layout, and
the same outputs on the same variables.

Deviations from the notes, each because the note's code does not run as printed (in Flax
either): the stateful MLP passes ``train`` positionally with ``in_axes=(0, None)`` and gives
``nn.vmap`` the ``axis_name='batch'`` its ``BatchNorm`` reduces over (the keyword form is
tested on varjax, which broadcasts keyword arguments); the note prints ``Dense_0``/``Dense_1``
for an MLP whose layers are named ``hidden``/``out``.
"""
from __future__ import annotations

import functools

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random
from transform_checks import close as _close
from transform_checks import data as _data
from transform_checks import layout as _layout
from transform_checks import shapes as _shapes

import varjax as vj
import varjax.nn as nn
from varjax.errors import VarjaxError


def _perturb(variables, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(np.asarray(x) + 0.3 * rng.standard_normal(x.shape), x.dtype),
        variables)


XS = _data((3, 4))
MLP_SHAPES = {"hidden": {"kernel": (3, 4, 4), "bias": (3, 4)},
              "out": {"kernel": (3, 4, 1), "bias": (3, 1)}}


@functools.cache
def note(lib):
    """The lifting note's modules, for ``lib`` in (flax.linen, varjax.nn)."""
    class MLP(lib.Module):
        @lib.compact
        def __call__(self, xs):
            h = lib.Dense(4, name="hidden")(xs)
            h = lib.relu(h)
            return lib.Dense(1, name="out")(h)

    class NaiveVmapMLP(lib.Module):
        @lib.compact
        def __call__(self, xs):
            mlp = MLP()
            return jax.vmap(lambda mlp, x: mlp(x))(mlp, xs)  # fails

    class ManualVmapMLP(lib.Module):
        @lib.compact
        def __call__(self, xs):
            mlp = MLP(parent=None)
            init_fn = lambda rng, xs: jax.vmap(mlp.init, in_axes=0)(  # noqa: E731
                random.split(rng, xs.shape[0]), xs)["params"]
            apply_fn = jax.vmap(mlp.apply, in_axes=0)
            mlp_params = self.param("mlp", init_fn, xs)
            return apply_fn({"params": mlp_params}, xs)

    class LinenVmapMLP(lib.Module):
        @lib.compact
        def __call__(self, xs):
            VmapMLP = lib.vmap(MLP, variable_axes={"params": 0}, split_rngs={"params": True},
                               in_axes=0)
            return VmapMLP(name="mlp")(xs)

    class StatefulMLP(lib.Module):
        @lib.compact
        def __call__(self, x, train):
            h = lib.Dense(4, name="hidden")(x)
            h = lib.BatchNorm(axis_name="batch")(h, use_running_average=not train)
            h = lib.relu(h)
            return lib.Dense(1, name="out")(h)

    class LinenStatefulVmapMLP(lib.Module):
        @lib.compact
        def __call__(self, xs, train):
            VmapMLP = lib.vmap(StatefulMLP, variable_axes={"params": 0, "batch_stats": 0},
                               split_rngs={"params": True}, in_axes=(0, None), axis_name="batch")
            return VmapMLP(name="mlp")(xs, train)

    def trans(variables):
        return jax.tree_util.tree_map(lambda x: x.T, variables)

    def tied_autoencoder(method, closure):
        """Flax's ``TiedAutencoder`` test model, its @compact helper named ``method``; with
        ``closure`` the mapped body closes over ``x`` as in Flax, else takes it as argument."""
        @lib.compact
        def _call(self, x, decode):
            def f(self, *arg):
                x_ = x if closure else arg[0]
                return lib.Dense(self.features if decode else self.latents, use_bias=False)(x_)

            if decode:
                map_fn = trans
            else:
                map_fn = lambda x: x  # noqa: E731
            return lib.map_variables(f, "params", map_fn, map_fn, mutable=True)(
                self, *(() if closure else (x,)))

        def encode(self, x):
            return getattr(self, method)(x, False)

        def decode(self, x):
            return getattr(self, method)(x, True)

        def __call__(self, x):
            return self.decode(self.encode(x))

        return type("TiedAutoencoder", (lib.Module,), {
            "__annotations__": {"features": int, "latents": int}, "__module__": __name__,
            method: _call, "encode": encode, "decode": decode, "__call__": __call__})

    return dict(MLP=MLP, NaiveVmapMLP=NaiveVmapMLP, ManualVmapMLP=ManualVmapMLP,
                LinenVmapMLP=LinenVmapMLP, StatefulMLP=StatefulMLP,
                LinenStatefulVmapMLP=LinenStatefulVmapMLP,
                TiedAutoencoder=tied_autoencoder("_call", closure=True),   # as in Flax's test
                TiedAutoencoderClosure=tied_autoencoder("tied", closure=True),
                TiedAutoencoderArgument=tied_autoencoder("tied", closure=False))


VJ = note(nn)


def _per_member(mlp_params, xs):
    return jnp.stack([VJ["MLP"]().apply({"params": jax.tree.map(lambda a: a[i], mlp_params)},
                                        xs[i]) for i in range(xs.shape[0])])


def _members_differ(params):
    k = params["hidden"]["kernel"]
    return not np.allclose(k[0], k[1]) and not np.allclose(k[1], k[2])


# --- Functionalization ---------------------------------------------------------------------


def test_naive_vmap_mlp_fails_as_in_flax():
    # Flax: TypeError "Argument 'MLP()' ... is not a valid JAX type"; varjax fails the same way.
    with pytest.raises((TypeError, VarjaxError)):
        VJ["NaiveVmapMLP"]().init(random.key(0), XS)


def test_raw_vmap_closing_over_the_mlp_shares_one_set_of_params():
    # What the note wants to avoid: raw jax.vmap sees no variable axis, so the module's
    # params are created once and broadcast to every member.
    class ClosureVmapMLP(nn.Module):
        @nn.compact
        def __call__(self, xs):
            mlp = VJ["MLP"]()
            return jax.vmap(lambda x: mlp(x))(xs)

    model = ClosureVmapMLP()
    v = model.init(random.key(0), XS)
    assert _shapes(v["params"]["MLP_0"]) == {"hidden": {"kernel": (4, 4), "bias": (4,)},
                                             "out": {"kernel": (4, 1), "bias": (1,)}}
    _close(model.apply(v, XS), VJ["MLP"]().apply({"params": v["params"]["MLP_0"]}, XS))


def test_manual_vmap_mlp_as_written_in_the_note_initializes_each_member():
    v = VJ["ManualVmapMLP"]().init(random.key(0), XS)
    assert _shapes(v["params"]) == {"mlp": MLP_SHAPES}
    assert _members_differ(v["params"]["mlp"])


def test_manual_vmap_mlp_as_written_in_the_note_applies_each_member():
    model = VJ["ManualVmapMLP"]()
    v = model.init(random.key(0), XS)
    _close(model.apply(v, XS), _per_member(v["params"]["mlp"], XS))


def manual_vmap(body):
    """The note's manual functionalization as a ``vj.lift`` transform: at init each member
    runs the body with its own split key; at apply every member's params slice is mapped."""
    def transform(region, groups, rng_groups, xs):
        (params,), (keys,) = groups, rng_groups
        n = xs.shape[0]
        if not params:
            split = {stream: random.split(key, n) for stream, key in keys.items()}
            return jax.vmap(lambda k, x: region(({},), (k,), x))(split, xs)
        return jax.vmap(lambda p, x: region((p,), rng_groups, x))(params, xs)
    return vj.lift(transform, body, variables=("params",), name="manual_vmap")


class LiftedManualVmapMLP(nn.Module):
    @nn.compact
    def __call__(self, xs):
        return manual_vmap(lambda mlp, x: mlp(x))(VJ["MLP"](name="mlp"), xs)


def test_manual_vmap_mlp_with_vj_lift_inits_members_separately_and_vmaps_apply():
    model = LiftedManualVmapMLP()
    v = model.init(random.key(0), XS)
    assert _shapes(v["params"]) == {"mlp": MLP_SHAPES}
    assert _members_differ(v["params"]["mlp"])
    want = _per_member(v["params"]["mlp"], XS)
    _close(model.apply(v, XS), want)
    # Same layout as nn.vmap's, so the two are interchangeable on the same variables.
    _close(VJ["LinenVmapMLP"]().apply(v, XS), want)


# --- Linen examples ------------------------------------------------------------------------


def test_nn_vmap_mlp_layout_and_outputs_match_flax():
    flax_model, vj_model = note(flax_nn)["LinenVmapMLP"](), VJ["LinenVmapMLP"]()
    key = random.key(0)
    v = vj_model.init(key, XS)
    assert _shapes(v["params"]) == {"mlp": MLP_SHAPES}
    assert _members_differ(v["params"]["mlp"])
    assert _layout(v) == _layout(jax.eval_shape(flax_model.init, key, XS))
    v = _perturb(v)
    out = vj_model.apply(v, XS)
    _close(out, flax_model.apply(v, XS))
    _close(out, _per_member(v["params"]["mlp"], XS))


def test_stateful_vmap_mlp_vectorizes_batch_stats_as_in_flax():
    flax_model, vj_model = note(flax_nn)["LinenStatefulVmapMLP"](), VJ["LinenStatefulVmapMLP"]()
    xs, key = _data((3, 4), seed=2), random.key(0)
    v = vj_model.init(key, xs, False)
    assert _shapes(v["batch_stats"]) == {"mlp": {"BatchNorm_0": {"mean": (3, 4), "var": (3, 4)}}}
    assert _layout(v) == _layout(jax.eval_shape(lambda k, x: flax_model.init(k, x, False), key, xs))
    v = {"params": _perturb(v["params"]), "batch_stats": v["batch_stats"]}
    out, upd = vj_model.apply(v, xs, True, mutable=["batch_stats"])
    flax_out, flax_upd = flax_model.apply(v, xs, True, mutable=["batch_stats"])
    _close(out, flax_out)
    jax.tree.map(_close, dict(upd), dict(flax_upd))
    # BatchNorm reduced over the 'batch' axis the members share: every member's mean is the
    # mean over members of its hidden activations.
    mean = upd["batch_stats"]["mlp"]["BatchNorm_0"]["mean"]
    _close(mean[0], mean[2])
    assert not np.allclose(mean[0], 0.0)


def test_stateful_vmap_mlp_with_train_as_keyword_argument_as_in_the_note():
    # Flax ignores keyword arguments of a vmapped call (with a warning, then the call fails
    # for lack of `train`); varjax broadcasts them to every member.
    class KeywordStatefulMLP(nn.Module):
        @nn.compact
        def __call__(self, x, *, train):
            return VJ["StatefulMLP"](name="inner")(x, train)

    class KeywordVmapMLP(nn.Module):
        @nn.compact
        def __call__(self, xs, *, train):
            VmapMLP = nn.vmap(KeywordStatefulMLP, variable_axes={"params": 0, "batch_stats": 0},
                              split_rngs={"params": True}, in_axes=0, axis_name="batch")
            return VmapMLP(name="mlp")(xs, train=train)

    xs = _data((3, 4), seed=2)
    model = KeywordVmapMLP()
    v = model.init(random.key(0), xs, train=False)
    assert _shapes(v["batch_stats"]["mlp"]["inner"]["BatchNorm_0"]) == {"mean": (3, 4),
                                                                         "var": (3, 4)}
    out_eval = model.apply(v, xs, train=False)
    out_train, upd = model.apply(v, xs, train=True, mutable=["batch_stats"])
    assert not np.allclose(out_eval, out_train)
    stats = upd["batch_stats"]["mlp"]["inner"]["BatchNorm_0"]
    assert not np.allclose(stats["mean"], v["batch_stats"]["mlp"]["inner"]["BatchNorm_0"]["mean"])


def _check_tied_autoencoder(name):
    flax_model = note(flax_nn)[name](4, 5)
    vj_model = VJ[name](4, 5)
    x, key = _data((2, 4), seed=3), random.key(0)
    v = vj_model.init(key, x)
    assert _shapes(v["params"]) == {"Dense_0": {"kernel": (4, 5)}}
    assert _layout(v) == _layout(jax.eval_shape(flax_model.init, key, x))
    k = v["params"]["Dense_0"]["kernel"]
    out = vj_model.apply(v, x)
    _close(out, (x @ k) @ k.T)
    _close(out, flax_model.apply(v, x))

    def loss(apply):
        return lambda p: jnp.sum(apply({"params": p}, x) ** 2)
    g = jax.grad(loss(vj_model.apply))(v["params"])["Dense_0"]["kernel"]
    both = jax.grad(lambda k: jnp.sum(((x @ k) @ k.T) ** 2))(k)
    encoder_only = jax.grad(lambda k: jnp.sum(((x @ k) @ jax.lax.stop_gradient(k).T) ** 2))(k)
    _close(g, both, atol=1e-4)
    assert not np.allclose(g, encoder_only, atol=1e-3)
    _close(g, jax.grad(loss(flax_model.apply))(v["params"])["Dense_0"]["kernel"], atol=1e-4)


def test_tied_autoencoder_has_one_kernel_and_both_uses_contribute_to_its_gradient():
    _check_tied_autoencoder("TiedAutoencoderArgument")


def test_tied_autoencoder_whose_mapped_body_closes_over_the_input():
    _check_tied_autoencoder("TiedAutoencoderClosure")


def test_tied_autoencoder_verbatim_from_flax_tests():
    _check_tied_autoencoder("TiedAutoencoder")


def test_private_compact_method_may_define_submodules():
    # Linen wraps every method but dunders, so a private helper may be the @compact one.
    class Private(nn.Module):
        @nn.compact
        def _call(self, x):
            return nn.Dense(2)(x)

        def __call__(self, x):
            return self._call(x)

    v = Private().init(random.key(0), XS)
    assert _shapes(v["params"]) == {"Dense_0": {"kernel": (4, 2), "bias": (2,)}}


# --- Module lifecycle: closures and nn.vmap --------------------------------------------------


class FooClosure(nn.Module):
    """The note's first ``Foo``, verbatim: Flax rejects it ("applying a transformation
    doesn't [work]": the closure is no JAX type); varjax lifts the closed-over ``dense``."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(x.shape[-1])
        fn = lambda x: dense(x) + 1  # noqa: E731
        # simply calling inner works fine
        # return self.inner(x, fn)
        # but applying a transformation doesn't:
        vmap_inner = nn.vmap(FooClosure.inner, in_axes=0, variable_axes={"params": 0},
                             split_rngs={"params": True})
        return vmap_inner(self, x, fn)

    def inner(self, x, fn):
        for i in range(3):
            x = fn(x)
        return x


@functools.cache
def foo_partial(lib, make_partial):
    """The note's second ``Foo``: the closure as a ``Partial`` whose args hold the module."""
    class Foo(lib.Module):
        @lib.compact
        def __call__(self, x):
            dense = lib.Dense(x.shape[-1])
            fn = lambda mdl, x: mdl(x) + 1  # noqa: E731
            vmap_inner = lib.vmap(Foo.inner, in_axes=0, variable_axes={"params": 0},
                                  split_rngs={"params": True})
            return vmap_inner(self, x, make_partial(fn, dense))

        def inner(self, x, fn):
            for i in range(3):
                x = fn(x)
            return x
    return Foo


def _foo_reference(p, x):
    k, b = p["kernel"], p["bias"]
    for _ in range(3):
        x = jnp.einsum("bi,bio->bo", x, k) + b + 1
    return x


def _check_foo(model, x):
    v = model.init(random.key(0), x)
    p = v["params"]["Dense_0"]
    assert _shapes(p) == {"kernel": (3, 2, 2), "bias": (3, 2)}    # the note's assertion
    assert not np.allclose(p["kernel"][0], p["kernel"][1])
    _close(model.apply(v, x), _foo_reference(p, x))
    return v


def test_module_lifecycle_foo_plain_closure_is_lifted():
    _check_foo(FooClosure(), _data((3, 2)))


@pytest.mark.parametrize("make_partial", [jax.tree_util.Partial, functools.partial],
                         ids=["tree_util.Partial", "functools.partial"])
def test_module_lifecycle_foo_with_partial_closure(make_partial):
    x = _data((3, 2))
    v = _check_foo(foo_partial(nn, make_partial)(), x)
    if make_partial is jax.tree_util.Partial:
        # A pytree Partial is the note's workaround in Flax too: same layout and outputs.
        flax_model = foo_partial(flax_nn, make_partial)()
        assert _layout(v) == _layout(jax.eval_shape(flax_model.init, random.key(0), x))
        v = _perturb(v)
        _close(foo_partial(nn, make_partial)().apply(v, x), flax_model.apply(v, x))
