"""The Tree Mode NNX design note (shared/design/003) as written, under varjax.nnx and
flax.nnx 0.12.8 from the same seeds: the note's code blocks not tested elsewhere.

Every code block of the note, in order, and where it runs:

1. ``def split(..., graph=None)``, ``def jit(..., graph=None, graph_updates=None)``: here,
   every flax.nnx function with those parameters has them, defaulting to None.
2. ``set_graph_mode``/``set_graph_updates``: ``current_value()``, a call, the environment
   variables, ``with`` blocks (and 4., the porting calls after the imports):
   ``tests/nnx/test_nnx_config.py``.
3. ``transform_wrapper``: pseudocode of flax's internals (``snapshot``, ``labeled``,
   ``get_updates``), not an API: not run.
5. and 6. ``nnx.compat.split = partial(...)``, the ``nnx.compat`` rewrites:
   ``tests/nnx/test_nnx_compat.py``.
7. Prefix filters, previous code (``StateAxes`` in ``vmap`` with ``graph=True,
   graph_updates=True``): here; as written its ``in_axis=`` is a ``TypeError`` in both
   libraries, and a bare ``in_axes=state_axes`` is JAX's ``TypeError`` in flax.nnx 0.12.8
   (``in_axes=(state_axes,)``, one entry per argument, runs).
8. Prefix filters, new code (split, ``vmap(in_axes=(0, None))``, merge):
   ``tests/nnx/test_nnx_graph_updates.py::
   test_design_note_prefix_filter_rewrite_with_split_and_merge_under_vmap``.
9. to 11. ``nnx.grad``, previous and new code: ``tests/nnx/test_nnx_graph_updates.py::
   test_design_note_grad_examples`` (the note's ``def graphdef, params, nondiff = ...`` is a
   syntax error as written; the assignment runs).
12. and 13. ``nnx.custom_vjp``, previous and new code: ``tests/nnx/test_nnx_differentiation.py``
   (``test_note_previous_custom_vjp_...``, ``test_note_new_custom_vjp_...``).
14. ``transform_metadata``, old code (``nnx.vmap(..., transform_metadata=...)``): built,
   ``tests/nnx/test_nnx_transform_options.py::
   test_vmap_transform_metadata_adds_the_partition_to_made_variables_as_flax``; as
   written it does not run in flax.nnx 0.12.8 (``class create_stack`` returning a value is
   a syntax error, ``split_rngs(8)`` a ``TypeError``: ``splits`` is keyword-only).
15. ``transform_metadata``, new code: ``tests/nnx/test_nnx_sharding.py::
   test_the_notes_transform_metadata_example_adds_the_partition_as_flax`` (``splits=``).
16. ``Module.sow``, old code (sow, then ``nnx.pop``): here.
17. ``Module.sow``, new code (``nnx.capture``): ``tests/nnx/test_nnx_capture.py``.
18. ``Module.perturb``, old code (``DiffState(0, (Param, Perturbation))``, ``nnx.pop``): here.
19. ``Module.perturb``, new code: ``tests/nnx/test_nnx_capture.py::
   test_the_notes_perturb_train_step_gives_flax_intermediate_gradients``.
"""
import contextlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx as flax_nnx

from varjax import nnx

X = jnp.arange(4.0).reshape(2, 2) / 3
Y = jnp.ones((2, 3))


def _same(ours, theirs):
    """Two States: the same paths, values to 1e-6 (bitwise where XLA computes them alike)."""
    a, b = nnx.to_pure_dict(ours), flax_nnx.to_pure_dict(theirs)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b)


def _flax_functions_with_modes():
    for name in sorted(dir(flax_nnx)):
        f = getattr(flax_nnx, name)
        if callable(f) and not isinstance(f, type):
            try:
                params = inspect.signature(f).parameters
            except (TypeError, ValueError):
                continue
            modes = [p for p in ("graph", "graph_updates") if p in params]
            if modes and name != "prefix":       # prefix: not built (unbuilt.NOT_YET)
                yield name, modes


def test_every_flax_function_taking_graph_or_graph_updates_takes_them_defaulting_to_none():
    seen = list(_flax_functions_with_modes())
    assert {"split", "jit", "vmap", "grad", "scan", "state", "clone"} <= {n for n, _ in seen}
    for name, modes in seen:
        params = inspect.signature(getattr(nnx, name)).parameters
        for mode in modes:
            assert mode in params, f"nnx.{name} has no {mode}="
            assert params[mode].default is None, f"nnx.{name}({mode}=) defaults to None"


# --- 7. Prefix filters: the previous code ---------------------------------------------------

