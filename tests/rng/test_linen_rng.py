"""Linen's RNG convention: with keys given as Linen gives them (``rngs=key`` or a dict of
keys), ``init`` returns Flax's parameters bit for bit and train-mode outputs draw Flax's
masks.  Each test builds one model twice from the same source, once over ``flax.linen``
and once over ``varjax.nn`` (``build(nn)``), and compares with ``assert_array_equal``.
"""
import hashlib

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varjax as vj
import varjax.nn as vnn
from varjax.lifting import region as lifting

KEY = jax.random.key(0)
RNGS = {"params": jax.random.key(0), "dropout": jax.random.key(1)}


def _data(tree):
    """Keys as their data, so trees of keys compare with assert_array_equal."""
    def leaf(x):
        if jax.dtypes.issubdtype(jnp.asarray(x).dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(x))
        return np.asarray(x)
    return jax.tree.map(leaf, tree)


def _equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(_data(got)), jax.tree.leaves(_data(want))):
        np.testing.assert_array_equal(a, b)


def _same_init(build, *args, rngs=KEY, **kwargs):
    want = build(fnn).init(rngs, *args, **kwargs)
    got = build(vnn).init(rngs, *args, **kwargs)
    _equal(got, jax.tree.map(lambda x: x, dict(want)))
    return want


def _same_apply(build, variables, *args, rngs=RNGS, **kwargs):
    want = build(fnn).apply(variables, *args, rngs=rngs, **kwargs)
    got = build(vnn).apply(variables, *args, rngs=rngs, **kwargs)
    _equal(got, want)
    return want


def _x(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# --- layers ------------------------------------------------------------------------------

def test_dense_conv_layernorm_batchnorm_embed_init_equal_linen():
    def build(nn):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, tokens, image):
                e = nn.Embed(11, 4)(tokens)
                h = nn.Conv(3, (3, 3))(image)
                h = nn.BatchNorm(use_running_average=False)(h)
                h = nn.LayerNorm()(h.reshape(h.shape[0], -1))
                return nn.Dense(5)(h), nn.Dense(2, use_bias=True)(e)
        return Net()
    _same_init(build, jnp.array([[1, 2, 3]]), _x(2, 6, 6, 1))


def test_attention_init_and_train_output_equal_linen():
    def build(nn):
        return nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, dropout_rate=0.5)
    x = _x(2, 3, 4)
    variables = _same_init(build, x, x, deterministic=True)
    _same_apply(build, variables, x, x, deterministic=False)


def test_dropout_train_outputs_equal_linen():
    def build(nn):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x, train):
                x = nn.Dropout(0.5, deterministic=not train)(nn.Dense(8)(x))
                x = nn.Dropout(0.3, broadcast_dims=(0,), deterministic=not train)(x)
                return nn.Dense(3)(x)
        return Net()
    x = _x(4, 5)
    variables = _same_init(build, x, False)
    _same_apply(build, variables, x, True)


# --- make_rng ----------------------------------------------------------------------------

def _draws(nn):
    class Leaf(nn.Module):
        @nn.compact
        def __call__(self):
            return self.make_rng("a"), self.make_rng("a"), self.make_rng("b")

    class Net(nn.Module):
        @nn.compact
        def __call__(self):
            first = self.make_rng("a")
            leaf = Leaf()
            inner = (leaf(), leaf(), Leaf(name="named")())
            return first, inner, self.make_rng("a"), self.make_rng("b")
    return Net()


def test_make_rng_twice_nested_and_several_streams_equal_linen():
    _same_apply(_draws, {}, rngs={"a": jax.random.key(3), "b": jax.random.key(4)})


def test_make_rng_of_a_missing_stream_falls_back_to_params_as_in_linen():
    _same_apply(_draws, {}, rngs={"params": jax.random.key(3)})


