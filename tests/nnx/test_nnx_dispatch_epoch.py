"""A kept ``nnx.jit`` call (object mode's ``ArgumentGraphs``) never reuses a stale graph:
whatever changes a module's structure between two calls -- NNX's own methods, varjax's
rewrites, or Python bypassing them (``object.__setattr__``, ``m.__dict__[k] = v``) -- the
next call sees the new structure, as flax.nnx's does, in graph and in tree mode.

The private containers of NNX objects (a ``List``'s elements, the set of data names, a
``State``'s mapping) are compared only after ``structure_changed`` (the epoch their
methods bump); an object's ``__dict__``, which Python writes without varjax, is compared
on every call.  Each case runs the same step on a varjax model and a flax.nnx one, changes
both the same way between two calls, and compares outputs and every Variable."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx as flax_nnx

import varjax as vj
from varjax import nnx as vnnx
from varjax.nnx.transforms import jit
from varjax.objects import graph as graph_module

LIBS = {"varjax": vnnx, "flax": flax_nnx}
MODES = {"graph": {}, "tree": {"graph": False}}


def _classes(nnx):
    class Sub(nnx.Module):
        def __init__(self, w):
            self.w = nnx.Param(jnp.full((), w))

    class Net(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(jnp.full((), 1.0))
            self.layers = nnx.List([Sub(2.0), Sub(3.0)])
            self.d = nnx.Dict(x=Sub(4.0))
            self.scale = 2
            self.deterministic = False
    return Sub, Net


CLASSES = {name: _classes(nnx) for name, nnx in LIBS.items()}


def _step_of(nnx):
    def step(m):
        """Adds 1 to every Variable; the sum of the leaves before, by static attributes."""
        variables = jax.tree.leaves(m, is_leaf=lambda x: isinstance(x, nnx.Variable))
        total = sum(jnp.sum(v[...] if isinstance(v, nnx.Variable) else v) for v in variables)
        for v in variables:
            if isinstance(v, nnx.Variable):
                v[...] += 1
        return total * m.scale + (100.0 if m.deterministic else 0.0)
    return step


# One jitted step per library and mode, shared by every case: a structure is compiled once.
STEPS = {(lib, mode): LIBS[lib].jit(_step_of(LIBS[lib]), **MODES[mode])
         for lib in LIBS for mode in MODES}


def _values(nnx, m):
    return [np.asarray(v[...]) for v in jax.tree.leaves(
        m, is_leaf=lambda x: isinstance(x, nnx.Variable)) if isinstance(v, nnx.Variable)]


def _run(lib, step, change):
    nnx = LIBS[lib]
    sub, net = CLASSES[lib]
    m = net()
    first = step(m)
    change(nnx, sub, m)
    second = step(m)
    return float(first), float(second), _values(nnx, m)


def _same(ours, theirs):
    assert ours[:2] == theirs[:2]
    assert len(ours[2]) == len(theirs[2])
    for a, b in zip(ours[2], theirs[2]):
        np.testing.assert_array_equal(a, b)


def _same_as_flax(change, mode, flax=True):
    """Runs step, ``change``, step: the kept varjax call against the same step run eagerly
    (no graph to keep) and, with ``flax``, against flax.nnx's ``nnx.jit``."""
    ours = _run("varjax", STEPS["varjax", mode], change)
    _same(ours, _run("varjax", _step_of(vnnx), change))
    if flax:
        _same(ours, _run("flax", STEPS["flax", mode], change))


def _param(nnx, value):
    return nnx.Param(jnp.full((), value))


