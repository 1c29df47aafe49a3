"""Checks shared by the ports of Flax's examples (``tests/ports/test_port_*.py``).

Each port writes its model once, as a function of the ``nn`` namespace (``build(nn)``), and
``Port(build, ...)`` instantiates that same source over ``flax.linen`` (the oracle) and over
``varjax.nn``, as a user porting the example would by changing one import.  The checks then
run both on the same inputs:

* ``check_init``: the same key gives the same variables, **bit for bit** (Linen's RNG
  derivation), in the same layout (collections, paths, shapes, dtypes);
* ``check_apply``: on the same variables, the same outputs and mutated collections (a
  decode step's cache included);
* ``check_train``: a jitted training step's forward pass (outputs, mutated collections; in
  train mode with the same ``rngs`` dict, so the same dropout masks) and ``jax.grad`` of a
  scalar loss with respect to ``params`` agree.

Outputs and grads are compared to a tight tolerance rather than bitwise: both libraries run
the same operations, but varjax's pipeline may fuse or reorder them under one ``jit``, which
moves the last bits of a float sum.  A dropout mask drawn differently moves an output by
whole units, far past the tolerance.

``perturb`` adds NumPy noise to the initial parameters before the output and gradient checks,
so a zero bias or unit scale at init cannot hide a layer that ignores it.

Variables boxed with partitioning metadata (``nn.with_logical_partitioning``) are compared
box by box (type, axis names, mesh, rules) and then by value, unboxed.  For a model that
names its axes, ``check_sharded_init`` and ``check_sharded_train`` run Linen's recipe for
sharded training (Flax's LM1B example: shardings from an abstract ``init`` and the logical
axis rules, ``init`` and the training step jitted with them) over a mesh in both libraries.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec, Sharding

import varjax.nn as vj_nn

ATOL = 2e-5
# RBG keys: XLA:CPU compiles their programs about twice as fast as threefry's, and
# Linen's derivation (fold_in per module path and count) is the same for both.
KEY = jax.random.key(0, impl="rbg")
DROPOUT = {"dropout": jax.random.key(1, impl="rbg")}


def plain(tree: Any) -> Any:
    """Plain dicts all the way down (Flax may return FrozenDicts), keys as their data."""
    if hasattr(tree, "items"):
        return {k: plain(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(plain(x) for x in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(plain(x) for x in tree)
    if isinstance(tree, jax.Array) and jax.dtypes.issubdtype(tree.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(tree))
    return tree


def _is_box(x: Any) -> bool:
    """A partitioning-metadata box of either library (``nn.LogicallyPartitioned`` and kin)."""
    return isinstance(x, (flax_nn.meta.AxisMetadata, vj_nn.meta.AxisMetadata))


def boxes(tree: Any) -> dict[str, tuple]:
    """``{path: (box type, axis names, mesh, rules)}`` of every box in ``tree``."""
    flat = jax.tree_util.tree_flatten_with_path(plain(tree), is_leaf=_is_box)[0]
    return {jax.tree_util.keystr(p): (type(x).__name__, tuple(x.names), x.mesh,
                                      getattr(x, "rules", None))
            for p, x in flat if _is_box(x)}


def unboxed(tree: Any) -> Any:
    """``tree`` with every box replaced by its value, unconstrained (``nn.unbox`` outside a
    mesh)."""
    return jax.tree.map(lambda x: unboxed(x.unbox(apply_constraint=False)) if _is_box(x) else x,
                        tree, is_leaf=_is_box)


def layout(tree: Any) -> dict[str, tuple[tuple[int, ...], Any]]:
    """``{path: (shape, dtype)}`` of every leaf."""
    flat = jax.tree_util.tree_flatten_with_path(plain(tree))[0]
    return {jax.tree_util.keystr(p): (tuple(np.shape(x)), jnp.result_type(x)) for p, x in flat}


def assert_equal(got: Any, want: Any) -> None:
    """Same boxes, same layout and the same values, bit for bit."""
    assert boxes(got) == boxes(want), (boxes(got), boxes(want))
    got, want = unboxed(got), unboxed(want)
    assert layout(got) == layout(want), (layout(got), layout(want))
    for a, b in zip(jax.tree.leaves(plain(got)), jax.tree.leaves(plain(want))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def assert_close(got: Any, want: Any, atol: float = ATOL) -> None:
    """Same boxes, same layout and values within ``atol`` (absolute and relative)."""
    assert boxes(got) == boxes(want), (boxes(got), boxes(want))
    got, want = unboxed(got), unboxed(want)
    assert layout(got) == layout(want), (layout(got), layout(want))
    for a, b in zip(jax.tree.leaves(plain(got)), jax.tree.leaves(plain(want))):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   atol=atol, rtol=atol)


def perturb(variables: dict, seed: int = 1, scale: float = 0.2) -> dict:
    """``variables`` with NumPy noise added to every float parameter (other collections
    are kept).  NumPy draws: no XLA compile per parameter shape."""
    rng = np.random.default_rng(seed)

    def noisy(x):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return x
        noise = scale * rng.standard_normal(np.shape(x))
        return jnp.asarray(np.asarray(x, np.float32) + noise, jnp.result_type(x))

    variables = plain(variables)
    return {**variables, "params": jax.tree.map(noisy, variables["params"])}


def normal(shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    """A float32 input drawn with NumPy."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def tokens(shape: tuple[int, ...], vocab: int, seed: int = 0, low: int = 1) -> jax.Array:
    """int32 token ids in ``[low, vocab)``."""
    return jnp.asarray(np.random.default_rng(seed).integers(low, vocab, shape), jnp.int32)