def test_linen_key_is_fold_in_of_the_sha1_of_path_and_count():
    """The derivation itself, written out: draw ``c`` of the module at ``P`` folds in the
    first 4 bytes of SHA-1 over ``P`` and ``c``."""
    def data(*items):
        digest = hashlib.sha1()
        for item in items:
            digest.update(item.encode() if isinstance(item, str)
                          else item.to_bytes((item.bit_length() + 7) // 8, "big"))
        return np.uint32(int.from_bytes(digest.digest()[:4], "big"))
    k = jax.random.key(3)
    got = _draws(vnn).apply({}, rngs={"a": k, "b": jax.random.key(4)})
    _equal(got[0], jax.random.fold_in(k, data(1)))
    _equal(got[1][0][1], jax.random.fold_in(k, data("Leaf_0", 2)))
    _equal(got[1][1][0], jax.random.fold_in(k, data("Leaf_0", 3)))


def test_lowered_jaxpr_folds_in_constants_only():
    """The derivation is static: after the pipeline each draw is one ``random_fold_in`` of
    the given key with a literal, as hand-written JAX would be; nothing is hashed at run
    time.  Before lowering, each draw names its stream, module path and count."""
    stages = dict(vj.dump(_draws(vnn), rngs={"a": KEY, "b": KEY}, source=False))
    assert "rng_draw[a:Leaf_0#2]" in stages["effectful"]
    lines = stages["discharge"].splitlines()[2:-1]
    assert len(lines) == 12
    for line in lines:
        rhs = line.split("=", 1)[1].split("#")[0].split()
        assert rhs[0] == "random_fold_in" and rhs[1] in "ab" and rhs[2].endswith(":u32[]"), line


# --- lifted transforms -------------------------------------------------------------------

def _noisy(nn):
    class Noisy(nn.Module):
        """A Dense with dropout and a raw draw: params, dropout and make_rng in one body."""
        @nn.compact
        def __call__(self, c, x):
            h = nn.Dropout(0.5, deterministic=False)(nn.Dense(3)(x))
            return c + h.sum(), (h, self.make_rng("dropout"))
    return Noisy


@pytest.mark.parametrize("split", [True, False])
def test_vmap_split_rngs_init_and_train_equal_linen(split):
    def build(nn):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                first = self.make_rng("dropout")
                v = nn.vmap(_noisy(nn), in_axes=(None, 0), out_axes=0,
                            variable_axes={"params": 0},
                            split_rngs={"params": split, "dropout": split})(name="V")
                return first, v(0.0, x), self.make_rng("dropout")
        return Net()
    x = _x(2, 4)
    variables = _same_init(build, x, rngs=RNGS)
    _same_apply(build, variables, x)


@pytest.mark.parametrize("split", [True, False])
def test_scan_split_rngs_init_and_train_equal_linen(split):
    def build(nn):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, xs):
                s = nn.scan(_noisy(nn), variable_broadcast="params",
                            split_rngs={"params": False, "dropout": split})(name="S")
                out = s(0.0, xs)
                return out, s(1.0, xs), self.make_rng("dropout")
        return Net()
    xs = _x(3, 2, 4)
    variables = _same_init(build, xs, rngs=RNGS)
    _same_apply(build, variables, xs)


def test_scan_with_scanned_params_equal_linen():
    def build(nn):
        return nn.scan(_noisy(nn), variable_axes={"params": 0},
                       split_rngs={"params": True, "dropout": True})()
    xs = _x(3, 2, 4)
    variables = _same_init(build, 0.0, xs, rngs=RNGS)
    _same_apply(build, variables, 0.0, xs)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_nested_scans_trace_their_body_once_with_linens_keys(depth):
    """Linen traces a scan body once before the loop, then in it (2^depth body runs at
    ``depth`` levels); varjax traces each level's body once and makes the loop's trace by
    moving the draw counts of the first (inner levels' draws included), with Linen's keys."""
    runs = {}

    def build(nn):
        runs[nn] = 0
        noisy = _noisy(nn)

        class Step(noisy):
            def __call__(self, c, x):
                runs[nn] += 1
                return super().__call__(c, x)
        cls = Step
        for _ in range(depth):
            cls = nn.scan(cls, variable_axes={"params": 0},
                          split_rngs={"params": True, "dropout": True})
        return cls()
    xs = _x(*(2,) * depth, 4)
    variables = _same_init(build, jnp.float32(0), xs, rngs=RNGS)
    assert (runs[fnn], runs[vnn]) == (2 ** depth, 1)
    _same_apply(build, variables, jnp.float32(0), xs)


@pytest.mark.parametrize("lift", ["vmap", "scan"])
def test_lifted_draws_from_raw_uint32_keys_equal_linen_eagerly_and_jitted(lift):
    """Draws in a lifted body stay ``linen_fold_in`` until compiled: with raw keys
    (``jax.random.PRNGKey``), split per example or step, they run eagerly (init runs its
    jaxpr op by op) and under jit as Linen's do."""
    def build(nn):
        noisy = _noisy(nn)
        if lift == "vmap":
            return nn.vmap(noisy, in_axes=(None, 0), variable_axes={"params": 0},
                           split_rngs={"params": True, "dropout": True})()
        return nn.scan(noisy, variable_axes={"params": 0},
                       split_rngs={"params": True, "dropout": True})()
    rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
    xs = _x(3, 2, 4)
    variables = _same_init(build, jnp.float32(0), xs, rngs=rngs)
    _same_apply(build, variables, jnp.float32(0), xs, rngs=rngs)
    jitted = jax.jit(lambda v, x: build(vnn).apply(v, jnp.float32(0), x, rngs=rngs))
    _equal(jitted(variables, xs), build(fnn).apply(variables, jnp.float32(0), xs, rngs=rngs))


def test_scan_over_a_body_with_nn_jit_inside_equals_linen():
    """``nn.jit`` draws at paths relative to its module (a base): such a trace's counts are
    not moved, the body is traced again, as Linen does."""
    def build(nn):
        class Step(nn.Module):
            @nn.compact
            def __call__(self, c, x):
                # The jitted Dense's kernel is draw 2 at ('inner',), folded in at path ()
                # relative to it, where this module draws 1..3: moving it by this
                # module's count (3, not 2) would give Linen's key for another draw.
                w = [self.param(f"w{i}", nn.initializers.normal(), (3,)) for i in range(3)]
                h = nn.jit(nn.Dense)(3, use_bias=False, name="inner")(x)
                return c + h.sum(), h * w[0] * w[1] * w[2]
        return nn.scan(Step, variable_axes={"params": 0}, split_rngs={"params": True})()
    _same_init(build, jnp.float32(0), _x(3, 4))


def test_a_scan_body_reused_with_moved_counts_draws_what_a_new_trace_draws(monkeypatch):
    """Draws inside raw control flow in the body (beyond Linen, which rejects them) are
    moved too: the keys equal those of tracing the body again."""
    class Step(vnn.Module):
        @vnn.compact
        def __call__(self, c, x):
            k = jax.lax.cond(x.sum() > 0, lambda: self.make_rng("dropout"),
                             lambda: jax.random.fold_in(self.make_rng("dropout"), 1))
            ks = jax.lax.scan(lambda _, i: (None, jax.random.key_data(self.make_rng("dropout"))),
                              None, jnp.arange(2))[1]
            return c, (vnn.Dense(2)(x), jax.random.key_data(k), ks)

    def run():
        model = vnn.scan(Step, variable_axes={"params": 0},
                         split_rngs={"params": True, "dropout": True})()
        variables = model.init(RNGS, jnp.float32(0), _x(3, 4))
        return variables, model.apply(variables, jnp.float32(0), _x(3, 4), rngs=RNGS)
    moved = run()
    monkeypatch.setattr(lifting, "with_counts_moved", lambda *args: None)
    _equal(moved, run())


def test_lstm_over_scan_init_and_outputs_equal_linen():
    def build(nn):
        class Encoder(nn.Module):
            @nn.compact
            def __call__(self, xs):
                cell = nn.scan(nn.LSTMCell, variable_broadcast="params",
                               split_rngs={"params": False}, in_axes=1, out_axes=1)(features=5)
                carry = cell.initialize_carry(jax.random.key(9), xs[:, 0].shape)
                return cell(carry, xs)
        return Encoder()
    xs = _x(2, 3, 4)
    variables = _same_init(build, xs)
    _same_apply(build, variables, xs)


def test_nested_vmap_in_scan_equal_linen():
    def build(nn):
        class Step(nn.Module):
            @nn.compact
            def __call__(self, c, x):
                v = nn.vmap(_noisy(nn), in_axes=(None, 0), variable_axes={"params": 0},
                            split_rngs={"params": True, "dropout": True})
                return c, v(name="inner")(c, x)[1]
        return nn.scan(Step, variable_axes={"params": 0},
                       split_rngs={"params": True, "dropout": True})()
    xs = _x(3, 2, 4)
    variables = _same_init(build, jnp.float32(0), xs, rngs=RNGS)
    _same_apply(build, variables, jnp.float32(0), xs)


def test_remat_equal_linen():
    def build(nn):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                a = self.make_rng("dropout")
                block = nn.remat(_noisy(nn))()
                return a, block(0.0, x), block(1.0, x), self.make_rng("dropout")
        return Net()
    x = _x(2, 4)
    variables = _same_init(build, x, rngs=RNGS)
    _same_apply(build, variables, x)


def test_cond_equal_linen():
    def build(nn):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x, pred):
                dense = _noisy(nn)()
                a = self.make_rng("dropout")
                out = nn.cond(pred, lambda m, x: m(0.0, x), lambda m, x: m(1.0, 2 * x),
                              dense, x)
                return a, out, self.make_rng("dropout")
        return Net()
    x = _x(2, 4)
    variables = _same_init(build, x, True, rngs=RNGS)
    _same_apply(build, variables, x, True)
    _same_apply(build, variables, x, False)