CHANGES = {
    "a_new_variable_attribute": lambda nnx, sub, m: setattr(m, "b", _param(nnx, 10.0)),
    "a_new_submodule": lambda nnx, sub, m: setattr(m, "s", sub(20.0)),
    "a_new_array_attribute": lambda nnx, sub, m: setattr(m, "arr", jnp.full((), 30.0)),
    "a_deleted_attribute": lambda nnx, sub, m: delattr(m, "a"),
    "a_variable_replaced_by_an_equal_one": lambda nnx, sub, m: setattr(m, "a", _param(nnx, 2.0)),
    "a_submodule_variable_replaced": lambda nnx, sub, m: setattr(m.layers[0], "w",
                                                                 _param(nnx, 7.0)),
    "list_append": lambda nnx, sub, m: m.layers.append(sub(5.0)),
    "list_insert": lambda nnx, sub, m: m.layers.insert(0, sub(5.0)),
    "list_pop": lambda nnx, sub, m: m.layers.pop(),
    "list_setitem": lambda nnx, sub, m: m.layers.__setitem__(1, sub(6.0)),
    "list_delitem": lambda nnx, sub, m: m.layers.__delitem__(0),
    "list_delitem_of_the_last": lambda nnx, sub, m: m.layers.__delitem__(-1),
    "dict_set": lambda nnx, sub, m: m.d.__setitem__("y", sub(8.0)),
    "dict_replace": lambda nnx, sub, m: m.d.__setitem__("x", sub(9.0)),
    "dict_del": lambda nnx, sub, m: m.d.__delitem__("x"),
    "a_static_attribute": lambda nnx, sub, m: setattr(m, "scale", 3),
    "eval": lambda nnx, sub, m: m.eval(),
    "set_attributes": lambda nnx, sub, m: m.set_attributes(scale=5),
    "object_setattr_replacing_a_variable": lambda nnx, sub, m: object.__setattr__(
        m, "a", _param(nnx, 2.0)),
    "object_setattr_in_a_submodule": lambda nnx, sub, m: object.__setattr__(
        m.d["x"], "w", _param(nnx, 11.0)),
    "dict_write_replacing_a_variable": lambda nnx, sub, m: m.__dict__.__setitem__(
        "a", _param(nnx, 2.0)),
    "vars_update_replacing_a_submodule": lambda nnx, sub, m: vars(m.layers[1]).update(
        w=_param(nnx, 12.0)),
    "object_setattr_of_a_static_attribute": lambda nnx, sub, m: object.__setattr__(
        m, "scale", 4),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("change", CHANGES)
def test_a_change_between_kept_calls_is_seen_as_flax_nnx_sees_it(change, mode):
    _same_as_flax(CHANGES[change], mode, flax=change not in FLAX_DIFFERS)


# flax.nnx 0.12.8's List.__delitem__ shifts the elements down and leaves the last one's
# attribute behind: its next call sees a stale element (graph mode) or a duplicate
# Variable (tree mode's ValueError).  The kept varjax call is compared with the eager one.
FLAX_DIFFERS = {"list_delitem"}


def _update_from_another(nnx, sub, m):
    other = CLASSES["varjax" if nnx is vnnx else "flax"][1]()
    nnx.update(m, jax.tree.map(lambda v: v * 10, nnx.state(other)))


def _pop_intermediates(nnx, sub, m):
    nnx.pop(m, nnx.Intermediate)


def test_values_written_by_nnx_update_are_read_by_the_next_kept_call():
    _same_as_flax(_update_from_another, "graph")


def test_a_variable_removed_by_nnx_pop_is_gone_from_the_next_kept_call():
    seen = {}
    for lib, nnx in LIBS.items():
        m = CLASSES[lib][1]()
        m.i = nnx.Intermediate(jnp.full((), 50.0))
        step = STEPS[lib, "graph"]
        seen[lib] = [float(step(m))]
        _pop_intermediates(nnx, None, m)
        seen[lib] += [float(step(m)), *map(float, _values(nnx, m))]
    assert seen["varjax"] == seen["flax"]


def test_a_static_attribute_made_data_in_place_is_seen():
    """``m.x = nnx.data(m.x)`` keeps ``m.__dict__``'s values: only the set of data names
    changes, a private container compared after the epoch moved."""
    m = CLASSES["varjax"][1]()
    m.arr = vnnx.static(np.float32(3.0))
    step = STEPS["varjax", "graph"]
    first = float(step(m))
    m.arr = vnnx.data(m.arr)
    assert float(step(m)) == first + 2 * (4 + 3.0)     # the Variables moved by 1 each


def test_graph_updates_made_inside_a_kept_call_reach_the_next_call():
    """The function adds an attribute (graph updates write it into the caller's module):
    the next call sees it, as flax.nnx's does."""
    seen = {}
    for lib, nnx in LIBS.items():
        def grow(m, nnx=nnx):
            if not hasattr(m, "extra"):
                m.extra = nnx.Param(jnp.full((), 40.0))
            return sum(jnp.sum(v[...]) for v in jax.tree.leaves(
                m, is_leaf=lambda x: isinstance(x, nnx.Variable)))
        step = nnx.jit(grow)
        m = CLASSES[lib][1]()
        seen[lib] = [float(step(m)), float(step(m)), float(m.extra[...])]
    assert seen["varjax"] == seen["flax"]


def test_a_call_after_no_change_compares_no_private_container(monkeypatch):
    m = CLASSES["varjax"][1]()
    step = jit(_step_of(vnnx))
    step(m)
    step(m)
    compared = []
    unchanged = graph_module._Containers.unchanged

    def counted(self):
        compared.append(self)
        return unchanged(self)
    monkeypatch.setattr(graph_module._Containers, "unchanged", counted)
    step(m)
    assert len(compared) == 1        # the objects' __dict__s, not their private containers
    private = m.layers._list
    m.layers.append(CLASSES["varjax"][0](5.0))
    step(m)
    assert len(compared) == 2        # after List.append the private ones, found changed
    assert any(seq is private for seq, _, _ in compared[1].sequences)


def test_a_list_of_variables_changed_in_place_is_seen_by_object_mode():
    """A plain list (no varjax code runs when it changes) is compared on every call."""
    @vj.jit
    def total(vs):
        return sum(v.value for v in vs)
    vs = [vnnx.Param(jnp.full((), 1.0)), vnnx.Param(jnp.full((), 2.0))]
    assert float(total(vs)) == 3.0
    vs.append(vnnx.Param(jnp.full((), 4.0)))
    assert float(total(vs)) == 7.0
    vs[0] = vnnx.Param(jnp.full((), 8.0))
    assert float(total(vs)) == 14.0


@pytest.mark.parametrize("lib", LIBS)
def test_a_variable_put_in_dict_under_a_new_name_is_refused_in_graph_mode(lib):
    """``m.__dict__['z'] = Param(...)`` adds no data name: the Variable is a static
    attribute, whose updates would be lost.  Graph mode refuses it with a ValueError, as
    flax.nnx does (varjax: ``StaticDataError`` naming it); tree mode ignores it in both."""
    nnx = LIBS[lib]
    m = CLASSES[lib][1]()
    step = STEPS[lib, "graph"]
    step(m)
    m.__dict__["z"] = _param(nnx, 3.0)
    with pytest.raises(ValueError) as caught:
        step(m)
    if lib == "varjax":
        assert "attribute 'z' of Net is static" in str(caught.value)
    total = float(sum(_values(nnx, m)))       # z not among them
    assert float(STEPS[lib, "tree"](m)) == 2 * total
