"""NNX's module helpers (``varjax/nnx/module_helpers.py``): ``view``, ``view_info``,
``with_attributes``, ``iter_module_children``, ``set_metadata``, ``display``,
``tabulate``, each against flax.nnx 0.12.8 on the same module written for both."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as fnnx

from varjax import errors, nnx
from varjax.nnx import module_helpers as mh

HELPERS = {nnx: mh, fnnx: fnnx}


def _classes(lib):
    class Noisy(lib.Module):
        def __init__(self, rngs):
            self.lin = lib.Linear(2, 2, rngs=rngs)
            self.noisy, self.scale = False, 1.0

        def set_view(self, noisy: bool | None = None, scale: float = 1.0):
            """Sets how the layer runs.

            Args:
              noisy: if True, adds noise.
                Off by default.
              scale: the output scale.

            Returns:
              nothing.
            """
            if noisy is not None:
                self.noisy = noisy
            self.scale = scale

    class Plain(lib.Module):
        def __init__(self):
            self.level = 0

        def set_view(self, level=None, **kwargs):
            if level is not None:
                self.level = level

    class Top(lib.Module):
        def __init__(self, rngs):
            self.a = Noisy(rngs)
            self.b = self.a                      # shared: copied once
            self.plain = Plain()
            self.layers = lib.List([Noisy(rngs)])
            self.drop = lib.Dropout(0.5, rngs=rngs)
    return Top, Noisy


@pytest.fixture(scope="module", params=[nnx, fnnx], ids=["varjax", "flax"])
def lib(request):
    return request.param


def _top(lib):
    top, noisy = _classes(lib)
    return top(lib.Rngs(0)), noisy


def test_view_gives_each_set_view_its_arguments_on_a_copy_as_flax_nnx(lib):
    top, _ = _top(lib)
    v = HELPERS[lib].view(top, noisy=True, scale=2.0, level=3)
    assert (v.a.noisy, v.a.scale, v.layers[0].noisy, v.plain.level) == (True, 2.0, True, 3)
    assert (top.a.noisy, top.a.scale, top.plain.level) == (False, 1.0, 0)
    assert v is not top and v.a is not top.a


def test_view_keeps_the_variables_and_the_sharing_as_flax_nnx(lib):
    top, _ = _top(lib)
    v = HELPERS[lib].view(top, noisy=True)
    assert v.b is v.a and v.a.lin.kernel is top.a.lin.kernel
    v.a.lin.bias[...] = jnp.ones(2)
    np.testing.assert_array_equal(top.a.lin.bias[...], jnp.ones(2))


def test_view_only_sets_the_modules_the_filter_selects_as_flax_nnx(lib):
    top, noisy = _top(lib)
    v = HELPERS[lib].view(top, only=noisy, noisy=True, level=5, raise_if_not_found=False)
    assert v.a.noisy is True and v.plain.level == 0


def test_view_with_an_argument_no_set_view_takes_raises_value_error(lib):
    top, noisy = _top(lib)
    with pytest.raises(ValueError, match="bogus") as e:
        HELPERS[lib].view(top, only=noisy, bogus=1)
    if lib is nnx:
        assert isinstance(e.value, errors.ConfigError)
        assert "test_nnx_module_helpers.py" in str(e.value)
    v = HELPERS[lib].view(top, only=noisy, bogus=1, noisy=True, raise_if_not_found=False)
    assert v.a.noisy is True


def test_view_info_is_flax_nnxs_text():
    """flax.nnx's Dropout has a set_view, varjax.nnx's not yet: the filter leaves it out."""
    ours, theirs = _top(nnx)[0], _top(fnnx)[0]
    text = mh.view_info(ours, only=lambda path, m: not isinstance(m, nnx.Dropout))
    assert text == fnnx.view_info(theirs, only=lambda path, m: not isinstance(m, fnnx.Dropout))
    assert text.startswith("_classes.<locals>.Noisy:\n  noisy: bool | None = None\n"
                           "    if True, adds noise.\n    Off by default.\n")
    assert text.endswith("_classes.<locals>.Plain:\n  set_view(self, level=None, **kwargs)")
    assert mh.view_info(ours, only=nnx.Linear) == fnnx.view_info(theirs, only=fnnx.Linear) == ""


def test_with_attributes_sets_a_copy_and_leaves_the_original_as_flax_nnx(lib):
    top, _ = _top(lib)
    w = HELPERS[lib].with_attributes(top, noisy=True, deterministic=True)
    assert (w.a.noisy, w.layers[0].noisy, w.drop.deterministic) == (True, True, True)
    assert (top.a.noisy, top.drop.deterministic) == (False, False)
    assert w.a.lin.kernel is top.a.lin.kernel and w.b is w.a
    with pytest.raises(ValueError, match="nope"):
        HELPERS[lib].with_attributes(top, nope=1)


def test_a_deterministic_copy_computes_what_flax_nnxs_does():
    outs = []
    for lib in (nnx, fnnx):
        top, _ = _top(lib)
        x = jnp.ones((1, 2))
        kept = HELPERS[lib].with_attributes(top, deterministic=True)
        outs.append((kept.drop(top.a.lin(x)), top.drop(top.a.lin(x))))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])   # no mask
    np.testing.assert_array_equal(outs[0][1], outs[1][1])   # the original still drops


def test_iter_module_children_lists_the_direct_modules_as_flax_nnx(lib):
    top, _ = _top(lib)
    got = [(k, type(c).__name__) for k, c in HELPERS[lib].iter_module_children(top)]
    assert got == [("a", "Noisy"), ("b", "Noisy"), ("drop", "Dropout"), ("layers", "List"),
                   ("plain", "Plain")]
    assert [k for k, _ in HELPERS[lib].iter_module_children(top.layers)] == [0]


def test_iter_module_children_of_an_array_raises():
    with pytest.raises(errors.ConfigError, match="got a ArrayImpl") as e:
        list(mh.iter_module_children(jnp.ones(2)))
    assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError):
        list(fnnx.iter_module_children(jnp.ones(2)))


def test_set_metadata_sets_the_selected_variables_metadata_in_place_as_flax_nnx(lib):
    top, _ = _top(lib)
    HELPERS[lib].set_metadata(top, only=lib.Param, differentiable=False)
    assert top.a.lin.kernel.get_metadata("differentiable") is False
    assert top.layers[0].lin.bias.get_metadata("differentiable") is False


def test_set_metadata_leaves_the_variables_the_filter_does_not_select():
    top, _ = _top(nnx)
    mh.set_metadata(top, only=nnx.PathContains("layers"), tag="inner")
    assert top.layers[0].lin.kernel.tag == "inner"
    assert not top.a.lin.kernel.has_metadata("tag")


def test_display_prints_each_object_as_flax_nnx_outside_a_notebook(capsys):
    layer = nnx.Linear(1, 1, rngs=nnx.Rngs(0))
    mh.display(layer, 3)
    assert capsys.readouterr().out == f"{layer!r}\n3\n"


def test_tabulate_raises_not_provided_naming_rich():
    with pytest.raises(errors.NotProvidedError, match="rich and yaml") as e:
        mh.tabulate(nnx.Linear(1, 1, rngs=nnx.Rngs(0)), jnp.ones((1, 1)))
    assert "test_nnx_module_helpers.py" in str(e.value)


def test_view_copies_modules_inside_a_plain_list_marked_data_as_flax_nnx(lib):
    _, noisy = _top(lib)

    class Holder(lib.Module):
        def __init__(self, rngs):
            self.blocks = lib.data([noisy(rngs), noisy(rngs)])
    holder = Holder(lib.Rngs(0))
    v = HELPERS[lib].view(holder, noisy=True)
    assert [b.noisy for b in v.blocks] == [True, True]
    assert [b.noisy for b in holder.blocks] == [False, False]
    assert v.blocks[1].lin.kernel is holder.blocks[1].lin.kernel
