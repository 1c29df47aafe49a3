"""Every module-definition mistake Linen rejects, varjax rejects too, at ``init`` as Linen does:
two variables, two submodules, or a variable and a submodule with one name (in ``setup``, in
the compact method, or one in each, also around lifted transforms), and a variable declared
in a method that is neither ``setup`` nor ``@compact``.  Without the check one of the two
definitions silently wins.

Each model is written once against the ``nn`` namespace and run on flax.linen too, which must
raise as well.  varjax's error names the collection (where a variable is involved), the path,
the module and the user's line: the line marked ``# raises``.
"""
from __future__ import annotations

import dataclasses
import functools
import linecache
from typing import Any

import flax.errors
import flax.linen as flax_nn
import jax
import jax.numpy as jnp
import pytest

import varjax.nn as vj_nn
from varjax import errors

KEY = jax.random.key(0)
X = jnp.ones((2,), jnp.float32)
HERE = "test_module_definition_errors.py:"


@functools.cache
def _models(nn) -> dict[str, type]:
    ones = nn.initializers.ones

    class SetupSubmoduleThenVariable(nn.Module):
        def setup(self):
            self.a = nn.Dense(2)
            self.w = self.param("a", ones, (2,))  # raises

        def __call__(self, x):
            return self.a(x)

    class SetupVariableThenSubmodule(nn.Module):
        def setup(self):
            self.w = self.param("a", ones, (2,))
            self.a = nn.Dense(2)  # raises

        def __call__(self, x):
            return self.a(x)

    class SetupTwoParams(nn.Module):
        def setup(self):
            self.w = self.param("w", ones, (2,))
            self.v = self.param("w", ones, (2,))  # raises

        def __call__(self, x):
            return x * self.w * self.v

    class SetupTwoVariables(nn.Module):
        def setup(self):
            self.n = self.variable("stats", "n", jnp.zeros, (2,))
            self.m = self.variable("stats", "n", jnp.ones, (2,))  # raises

        def __call__(self, x):
            return x + self.n.value

    class SetupTwoSubmodules(nn.Module):
        def setup(self):
            self.a = nn.Dense(2, name="x")
            self.b = nn.Dense(2, name="x")  # raises

        def __call__(self, x):
            return self.a(x) + self.b(x)

    class CompactSubmoduleThenParam(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(2, name="a")(x)
            return y * self.param("a", ones, (2,))  # raises

    class CompactParamThenSubmodule(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("a", ones, (2,))
            return nn.Dense(2, name="a")(x) * w  # raises

    class CompactParamThenAutoNamed(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("Dense_0", ones, (2,))
            return nn.Dense(2)(x) * w  # raises

    class CompactTwoParams(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", ones, (2,))
            return x * w * self.param("w", ones, (2,))  # raises

    class CompactTwoVariables(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.variable("stats", "n", jnp.zeros, (2,))
            return x + self.variable("stats", "n", jnp.zeros, (2,)).value  # raises

    class BothSubmodules(nn.Module):
        def setup(self):
            self.dense = nn.Dense(2)

        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="dense")(x)  # raises

    class BothSubmoduleThenParam(nn.Module):
        def setup(self):
            self.dense = nn.Dense(2)

        @nn.compact
        def __call__(self, x):
            return x * self.param("dense", ones, (2,))  # raises

    class BothParamThenSubmodule(nn.Module):
        def setup(self):
            self.w = self.param("w", ones, (2,))

        @nn.compact
        def __call__(self, x):
            return nn.Dense(2, name="w")(x)  # raises

    class BothParams(nn.Module):
        def setup(self):
            self.w = self.param("w", ones, (2,))

        @nn.compact
        def __call__(self, x):
            return x * self.param("w", ones, (2,))  # raises

    class PlainParam(nn.Module):
        def __call__(self, x):
            return x * self.param("w", ones, (2,))  # raises

    class PlainVariable(nn.Module):
        def __call__(self, x):
            return x + self.variable("stats", "n", jnp.zeros, (2,)).value  # raises

    class PlainParamBesideSetup(nn.Module):
        def setup(self):
            self.w = self.param("w", ones, (2,))

        def __call__(self, x):
            return x * self.w * self.param("v", ones, (2,))  # raises

    class NameReusedAfterJit(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(2, name="a")(x)
            x = nn.jit(lambda m, x: x * 2.0)(self, x)
            return nn.Dense(2, name="a")(x)  # raises

    class ParamReusedAfterJit(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", ones, (2,))
            x = nn.jit(lambda m, x: x * 2.0)(self, x)
            return x * w * self.param("w", ones, (2,))  # raises

    class SetupParamReusedAfterVmap(nn.Module):
        def setup(self):
            self.w = self.param("w", ones, (2,))

        @nn.compact
        def __call__(self, x):
            x = nn.vmap(lambda m, x: x * m.w, variable_axes={"params": None},
                        split_rngs={"params": False})(self, x)
            return x * self.param("w", ones, (2,))  # raises

    class SetupSubmoduleReusedInJitBody(nn.Module):
        def setup(self):
            self.dense = nn.Dense(2)

        @nn.compact
        def __call__(self, x):
            return nn.jit(lambda m, x: nn.Dense(2, name="dense")(x))(self, x)  # raises

    class LiftedSubmoduleThenParam(nn.Module):
        def setup(self):
            self.a = nn.vmap(nn.Dense, variable_axes={"params": 0},
                             split_rngs={"params": True})(2)
            self.w = self.param("a", ones, (2,))  # raises

        def __call__(self, x):
            return self.a(x)

    class JitSetupAndCompactParams(nn.Module):
        def setup(self):
            self.w = self.param("w", ones, (2,))

        @nn.compact
        def __call__(self, x):
            return x * self.param("w", ones, (2,))  # raises

    class JitSetupSubmodulesUntouched(nn.Module):
        def setup(self):
            self.a = nn.Dense(2)
            self.b = nn.Dense(2, name="a")  # raises

        def __call__(self, x):
            return x

    class SownThenSubmodule(nn.Module):
        @nn.compact
        def __call__(self, x):
            self.sow("intermediates", "h", x)
            return nn.Dense(2, name="h")(x)  # raises

    models = {name: cls for name, cls in locals().items()
              if isinstance(cls, type) and issubclass(cls, nn.Module)}
    models["JitSetupAndCompactParams"] = nn.jit(JitSetupAndCompactParams)
    models["JitSetupSubmodulesUntouched"] = nn.jit(JitSetupSubmodulesUntouched)
    return models


@dataclasses.dataclass
class Case:
    error: type
    collection: str | None
    name: str              # the last path entry; the path is ("inner", name)
    mutable: Any = None    # init's mutable=, when the case needs one


NAME = errors.NameInUseError
CASES = {
    "SetupSubmoduleThenVariable": Case(NAME, "params", "a"),
    "SetupVariableThenSubmodule": Case(NAME, "params", "a"),
    "SetupTwoParams": Case(NAME, "params", "w"),
    "SetupTwoVariables": Case(NAME, "stats", "n"),
    "SetupTwoSubmodules": Case(NAME, None, "x"),
    "CompactSubmoduleThenParam": Case(NAME, "params", "a"),
    "CompactParamThenSubmodule": Case(NAME, "params", "a"),
    "CompactParamThenAutoNamed": Case(NAME, "params", "Dense_0"),
    "CompactTwoParams": Case(NAME, "params", "w"),
    "CompactTwoVariables": Case(NAME, "stats", "n"),
    "BothSubmodules": Case(NAME, None, "dense"),
    "BothSubmoduleThenParam": Case(NAME, "params", "dense"),
    "BothParamThenSubmodule": Case(NAME, "params", "w"),
    "BothParams": Case(NAME, "params", "w"),
    "PlainParam": Case(errors.ModuleError, "params", "w"),
    "PlainVariable": Case(errors.ModuleError, "stats", "n"),
    "PlainParamBesideSetup": Case(errors.ModuleError, "params", "v"),
    "NameReusedAfterJit": Case(NAME, None, "a"),
    "ParamReusedAfterJit": Case(NAME, "params", "w"),
    "SetupParamReusedAfterVmap": Case(NAME, "params", "w"),
    "SetupSubmoduleReusedInJitBody": Case(NAME, None, "dense"),
    "LiftedSubmoduleThenParam": Case(NAME, "params", "a"),
    "JitSetupAndCompactParams": Case(NAME, "params", "w"),
    "JitSetupSubmodulesUntouched": Case(NAME, None, "a"),
    "SownThenSubmodule": Case(NAME, "intermediates", "h", mutable=True),
}
# Linen's classes for the same mistakes (a definition outside setup/compact is a ValueError).
LINEN = {NAME: flax.errors.NameInUseError, errors.ModuleError: ValueError}


@functools.cache
def _net(nn):
    class Net(nn.Module):
        """A parent, so the paths and module names have two levels."""

        inner: Any

        @nn.compact
        def __call__(self, x):
            return self.inner(x)
    return Net


def _init(nn, name: str):
    model = _net(nn)(_models(nn)[name]())        # defining and constructing never raises
    kwargs = {} if CASES[name].mutable is None else {"mutable": CASES[name].mutable}
    return model.init(KEY, X, **kwargs)


def test_every_model_has_a_case():
    assert set(_models(vj_nn)) == set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_linen_raises_for_the_same_model(name):
    with pytest.raises(LINEN[CASES[name].error]):
        _init(flax_nn, name)


@pytest.mark.parametrize("name", list(CASES))
def test_varjax_raises_naming_collection_path_module_and_line(name):
    case = CASES[name]
    with pytest.raises(errors.VarjaxError) as info:
        _init(vj_nn, name)
    e = info.value
    assert type(e) is case.error, e
    assert (e.collection, e.path) == (case.collection, ("inner", case.name)), e
    model = _models(vj_nn)[name]
    assert e.module == f"Net/inner ({model.__name__})", e
    assert e.source is not None and HERE in e.source, e
    file, line = e.source.split(" ")[0].rsplit(":", 1)
    assert "# raises" in linecache.getline(__file__, int(line)), e.source
    assert f"'{case.name}'" in e.what and e.fix, e


def _fine(nn) -> dict[str, tuple[type, Any]]:
    ones = nn.initializers.ones

    class OtherCollection(nn.Module):          # one name in two collections
        @nn.compact
        def __call__(self, x):
            self.variable("stats", "w", jnp.zeros, (2,))
            return x * self.param("w", ones, (2,))

    class Once(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x * self.param("w", ones, (2,))

    class CalledTwice(nn.Module):              # each call of a compact method starts afresh
        @nn.compact
        def __call__(self, x):
            once = Once()
            return once(once(x))

    class Helper(nn.Module):                   # a helper called from the compact method
        @nn.compact
        def __call__(self, x):
            return self.helper(x)

        def helper(self, x):
            return x * self.param("w", ones, (2,))

    class SowTwice(nn.Module):                 # sowing appends; it is declared once
        @nn.compact
        def __call__(self, x):
            self.sow("intermediates", "h", x)
            self.sow("intermediates", "h", x)
            return x

    class BranchesDeclareOneParam(nn.Module):  # each branch is traced from the same names
        @nn.compact
        def __call__(self, x):
            return nn.cond(x.sum() > 0, lambda m, x: x * m.param("w", ones, (2,)),
                           lambda m, x: x + m.param("w", ones, (2,)), self, x)

    class ScannedParam(nn.Module):             # the scan body is traced more than once
        @nn.compact
        def __call__(self, c, x):
            return c + (x * self.param("w", ones, (2,))).sum(), x

    class Scan(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.scan(ScannedParam, variable_broadcast="params",
                           split_rngs={"params": False})()(jnp.zeros(()), x)[0]

    class InsideAfterOutside(nn.Module):       # a jit body starts from setup's names only
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(2, name="a")(x)
            return nn.jit(lambda m, x: nn.Dense(2, name="a")(x))(self, x)

    return {"one name in two collections": (OtherCollection, X),
            "a compact method called twice": (CalledTwice, X),
            "a helper method called from the compact method": (Helper, X),
            "sow twice": (SowTwice, X),
            "cond branches declaring one param": (BranchesDeclareOneParam, X),
            "scan body declaring a param": (Scan, jnp.ones((3, 2), jnp.float32)),
            "a name reused inside a jit body": (InsideAfterOutside, X)}


@pytest.mark.parametrize("name", list(_fine(vj_nn)))
def test_legal_definitions_still_work_as_in_linen(name):
    ours_cls, x = _fine(vj_nn)[name]
    theirs_cls, _ = _fine(flax_nn)[name]
    ours = ours_cls().init(KEY, x, mutable=True)
    theirs = theirs_cls().init(KEY, x, mutable=True)
    assert jax.tree.map(jnp.shape, ours) == jax.tree.map(jnp.shape, dict(theirs))


def test_bind_declares_from_outside_without_a_method():
    class Empty(vj_nn.Module):
        def __call__(self, x):
            return x

    bound = Empty().bind({}, rngs=KEY, mutable=True)
    assert bound.param("w", vj_nn.initializers.ones, (2,)).shape == (2,)