class Port:
    """One model source built over both libraries: ``port.flax`` and ``port.vj``."""

    def __init__(self, build: Callable[[Any], Any], *args: Any, **kwargs: Any):
        self.flax = build(flax_nn)(*args, **kwargs)
        self.vj = build(vj_nn)(*args, **kwargs)

    def both(self, call: Callable[..., Any], *arrays: Any, jit_varjax: bool = False,
             exact: bool = False, **static: Any) -> tuple[Any, Any]:
        """``(call(varjax model, *arrays, **static), call(flax model, ...))``, in the order
        the asserts take them.  Flax's side runs under ``jax.jit``, compiled once per
        ``(call, model, static)``: one XLA compile instead of one per operation (the eager
        oracle spends seconds compiling each random op on its own), and none again for a
        decode loop's later steps.  varjax's side runs as the user calls it: eagerly, or
        under ``jax.jit`` with ``jit_varjax`` (a training step, init).  Keyword arguments that are
        arrays are traced; the others are static.  ``exact`` compiles Flax's side with XLA's
        default options (both sides), for results compared bit for bit."""
        array_kwargs = {k: v for k, v in static.items() if isinstance(v, jax.Array)}
        static = {k: v for k, v in static.items() if k not in array_kwargs}

        def runner(model):
            def run(kwargs, *args):
                return call(model, *args, **kwargs, **static)
            return run

        inputs = (array_kwargs, *arrays)
        key = (call, self.flax, exact, _signature(inputs),
               tuple((k, _hashable(v)) for k, v in sorted(static.items())))
        if key not in _FLAX_RUNS:
            _FLAX_RUNS[key] = _compile(runner(self.flax), inputs, quick=not exact)
        run_vj = runner(self.vj)
        got = _compile(run_vj, inputs, quick=not exact)(*inputs) if jit_varjax else run_vj(*inputs)
        return got, _FLAX_RUNS[key](*inputs)


_FLAX_RUNS: dict[Any, Callable[..., Any]] = {}

# XLA:CPU's LLVM optimizations take about 40% of a small program's compile time and buy
# nothing on inputs this size.  Only for the programs these checks compile themselves and
# compare within a tolerance (Flax's calls and the training steps): the optimizations move
# the last bit of some floats (an initializer's erf_inv), so ``init`` keeps the defaults.
_QUICK_COMPILE = {"xla_backend_optimization_level": 0}


def _compile(fn: Callable[..., Any], inputs: tuple, quick: bool = True) -> Callable[..., Any]:
    lowered = jax.jit(fn).lower(*inputs)
    return lowered.compile(compiler_options=_QUICK_COMPILE) if quick else lowered.compile()


