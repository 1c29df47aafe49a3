"""``transform_metadata`` keys other than ``nnx.PARTITION_NAME``, and Variables'
``on_add_axis``/``on_remove_axis`` hooks, against flax.nnx 0.12.8: under ``nnx.vmap``,
``nnx.scan``, ``nnx.pmap`` (one device) and ``nnx.transform_metadata`` itself, the same
metadata inside and after, and the same hook calls, in the same order, with the same
arguments and the metadata each call sees."""
import warnings

import jax
import jax.numpy as jnp
import pytest
from flax import nnx as flax_nnx

from varjax import nnx
from varjax.ir import errors

X = jnp.ones((1, 2))


def _library(lib):
    """A two-Variable module of ``lib`` whose hooked Variable records each hook call (with
    the metadata it sees then) in ``calls``, and a reader of the metadata under test."""
    calls = []

    def seen(v):
        md = v.get_metadata()
        return tuple(md.get("out_sharding") or ()), tuple(md.get("extra") or ())

    class Hooked(lib.Param):
        def on_add_axis(self, axis_index, axis_name):
            calls.append(("add", axis_index, axis_name, *seen(self)))
            return self

        def on_remove_axis(self, axis_index, axis_name):
            calls.append(("remove", axis_index, axis_name, *seen(self)))
            return self

    class Model(lib.Module):
        def __init__(self, rngs):
            self.w = Hooked(jax.random.normal(rngs.params(), (2, 3)), out_sharding=("a", None),
                            extra=("x", "y"))
            self.b = lib.Param(jnp.zeros((3,)), out_sharding=("b",), extra=("z",), other=5)

        def __call__(self, x):
            calls.append(("inside", *seen(self.w), *seen(self.b)))
            return x @ self.w[...] + self.b[...][None]

    def metadata(m):
        return {k: (m.w.get_metadata().get(k), m.b.get_metadata().get(k))
                for k in ("out_sharding", "extra", "other")}
    return Model, calls, metadata


TM = {"partition_name": "layers", "extra": "L", "other": "O"}


