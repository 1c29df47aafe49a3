"""The lower layers' protocols (``varjax.ir.protocols``) hold for the objects above them.

``lifting``, ``transforms`` and the tracing layer never import ``Module``; they rely on
these contracts, so a rename on the nn side must fail here.
"""
import jax
import jax.numpy as jnp

import varjax.nn as nn
from varjax.ir import protocols


class Scale(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x * self.param("s", nn.initializers.ones, (x.shape[-1],))


def test_module_instance_is_labelled_and_marked_liftable():
    module = Scale()
    assert isinstance(module, protocols.Labelled)
    assert module._label() == "Scale (unbound)"
    assert type(module)._varjax_module is True
    for member in ("_varjax_bodies", "path"):
        assert hasattr(type(module), member)


def test_module_class_is_liftable():
    assert isinstance(Scale, protocols.LiftableModuleClass)
    lifted = Scale._varjax_lift_class("vmap", lambda fn: fn)
    assert lifted.__name__ == "VmapScale" and issubclass(lifted, Scale)


def test_bound_module_labels_itself_by_scope():
    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            inner = Scale(name="inner")
            labels.append(inner._label())
            return inner(x)

    labels: list[str] = []
    Outer().init(jax.random.key(0), jnp.ones(2))
    assert labels == ["Outer/inner (Scale)"]