def _signature(tree: Any) -> tuple:
    """The structure, shapes and dtypes of ``tree``: what a compiled program is for."""
    leaves, structure = jax.tree.flatten(tree)
    return structure, tuple((np.shape(x), jnp.result_type(x)) for x in leaves)


def _hashable(value: Any) -> Any:
    """Lists (``mutable=['cache']``) as tuples, so static arguments can key a cache."""
    return tuple(value) if isinstance(value, list) else value


def _init(model: Any, rngs: Any, args: tuple, **kwargs: Any) -> Any:
    return model.init(rngs, *args, **kwargs)


def _apply(model: Any, variables: dict, rngs: Any, args: tuple, **kwargs: Any) -> Any:
    return model.apply(variables, *args, rngs=rngs, **kwargs)


def _loss_step(model: Any, variables: dict, rngs: Any, args: tuple, *,
               loss: Callable[[Any], jax.Array], **kwargs: Any) -> tuple[Any, Any]:
    """A training step's forward and backward pass: ``((loss, apply's result), grads)``."""
    def objective(params):
        result = model.apply({**variables, "params": params}, *args, rngs=rngs, **kwargs)
        return loss(result), result
    return jax.value_and_grad(objective, has_aux=True)(variables["params"])


def _step(model: Any, variables: dict, rngs: Any, args: tuple, **kwargs: Any) -> tuple[Any, Any]:
    """``_loss_step`` without the loss: ``(apply's result, grads)``."""
    (_, result), grads = _loss_step(model, variables, rngs, args, **kwargs)
    return result, grads


def check_init(port: Port, rngs: Any, *args: Any, **kwargs: Any) -> dict:
    """Asserts both libraries initialize bit for bit alike, with the same partitioning
    metadata (boxes and ``nn.get_partition_spec``); returns Flax's variables, unboxed as
    the examples unbox them for training.  Both run under ``jax.jit``: an eager ``init``
    evaluates operation by operation in either library, which XLA may round differently
    from the whole program (tests/nn/test_eager_init.py compares the eager forms)."""
    got, want = port.both(_init, rngs, args, exact=True, jit_varjax=True, **kwargs)
    assert_equal(got, want)
    assert specs(vj_nn, got) == specs(flax_nn, want)
    return plain(unboxed(want))


def check_apply(port: Port, variables: dict, *args: Any, atol: float = ATOL,
                **kwargs: Any) -> Any:
    """Asserts ``apply`` gives the same result (outputs, and the mutated collections when
    ``mutable=`` is passed); returns Flax's."""
    rngs = kwargs.pop("rngs", None)
    got, want = port.both(_apply, variables, rngs, args, **kwargs)
    assert_close(got, want, atol)
    return plain(want)


def check_train(port: Port, variables: dict, loss: Callable[[Any], jax.Array], *args: Any,
                atol: float = ATOL, **kwargs: Any) -> tuple[Any, Any]:
    """One training step's forward and backward pass, under ``jax.jit`` as a training step
    runs: asserts ``apply``'s result (outputs, and the mutated collections when ``mutable=``
    is passed) and ``jax.grad`` of ``loss(result)`` w.r.t. ``params`` agree.  Returns Flax's
    ``(result, grads)``.  One compile per library covers both checks."""
    rngs = kwargs.pop("rngs", None)
    got, want = port.both(_step, variables, rngs, args, jit_varjax=True, loss=loss, **kwargs)
    assert_close(got, want, atol)
    return plain(want)


def specs(nn: Any, tree: Any) -> dict[str, PartitionSpec]:
    """``{path: spec}`` of ``nn.get_partition_spec(tree)`` (``P()`` for an unboxed array)."""
    flat = jax.tree_util.tree_flatten_with_path(
        plain(nn.get_partition_spec(tree)), is_leaf=lambda x: isinstance(x, PartitionSpec))[0]
    return {jax.tree_util.keystr(p): x for p, x in flat}


def shardings(tree: Any) -> dict[str, Sharding]:
    """``{path: sharding}`` of every array in ``tree`` (boxes dropped)."""
    flat = jax.tree_util.tree_flatten_with_path(plain(unboxed(tree)))[0]
    return {jax.tree_util.keystr(p): x.sharding for p, x in flat}