def _both(run):
    """``run(lib)`` with varjax.nnx and with flax.nnx (no mesh: flax places nothing eagerly;
    flax warns that hooks are deprecated)."""
    ours = run(nnx)
    with flax_nnx.use_eager_sharding(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = run(flax_nnx)
    return ours, theirs


def _stack(lib, Model, transform_metadata=TM):
    return lib.vmap(Model, transform_metadata=transform_metadata)(lib.Rngs(0).fork(split=2))


def test_vmap_other_keys_name_tuple_metadata_and_hooks_run_as_flax():
    def run(lib):
        Model, calls, metadata = _library(lib)
        stack = _stack(lib, Model)
        made, calls[:] = (list(calls), metadata(stack)), []
        y = lib.vmap(lambda m, x: m(x), in_axes=(0, None), transform_metadata=TM)(stack, X)
        return made, calls, metadata(stack), y
    (made, calls, after, y), (fmade, fcalls, fafter, fy) = _both(run)
    assert made == fmade
    assert made[0] == [("add", 0, "layers", ("layers", "a", None), ("L", "x", "y"))]
    assert made[1]["extra"] == (("L", "x", "y"), ("L", "z")) and made[1]["other"] == (None, 5)
    assert calls == fcalls == [
        ("remove", 0, "layers", ("a", None), ("x", "y")),
        ("inside", ("a", None), ("x", "y"), ("b",), ("z",)),
        ("add", 0, "layers", ("layers", "a", None), ("L", "x", "y"))]
    assert after == fafter
    assert jnp.array_equal(y, fy)


def test_scan_other_keys_and_hooks_as_flax():
    def run(lib):
        Model, calls, metadata = _library(lib)
        stack = _stack(lib, Model)
        calls.clear()
        step = lib.scan(lambda m, x: jnp.tanh(m(x)[:, :2]), in_axes=(0, lib.Carry),
                        out_axes=lib.Carry, transform_metadata=TM)
        return calls, metadata(stack), step(stack, X)
    (calls, after, y), (fcalls, fafter, fy) = _both(run)
    assert calls == fcalls and [c[0] for c in calls] == ["remove", "inside", "add"]
    assert after == fafter
    assert jnp.array_equal(y, fy)


def test_pmap_other_keys_and_hooks_as_flax_on_one_device():
    def run(lib):
        Model, calls, metadata = _library(lib)
        stack = lib.vmap(Model, transform_metadata=TM)(lib.Rngs(0).fork(split=1))
        calls.clear()
        y = lib.pmap(lambda m, x: m(x), in_axes=(0, None), transform_metadata=TM)(stack, X)
        return calls, metadata(stack), y
    (calls, after, y), (fcalls, fafter, fy) = _both(run)
    assert calls == fcalls and [c[0] for c in calls] == ["remove", "inside", "add"]
    assert after == fafter
    assert jnp.array_equal(y, fy)


def test_transform_metadata_runs_the_hooks_as_flax():
    def run(lib):
        Model, calls, metadata = _library(lib)
        stack = _stack(lib, Model)
        calls.clear()
        lib.transform_metadata(lambda m, x: x, in_axes=(0, None), out_axes=0,
                               partition="layers")(stack, X[0])
        return calls, metadata(stack)
    (calls, after), (fcalls, fafter) = _both(run)
    assert calls == fcalls
    assert calls[0] == ("remove", 0, "layers", ("a", None), ("L", "x", "y"))  # extra kept
    assert after == fafter


def test_hooks_given_by_with_metadata_and_keywords_run_as_flax():
    def run(lib):
        calls = []

        def hook(tag):
            def record(v, axis_index, axis_name):
                calls.append((tag, type(v).__name__, axis_index, axis_name))
            return record

        class Own(lib.Param):
            def on_add_axis(self, axis_index, axis_name):
                calls.append(("own", axis_index, axis_name))

        class Model(lib.Module):
            def __init__(self, rngs):
                init = lib.with_metadata(lib.initializers.zeros_init(), on_add_axis=hook("wm"),
                                         on_remove_axis=(hook("rm"), hook("rm2")),
                                         out_sharding=("a",))
                self.a = lib.Param(init(rngs.params(), (2,)))
                self.b = lib.Param(jnp.ones(2), on_add_axis=hook("kw"))
                self.c = Own(jnp.ones(2), on_add_axis=(hook("given"),))   # given wins
                self.d = Own(jnp.ones(2))
        stack = lib.vmap(Model, transform_metadata=TM)(lib.Rngs(0).fork(split=2))
        lib.vmap(lambda m: None, transform_metadata=TM)(stack)
        return calls, len(stack.a.get_metadata()["on_remove_axis"])
    ours, theirs = _both(run)
    assert ours == theirs
    assert [c[0] for c in ours[0]] == ["wm", "kw", "given", "own", "rm", "rm2",
                                       "wm", "kw", "given", "own"]


def test_an_other_key_not_at_the_axis_is_a_value_error_naming_the_variable():
    Model, _, _ = _library(nnx)
    stack = _stack(nnx, Model)
    wrong = {"partition_name": "layers", "extra": "Q"}
    with pytest.raises(errors.PartitioningError, match="extra 'L', not 'Q'") as caught:
        nnx.vmap(lambda m: m.w[...], transform_metadata=wrong)(stack)
    assert isinstance(caught.value, ValueError) and "m/b" in str(caught.value)
    assert __file__ in str(caught.value)
    FModel, _, _ = _library(flax_nnx)
    with flax_nnx.use_eager_sharding(False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fstack = _stack(flax_nnx, FModel)
        with pytest.raises(ValueError, match="'Q'"):
            flax_nnx.vmap(lambda m: m.w[...], transform_metadata=wrong)(fstack)
    assert stack.b.get_metadata()["extra"] == fstack.b.get_metadata()["extra"] == ("L", "z")


def test_other_keys_without_a_partition_name_change_nothing_as_flax():
    def run(lib):
        Model, calls, metadata = _library(lib)
        return calls, metadata(_stack(lib, Model, {"extra": "L"}))
    ours, theirs = _both(run)
    assert ours == theirs and ours[0] == []
    assert ours[1]["extra"] == (("x", "y"), ("z",))


def test_a_variable_held_at_two_places_has_its_axis_taken_out_once_as_flax():
    def run(lib):
        calls = []

        class Twice(lib.Module):
            def __init__(self):
                shared = lib.Param(jnp.ones((2, 3)), extra=("E", "x"),
                                   on_remove_axis=lambda v, i, n: calls.append(("rm", i, n)))
                self.a, self.b = shared, shared
        m = Twice()
        tm = {lib.PARTITION_NAME: "L", "extra": "E"}
        y = lib.vmap(lambda m, x: x * m.a[...], in_axes=(0, 0), transform_metadata=tm)(
            m, jnp.ones((2, 3)))
        return calls, m.a.get_metadata()["extra"], y.tolist()
    ours, theirs = _both(run)
    assert ours == theirs and ours[0] == [("rm", 0, "L")]