def test_switch_equal_linen():
    def build(nn):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x, index):
                dense = _noisy(nn)()
                a = self.make_rng("dropout")
                out = nn.switch(index, [lambda m, x: m(0.0, x), lambda m, x: m(1.0, 2 * x),
                                        lambda m, x: m(2.0, -x)], dense, x)
                return a, out, self.make_rng("dropout")
        return Net()
    x = _x(2, 4)
    variables = _same_init(build, x, 0, rngs=RNGS)
    for index in range(3):
        _same_apply(build, variables, x, index)


@pytest.mark.parametrize("split", [True, False])
def test_while_loop_equal_linen(split):
    def build(nn):
        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                def cond(m, c):
                    return c[0] < 3

                def body(m, c):
                    return c[0] + 1, c[1] + jax.random.uniform(m.make_rng("dropout"), x.shape)
                a = self.make_rng("dropout")
                out = nn.while_loop(cond, body, self, (0, x), split_rngs={"dropout": split})
                return a, out, self.make_rng("dropout")
        return Net()
    _same_apply(build, {}, _x(2))


def test_shared_module_inside_and_outside_a_lift_equal_linen():
    def build(nn):
        class Net(nn.Module):
            def setup(self):
                self.block = _noisy(nn)()

            def __call__(self, x):
                a = self.block(0.0, x)
                b = nn.remat(lambda m, x: m.block(1.0, x))(self, x)
                return a, b, self.block(2.0, x)
        return Net()
    x = _x(2, 4)
    variables = _same_init(build, x, rngs=RNGS)
    _same_apply(build, variables, x)


