"""The benchmark models, each written once per framework: a 12-block residual MLP and a
4-block pre-LN transformer.

Per model there are four implementations of one function:

* **pure JAX** (``residual_mlp`` / ``transformer``): the math over a ``param(name,
  init_fn, shape)`` getter.  Pure JAX looks names up in a flat dict
  (``pure_apply``) or creates them while running the model (``pure_init``);
  ``vj.functionalize`` passes ``vj.param`` (``varjax_mlp``).  So they trace the
  same equations with the same initializers (``lecun_normal`` kernels, zero
  biases, LayerNorm scale ones / bias zeros), and any time difference is the
  framework's own tracing, pass pipeline and caching.
* **Linen-style module classes** (``module_mlp(nn)`` / ``module_transformer(nn)``),
  written once for any ``nn`` namespace: ``varjax.nn`` and ``flax.linen`` differ
  only in that argument -- the one-import port the Module system promises.
* **Flax NNX** (``nnx_mlp()`` / ``nnx_transformer()``): ``nnx.Module`` classes
  over ``nnx.Linear`` / ``nnx.LayerNorm`` / ``nnx.MultiHeadAttention``.

Parameter names are module paths joined by ``/`` (``blocks_0/dense0/kernel``): the
modules name their submodules explicitly, so ``to_linen`` (split on ``/``) turns a
pure-JAX dict into Linen variables, and ``nnx_path`` finds the same parameter in
an NNX model (``blocks_0`` is ``blocks[0]``).  ``check_frameworks`` runs all four
on one set of parameters and fails loudly unless the outputs agree.

LayerNorm is computed by hand (eps 1e-6) in pure JAX, with Flax's formula op for op,
so the compiled programs of all four are the same.  The transformer's causal mask
(``causal_mask``) is one shared jnp helper, so all four mask alike.

Sharp edges:
  * ``pure_init`` runs the forward pass to create parameters, as Flax Linen and
    varjax ``init`` do (shapes come from the inputs), so "init" compares like
    with like; a hand-written init that only allocates would trace less.  NNX
    creates parameters in ``__init__`` from the sizes it is given, without a
    forward pass, so its "init" traces less than the other three.
  * Every ``module_*`` / ``nnx_*`` call returns *new* classes: a benchmark that
    wants nothing cached (varjax shares traces between equal modules) builds one
    per repetition.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import varjax as vj

WIDTH = 256
BATCH = 8
DEPTH = 12
EPS = 1e-6

D_MODEL = 128
HEADS = 4
MLP_DIM = 512
SEQ = 64
LAYERS = 4

Param = Callable[[str, Callable[..., Any], tuple[int, ...]], jax.Array]

kernel_init = jax.nn.initializers.lecun_normal()


# --- pure JAX: the math, over a parameter getter -------------------------------------------

def dense(x: jax.Array, param: Param, name: str, features: int = WIDTH) -> jax.Array:
    kernel = param(f"{name}/kernel", kernel_init, (x.shape[-1], features))
    bias = param(f"{name}/bias", jax.nn.initializers.zeros, (features,))
    return x @ kernel + bias


def layer_norm(x: jax.Array, param: Param, name: str) -> jax.Array:
    scale = param(f"{name}/scale", jax.nn.initializers.ones, (x.shape[-1],))
    bias = param(f"{name}/bias", jax.nn.initializers.zeros, (x.shape[-1],))
    # Flax's formula, op for op (so the compiled programs are the same): the variance as
    # E[x^2] - E[x]^2, clipped at zero; scale folded into the rsqrt.
    mean = jnp.mean(x, axis=-1)
    var = jnp.maximum(0.0, jnp.mean(jax.lax.square(x), axis=-1) - jax.lax.square(mean))
    mul = jax.lax.rsqrt(jnp.expand_dims(var, -1) + EPS) * scale.reshape(1, -1)
    return (x - jnp.expand_dims(mean, -1)) * mul + bias.reshape(1, -1)


def residual_mlp(x: jax.Array, param: Param, depth: int = DEPTH) -> jax.Array:
    """Block: Dense -> LayerNorm -> relu -> Dense, plus the residual; ``depth`` blocks."""
    for i in range(depth):
        h = dense(x, param, f"blocks_{i}/dense0")
        h = layer_norm(h, param, f"blocks_{i}/ln")
        h = jax.nn.relu(h)
        x = x + dense(h, param, f"blocks_{i}/dense1")
    return x


def causal_mask(length: int) -> jax.Array:
    """``[q, k]``, True where query position q may attend to key position k <= q."""
    return jnp.tril(jnp.ones((length, length), bool))


def attention(x: jax.Array, param: Param, name: str, mask: jax.Array) -> jax.Array:
    """Flax's ``MultiHeadDotProductAttention`` (self-attention, no dropout), by hand and op
    for op (projections are ``DenseGeneral``'s ``dot_general``): ``query``/``key``/``value``
    kernels ``[d, heads, head_dim]``, ``out`` ``[heads, head_dim, d]``."""
    d = x.shape[-1]
    head_dim = d // HEADS

    def project(part: str) -> jax.Array:
        kernel = param(f"{name}/{part}/kernel", kernel_init, (d, HEADS, head_dim))
        bias = param(f"{name}/{part}/bias", jax.nn.initializers.zeros, (HEADS, head_dim))
        return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ()))) + bias

    query, key, value = project("query"), project("key"), project("value")
    query = query / jnp.sqrt(head_dim).astype(query.dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key)
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    heads = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits), value)
    kernel = param(f"{name}/out/kernel", kernel_init, (HEADS, head_dim, d))
    bias = param(f"{name}/out/bias", jax.nn.initializers.zeros, (d,))
    n = heads.ndim
    return jax.lax.dot_general(heads, kernel, (((n - 2, n - 1), (0, 1)), ((), ()))) + bias


def transformer(x: jax.Array, param: Param) -> jax.Array:
    """Pre-LN block: x + Attn(LN(x)), then x + Dense(gelu(Dense(LN(x)))); ``LAYERS``
    blocks, causal, then a final LayerNorm.  ``x`` is ``[batch, seq, d_model]``."""
    mask = causal_mask(x.shape[-2])
    for i in range(LAYERS):
        x = x + attention(layer_norm(x, param, f"blocks_{i}/ln1"), param, f"blocks_{i}/attn", mask)
        h = dense(layer_norm(x, param, f"blocks_{i}/ln2"), param, f"blocks_{i}/mlp_in", MLP_DIM)
        x = x + dense(jax.nn.gelu(h), param, f"blocks_{i}/mlp_out", x.shape[-1])
    return layer_norm(x, param, "ln_final")


def pure_apply_of(model: Callable[[jax.Array, Param], jax.Array]) -> Callable[..., jax.Array]:
    """``(params, x) -> y`` for a model over a getter: a flat-dict lookup."""
    def apply(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return model(x, lambda name, init_fn, shape: params[name])
    return apply


def pure_init_of(model: Callable[[jax.Array, Param], jax.Array]) -> Callable[..., dict[str, jax.Array]]:
    """``(key, x) -> params``: create every parameter while running the model; keys
    fold a counter into ``key``, as ``vj.make_rng`` does."""
    def init(key: jax.Array, x: jax.Array) -> dict[str, jax.Array]:
        params: dict[str, jax.Array] = {}

        def create(name: str, init_fn: Callable[..., Any], shape: tuple[int, ...]) -> jax.Array:
            params[name] = init_fn(jax.random.fold_in(key, len(params)), shape)
            return params[name]

        model(x, create)
        return params
    return init


pure_apply = pure_apply_of(residual_mlp)
pure_init = pure_init_of(residual_mlp)


def varjax_mlp() -> Any:
    """A new functionalized model around a new function object: empty caches."""
    def model(x: jax.Array) -> jax.Array:
        return residual_mlp(x, vj.param)
    return vj.functionalize(model)


def inputs() -> tuple[jax.Array, jax.Array]:
    """``(key, x)`` for every benchmark of the MLP."""
    key = jax.random.key(0)
    return key, jax.random.normal(jax.random.fold_in(key, 1), (BATCH, WIDTH))


def check_same_model(key: jax.Array, x: jax.Array) -> dict[str, jax.Array]:
    """Fail loudly unless pure JAX and ``vj.functionalize`` have the same MLP parameters
    and outputs; return the parameters the benchmarks use."""
    params = pure_init(key, x)
    model = varjax_mlp()
    variables = model.init(key, x)
    if _shapes(variables) != _shapes({"params": params}):
        raise AssertionError("varjax init and pure JAX init disagree on parameter names/shapes")
    np.testing.assert_allclose(model.apply({"params": params}, x), pure_apply(params, x),
                               rtol=1e-5, atol=1e-5)
    return params


# --- Linen-style module classes, written once for any `nn` ---------------------------------

def module_mlp(nn: Any, depth: int = DEPTH) -> Any:
    """The residual MLP (``depth`` blocks) as a Linen-style module class, written once for
    any ``nn`` namespace: ``module_mlp(varjax.nn)`` and ``module_mlp(flax.linen)`` differ
    only in that argument.  Explicit names give ``residual_mlp``'s parameter paths."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(WIDTH, name="dense0")(x)
            h = nn.relu(nn.LayerNorm(epsilon=EPS, name="ln")(h))
            return x + nn.Dense(WIDTH, name="dense1")(h)

    class ResidualMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(depth):
                x = Block(name=f"blocks_{i}")(x)
            return x

    return ResidualMLP


def module_transformer(nn: Any) -> Any:
    """``transformer`` as a Linen-style module class, written once for any ``nn``."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.LayerNorm(epsilon=EPS, name="ln1")(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attn")(h, mask=mask)
            h = nn.Dense(MLP_DIM, name="mlp_in")(nn.LayerNorm(epsilon=EPS, name="ln2")(x))
            return x + nn.Dense(x.shape[-1], name="mlp_out")(nn.gelu(h))

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = causal_mask(x.shape[-2])
            for i in range(LAYERS):
                x = Block(name=f"blocks_{i}")(x, mask)
            return nn.LayerNorm(epsilon=EPS, name="ln_final")(x)

    return Transformer


# --- Flax NNX --------------------------------------------------------------------------------

def nnx_mlp(depth: int = DEPTH) -> type[nnx.Module]:
    """The residual MLP (``depth`` blocks) as new ``nnx.Module`` classes (construct with
    ``rngs=``)."""

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.dense0 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
            self.ln = nnx.LayerNorm(WIDTH, epsilon=EPS, rngs=rngs)
            self.dense1 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

        def __call__(self, x):
            return x + self.dense1(nnx.relu(self.ln(self.dense0(x))))

    class ResidualMLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(depth)])

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    return ResidualMLP


def nnx_transformer() -> type[nnx.Module]:
    """``transformer`` as new ``nnx.Module`` classes (construct with ``rngs=``)."""

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.ln1 = nnx.LayerNorm(D_MODEL, epsilon=EPS, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(HEADS, D_MODEL, decode=False, keep_rngs=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(D_MODEL, epsilon=EPS, rngs=rngs)
            self.mlp_in = nnx.Linear(D_MODEL, MLP_DIM, rngs=rngs)
            self.mlp_out = nnx.Linear(MLP_DIM, D_MODEL, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(x))))

    class Transformer(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
            self.ln_final = nnx.LayerNorm(D_MODEL, epsilon=EPS, rngs=rngs)

        def __call__(self, x):
            mask = causal_mask(x.shape[-2])
            for block in self.blocks:
                x = block(x, mask)
            return self.ln_final(x)

    return Transformer


# --- one model, four frameworks --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Spec:
    """A model in every framework: ``pure`` (the math over a getter), ``module(nn)`` (new
    Linen-style classes), ``nnx()`` (new NNX classes) and its input shape."""

    title: str
    pure: Callable[[jax.Array, Param], jax.Array]
    module: Callable[[Any], Any]
    nnx: Callable[[], type[nnx.Module]]
    input_shape: tuple[int, ...]

    def inputs(self) -> tuple[jax.Array, jax.Array]:
        key = jax.random.key(0)
        return key, jax.random.normal(jax.random.fold_in(key, 1), self.input_shape)


MLP = Spec(f"{DEPTH}-block residual MLP (width {WIDTH}, batch {BATCH})",
           residual_mlp, module_mlp, nnx_mlp, (BATCH, WIDTH))
TRANSFORMER = Spec(f"{LAYERS}-block pre-LN transformer (d_model {D_MODEL}, {HEADS} heads, MLP {MLP_DIM}, "
                   f"seq {SEQ}, batch {BATCH}, causal)",
                   transformer, module_transformer, nnx_transformer, (BATCH, SEQ, D_MODEL))


def to_linen(params: dict[str, jax.Array]) -> dict[str, Any]:
    """A pure-JAX flat dict as Linen variables: ``{'params': nested dict}``."""
    nested: dict[str, Any] = {}
    for name, value in params.items():
        *scopes, leaf = name.split("/")
        node = nested
        for s in scopes:
            node = node.setdefault(s, {})
        node[leaf] = value
    return {"params": nested}


def nnx_path(name: str) -> tuple[str | int, ...]:
    """Where parameter ``name`` lives in an NNX model: ``blocks_3/...`` is ``blocks[3]``."""
    path: list[str | int] = []
    for part in name.split("/"):
        match = re.fullmatch(r"(blocks)_(\d+)", part)
        path += [match[1], int(match[2])] if match else [part]
    return tuple(path)


def nnx_with(model: nnx.Module, params: dict[str, jax.Array]) -> nnx.Module:
    """``model`` with every parameter replaced by the pure-JAX one of the same name
    (in place); fails unless the two have the same parameters and shapes."""
    nnx_names = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    if nnx_names != {"/".join(map(str, nnx_path(n))) for n in params}:
        raise AssertionError(f"NNX and pure JAX parameter names differ: {sorted(nnx_names)}")
    for name, value in params.items():
        *scopes, leaf = nnx_path(name)
        node: Any = model
        for s in scopes:
            node = node[s] if isinstance(s, int) else getattr(node, s)
        variable = getattr(node, leaf)
        if variable.shape != value.shape:
            raise AssertionError(f"NNX {name}: shape {variable.shape}, pure JAX {value.shape}")
        variable[...] = value
    return model


def check_frameworks(spec: Spec, key: jax.Array, x: jax.Array, *,
                     libs: dict[str, Any]) -> dict[str, jax.Array]:
    """Fail loudly unless all four implementations of ``spec`` create the same parameter
    names and shapes and compute the same outputs from the pure-JAX parameters (``libs``:
    the Linen-style namespaces, e.g. varjax.nn and flax.linen); return those parameters."""
    params = pure_init_of(spec.pure)(key, x)
    variables = to_linen(params)
    expected = pure_apply_of(spec.pure)(params, x)
    for label, nn in libs.items():
        model = spec.module(nn)()
        if _shapes(jax.eval_shape(model.init, key, x)) != _shapes(variables):
            raise AssertionError(f"{label} init and pure JAX init disagree on parameter names/shapes")
        np.testing.assert_allclose(model.apply(variables, x), expected, rtol=1e-4, atol=1e-4,
                                   err_msg=f"{label} vs pure JAX")
    nnx_model = nnx_with(spec.nnx()(rngs=nnx.Rngs(key)), params)
    np.testing.assert_allclose(nnx_model(x), expected, rtol=1e-4, atol=1e-4, err_msg="NNX vs pure JAX")
    return params


def _shapes(tree: Any) -> Any:
    return jax.tree.map(lambda a: (tuple(a.shape), a.dtype), tree)
