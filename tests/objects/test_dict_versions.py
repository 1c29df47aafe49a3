"""A kept graph checks a module's ``__dict__`` by CPython's dict version tag
(``varjax/objects/dict_versions.py``) and compares its entries only when the tag moved;
where no tag can be read it compares them on every call, and sees the same changes."""
import sys

import jax.numpy as jnp
import pytest

from varjax import nnx
from varjax.objects import dict_versions
from varjax.objects import graph as graph_module

CPYTHON_WITH_TAGS = sys.implementation.name == "cpython" and (3, 11) <= sys.version_info < (3, 14)


class Holder:
    pass


@pytest.mark.skipif(not CPYTHON_WITH_TAGS, reason="the tag is CPython 3.11-3.13's")
def test_every_kind_of_change_to_an_instance_dict_moves_its_tag_and_reads_do_not():
    obj = Holder()
    obj.a, obj.b = 1, 2
    d = vars(obj)
    tag = dict_versions.version_reader(d)
    assert tag is not None
    changes = [lambda: setattr(obj, "a", 3), lambda: object.__setattr__(obj, "b", 4),
               lambda: d.__setitem__("c", 5), lambda: d.update(a=6), lambda: d.pop("c"),
               lambda: delattr(obj, "b"), lambda: d.setdefault("e", 7), lambda: d.clear()]
    for change in changes:
        before = tag.value
        _ = (obj.__dict__, dict(d), len(d), getattr(obj, "a", None))
        assert tag.value == before
        change()
        assert tag.value != before


class Scale(nnx.Module):
    def __init__(self, value):
        self.w = nnx.Param(jnp.array(value))
        self.count = nnx.BatchStat(jnp.array(0.0))

    def __call__(self, x):
        self.count[...] += 1.0
        return x * self.w[...]


def _step():
    return nnx.jit(lambda m, x: m(x))


def test_a_kept_call_on_an_unchanged_module_compares_no_dict_entries(monkeypatch):
    if dict_versions.version_reader({}) is None:
        pytest.skip("no dict version tags on this Python")
    m, step, x = Scale(2.0), _step(), jnp.ones(())
    step(m, x)
    compared = []
    same = graph_module._Containers.same_mappings
    monkeypatch.setattr(graph_module._Containers, "same_mappings",
                        lambda self: compared.append(self) or same(self))
    step(m, x)
    assert compared == []
    w = m.w
    m.w = nnx.Param(jnp.array(5.0))
    m.w = w                                # changed and changed back: still the same
    assert float(step(m, x)) == 2.0
    assert len(compared) == 1
    step(m, x)
    assert len(compared) == 1              # the moved tags were taken as the new ones
    assert float(m.count[...]) == 4.0


@pytest.mark.parametrize("tags", ["with_tags", "without_tags"])
@pytest.mark.parametrize("change", ["object_setattr", "dict_write", "setattr"])
def test_a_bypassing_write_is_seen_by_the_next_kept_call_every_time(monkeypatch, change, tags):
    """Repeated, so CPython's specialised attribute stores run too."""
    if tags == "without_tags":
        monkeypatch.setattr(dict_versions, "_AVAILABLE", False)
    m, step, x = Scale(2.0), _step(), jnp.ones(())
    assert float(step(m, x)) == 2.0
    write = {"object_setattr": lambda new: object.__setattr__(m, "w", new),
             "dict_write": lambda new: m.__dict__.__setitem__("w", new),
             "setattr": lambda new: setattr(m, "w", new)}[change]
    for i in range(3, 23):
        write(nnx.Param(jnp.array(float(i))))
        assert float(step(m, x)) == float(i)
    assert float(m.count[...]) == 21.0