# --- NNX's convention: RNG state -----------------------------------------------------------

def test_init_returns_fresh_rng_state_so_reseed_then_apply_repeats_the_first_apply():
    class Net(vnn.Module):
        @vnn.compact
        def __call__(self, x, train: bool = False):
            return vnn.Dropout(0.5, deterministic=not train)(vnn.Dense(8)(x))
    model, x = Net(), _x(2, 4)
    variables = model.init(vj.Rngs(params=0, dropout=1), x, train=True)   # init draws
    assert int(variables["rngs"]["dropout"]["count"]) == 0
    first, _ = model.apply(variables, x, train=True, mutable=["rngs"])
    again, _ = model.apply(vj.reseed(variables, dropout=1), x, train=True, mutable=["rngs"])
    np.testing.assert_array_equal(first, again)
    full = model.apply({}, x, train=True, rngs=vj.Rngs(params=0, dropout=1), mutable=True)[1]
    _equal({k: v for k, v in variables.items() if k != "rngs"},
           {k: v for k, v in full.items() if k != "rngs"})


def test_rngs_keep_nnx_order_based_keys():
    """With a ``vj.Rngs`` the i-th draw of a stream is ``fold_in(key, i)`` whatever the
    module path: NNX's convention, not Linen's."""
    keys = _draws(vnn).apply({}, rngs=vj.Rngs(a=3, b=4))
    k = jax.random.key(3)
    _equal(keys[0], jax.random.fold_in(k, 0))
    _equal(keys[1][0][0], jax.random.fold_in(k, 1))
    _equal(keys[2], jax.random.fold_in(k, 7))