def check_sharded_init(port: Port, mesh: Mesh, rules: Sequence[tuple[str, Any]], rngs: Any,
                       *args: Any, **kwargs: Any) -> tuple[tuple[dict, dict], Any]:
    """Linen's recipe for a sharded start, as Flax's LM1B example runs it
    (``utils.setup_initial_state``): the logical ``nn.get_partition_spec`` of an abstract
    ``init`` (``jax.eval_shape``), mapped by ``nn.logical_to_mesh_sharding`` to shardings
    over ``mesh`` under ``rules``, given to ``jax.jit(init)`` as ``out_shardings``, under
    ``jax.set_mesh(mesh)`` and ``nn.logical_axis_rules(rules)``.  Asserts the two libraries
    give the same logical specs and shardings, and the same boxed variables, bit for bit,
    laid out on the devices alike.  Both sides' ``init`` are this harness's programs,
    compiled with the same (quick) options, so their values still agree bit for bit.
    Returns ``((varjax's variables, Flax's), Flax's shardings)``."""
    def recipe(nn: Any, model: Any) -> tuple[Any, Any, Any]:
        def init(rngs: Any, *args: Any) -> Any:
            return model.init(rngs, *args, **kwargs)
        logical = nn.get_partition_spec(jax.eval_shape(init, rngs, *args))
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            placed = nn.logical_to_mesh_sharding(logical, mesh, rules)
            lowered = jax.jit(init, out_shardings=placed).lower(rngs, *args)
            return logical, placed, lowered.compile(compiler_options=_QUICK_COMPILE)(rngs, *args)

    got_logical, got_placed, got = recipe(vj_nn, port.vj)
    want_logical, want_placed, want = recipe(flax_nn, port.flax)
    assert specs(vj_nn, got_logical) == specs(flax_nn, want_logical)
    placed = jax.tree.flatten(plain(want_placed))
    assert jax.tree.flatten(plain(got_placed)) == placed, (got_placed, want_placed)
    assert all(isinstance(x, Sharding) for x in placed[0])
    assert_equal(got, want)
    assert shardings(got) == shardings(want), (shardings(got), shardings(want))
    return (got, want), want_placed


def check_sharded_train(port: Port, mesh: Mesh, rules: Sequence[tuple[str, Any]],
                        variables: tuple[dict, dict], placed: Any,
                        loss: Callable[[Any], jax.Array], *args: Any, arg_shardings: Any = None,
                        atol: float = ATOL, **kwargs: Any) -> Any:
    """A training step jitted as Flax's LM1B example jits it, with the variables' shardings
    ``placed`` (``check_sharded_init``'s) and the inputs' ``arg_shardings`` as
    ``in_shardings``, traced under ``jax.set_mesh(mesh)`` and ``nn.logical_axis_rules(rules)``.
    ``variables`` are each library's own (varjax's, Flax's), boxed: their reads are
    constrained to the rules' shardings (Linen's ``self.param`` unboxes with a constraint,
    varjax's ``shard-variables`` pass puts it on the IR).  Asserts the loss, ``apply``'s result
    and the grads (boxed as the params are) agree, and that the grads come out laid out
    alike.  Returns Flax's ``((loss, result), grads)``."""
    rngs = kwargs.pop("rngs", None)

    def run(nn: Any, model: Any, variables: dict) -> Any:
        def step(variables: dict, rngs: Any, args: tuple) -> Any:
            return _loss_step(model, variables, rngs, args, loss=loss, **kwargs)
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            inputs = (variables, rngs, args)
            lowered = jax.jit(step, in_shardings=(placed, None, arg_shardings)).lower(*inputs)
            return lowered.compile(compiler_options=_QUICK_COMPILE)(*inputs)

    got = run(vj_nn, port.vj, variables[0])
    want = run(flax_nn, port.flax, variables[1])
    assert_close(got, want, atol)
    assert shardings(got[1]) == shardings(want[1]), (shardings(got[1]), shardings(want[1]))
    return want