def _ensemble(lib):
    """Two Linears stacked by vmap, a broadcast scale, a per-member counter."""
    model = lib.vmap(lambda rngs: lib.Linear(2, 3, rngs=rngs))(lib.Rngs(0).fork(split=2))
    model.scale = lib.BatchStat(jnp.full((), 2.0))
    model.calls = lib.Param(jnp.zeros((2,)))
    return model


def _previous_prefix_code(lib):
    model = _ensemble(lib)
    some_filter = lib.Param
    state_axes = lib.StateAxes({some_filter: 0, ...: None})

    @lib.vmap(in_axes=(state_axes,), graph=True, graph_updates=True)
    def f(model):
        model.calls[...] += 1
        return model(X) * model.scale[...]
    return f(model), model


def test_the_notes_previous_prefix_filter_code_maps_params_and_broadcasts_the_rest_as_flax():
    y, model = _previous_prefix_code(nnx)
    with pytest.warns(DeprecationWarning):
        fy, fmodel = _previous_prefix_code(flax_nnx)
    np.testing.assert_allclose(y, fy, rtol=1e-6)
    assert y.shape == (2, 2, 3)
    _same(nnx.state(model), flax_nnx.state(fmodel))
    np.testing.assert_array_equal(model.calls[...], [1.0, 1.0])


def test_the_notes_in_axis_spelling_is_a_type_error_in_both_libraries():
    for lib in (nnx, flax_nnx):
        with pytest.raises(TypeError, match="in_axis"):
            lib.vmap(lambda m: m, in_axis=lib.StateAxes({...: None}), graph=True,
                     graph_updates=True)


# --- 16. Module.sow: the old code -----------------------------------------------------------

def _foo(lib):
    class Foo(lib.Module):
        def __call__(self, x):
            self.sow(lib.Intermediate, "y_mean", jnp.mean(x))
            return x
    return Foo()


def test_the_notes_old_sow_then_pop_extracts_the_intermediates_as_flax():
    results = []
    for lib in (nnx, flax_nnx):
        model = _foo(lib)
        with pytest.warns(DeprecationWarning, match="sow") if lib is flax_nnx \
                else contextlib.nullcontext():
            result = model(X)
        intermediates = lib.pop(model, lib.Intermediate)   # extract intermediate values
        results.append((result, intermediates, model))
    (result, intermediates, model), (fresult, fintermediates, fmodel) = results
    np.testing.assert_array_equal(result, fresult)
    _same(intermediates, fintermediates)
    assert type(intermediates["y_mean"]) is nnx.Intermediate
    np.testing.assert_array_equal(intermediates["y_mean"][...], (jnp.mean(X),))
    assert not nnx.state(model, nnx.Intermediate) and not flax_nnx.state(fmodel,
                                                                        flax_nnx.Intermediate)


# --- 18. Module.perturb: the old code -------------------------------------------------------

def _perturbed(lib):
    class Model(lib.Module):
        def __init__(self, rngs):
            self.linear = lib.Linear(2, 3, rngs=rngs)

        def __call__(self, x):
            x = self.perturb('grad_of_x', x)
            y = self.linear(jnp.tanh(x))
            return y
    return Model(lib.Rngs(0))


def _old_perturb_step(lib):
    model = _perturbed(lib)
    optimizer = lib.Optimizer(model, optax.sgd(0.1), wrt=lib.Param)

    @lib.jit
    def train_step(model, optimizer, x, y):
        model(x)  # Initialize perturbation state

        def loss_fn(model):
            y_pred = model(x)
            return jnp.mean((y_pred - y) ** 2)
        diff_state = lib.DiffState(0, (lib.Param, lib.Perturbation))
        grads = lib.grad(loss_fn, argnums=diff_state)(model)
        grads, interm_grads = lib.state(grads, lib.Param, lib.Perturbation)
        optimizer.update(model, grads)
        lib.pop(model, lib.Perturbation)  # clean up perturbations
        return interm_grads
    return train_step(model, optimizer, X, Y), model


def test_the_notes_old_perturb_train_step_gives_flax_intermediate_grads_and_params():
    interm_grads, model = _old_perturb_step(nnx)
    with pytest.warns(DeprecationWarning, match="perturb"):
        finterm_grads, fmodel = _old_perturb_step(flax_nnx)
    _same(interm_grads, finterm_grads)
    _same(nnx.state(model), flax_nnx.state(fmodel))
    assert set(interm_grads) == {"grad_of_x"} and interm_grads["grad_of_x"].shape == X.shape
    assert not nnx.state(model, nnx.Perturbation)               # cleaned up
    fresh = _perturbed(nnx)
    want = jax.grad(lambda x: jnp.mean((fresh.linear(jnp.tanh(x)) - Y) ** 2))(X)
    np.testing.assert_allclose(interm_grads["grad_of_x"][...], want, rtol=1e-6)