@pytest.mark.parametrize("transform", ["jit", "fold_rngs"])
def test_jit_and_fold_rngs_fork_the_module_rngs_as_linen(transform):
    """Linen's ``nn.jit`` and ``nn.fold_rngs`` draw one key per stream at the module's path
    before the body runs; inside, paths count from the module."""
    def build(nn):
        class Inner(nn.Module):
            @nn.compact
            def __call__(self, x):
                h = nn.Dropout(0.5, deterministic=False)(nn.Dense(3)(x))
                return h, self.make_rng("dropout")

        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                a = self.make_rng("dropout")
                block = getattr(nn, transform)(Inner)(name="block")
                return a, block(x), block(2 * x), self.make_rng("dropout")
        return Net()
    x = _x(2, 4)
    variables = _same_init(build, x, rngs=RNGS)
    _same_apply(build, variables, x)


@pytest.mark.parametrize("rule", ["custom_jvp", "custom_vjp"])
def test_custom_derivative_rule_traced_late_draws_its_primal_keys(rule):
    """A rule traced by a pass after the trace (Linen's counts have moved on) draws the keys
    its primal drew, so the forward value under differentiation is the primal's."""
    def noisy(h):
        return h + jax.random.uniform(vj.make_rng("dropout"), h.shape)

    if rule == "custom_jvp":
        f = jax.custom_jvp(noisy)
        f.defjvp(lambda primals, tangents: (noisy(*primals), tangents[0]))
    else:
        f = jax.custom_vjp(noisy)
        f.defvjp(lambda h: (noisy(h), None), lambda _, g: (g,))

    @vj.functionalize
    def run(x):
        return f(x).sum() + jax.random.uniform(vj.make_rng("dropout"), ())

    x, rngs = _x(3), {"dropout": jax.random.key(2)}
    value, grad = jax.value_and_grad(lambda x: run.apply({}, x, rngs=rngs))(x)
    np.testing.assert_array_equal(value, run.apply({}, x, rngs=rngs))
    np.testing.assert_array_equal(grad, np.ones(3, np.float32))


def test_raw_jit_helper_called_twice_draws_what_linen_draws():
    """JAX caches a raw ``jax.jit`` helper's trace, draws included, in Linen as in varjax:
    called twice in one ``apply`` it gives the same key both times, bit for bit Linen's."""
    def make(nn):
        class Helper(nn.Module):
            @nn.compact
            def __call__(self, x):
                @jax.jit
                def helper(x):
                    return x + jax.random.uniform(self.make_rng("d"), ())
                return helper(x), helper(x)
        return Helper()
    rngs = {"d": KEY}
    ours = make(vnn).apply({}, jnp.float32(0), rngs=rngs)
    np.testing.assert_array_equal(ours, make(fnn).apply({}, jnp.float32(0), rngs=rngs))
    assert ours[0] == ours[1]
