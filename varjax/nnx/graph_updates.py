"""NNX's graph updates, and its tree mode's checks, desugared onto object mode.

Object mode (``varjax.objects``) carries Variable *values* through a transform: the function
runs on copies of the argument objects, and what it wrote to their Variables is written back
to the caller's.  flax.nnx's graph updates (``graph=True, graph_updates=True``, its default)
carry more: a structural change to an argument's object (a ``sow``, a new attribute holding a
Variable, array or module, a removed one, a changed static one) reaches the caller's object,
and an argument's object that the function returns, or that a new object holds, is the
caller's own object afterwards.  ``carrying(fn)`` is ``fn`` inside an object-mode transform
doing that bookkeeping, and ``finish`` applies it outside:

* inside, each argument object's one-level structure (its treedef and which children it
  holds) is taken before the call; after it, references to argument objects in the output
  and in the new attributes of the objects that changed become ``_Arg`` markers (pytrees
  without children whose static part is the object's place among the arguments), static
  values ``_Static`` ones, and the changed objects get their old attributes back, so object
  mode sees the arguments as it handed them in.  New Variables and modules come out as
  object mode's outputs do;
* outside, ``finish`` puts the caller's objects where the markers are and sets the changed
  objects' attributes in place.

The wrapper returns ``(out, changes)``; ``changes`` is ``()`` when nothing is to be done, so
a call whose structure does not change costs no extra output, and the check itself runs
once per trace (object mode caches traces per argument structure).

Without graph updates only Variable values come back, as in flax.nnx, and what flax.nnx
would lose silently is an error here: a structural change names the attribute
(``TransformError``); an argument's Variable among the outputs is refused with the
``ValueError`` flax.nnx raises (``InconsistentAliasError``).  Tree mode (``graph=False``)
also refuses a Variable reached at two places among the arguments, naming both paths.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable

import jax
import numpy as np

from varjax.ir import errors
from varjax.ir.caches import LRU
from varjax.nnx.filter_maps import FilterMap
from varjax.nnx.pytree import Dict, List, Pytree, check_pytree
from varjax.objects.graph import key_name, structure_changed
from varjax.objects.nodes import is_node

__all__ = ["carrying", "is_object", "entries_of_objects", "finish", "gathered", "given_back",
           "objects_with_paths", "per_object", "resolved", "restored", "shared_output"]


@dataclasses.dataclass(frozen=True)
class _Arg:
    """Stands, in a traced output, for the argument object at ``position`` (in
    ``objects_with_paths`` order): a pytree without children, so it costs no output."""

    position: int


@dataclasses.dataclass(frozen=True)
class _Static:
    """A non-array attribute value in a traced output (static: JAX outputs are arrays)."""

    value: Any


@dataclasses.dataclass(frozen=True)
class _Changes:
    """The changed argument objects: per object its place and new one-level treedef (static),
    and its new children (outputs)."""

    children: tuple
    places: tuple


@dataclasses.dataclass(frozen=True)
class _Same:
    """Stands, in a traced output, for the object with ``index`` (``_walk`` order) met again:
    JAX copies each place of an output separately, so a second place would come out as a
    second object."""

    index: int


@dataclasses.dataclass(frozen=True)
class _Shared:
    """A traced output holding ``_Same`` markers, for ``finish`` to make one object again."""

    tree: Any


@dataclasses.dataclass(frozen=True)
class _Changed:
    """One changed argument object's new children (outputs) and one-level treedef (static),
    at its place in ``per_object``'s tuple."""

    children: Any
    treedef: Any


jax.tree_util.register_pytree_node(_Changed, lambda c: ((c.children,), c.treedef),
                                   lambda treedef, kids: _Changed(kids[0], treedef))
jax.tree_util.register_pytree_node(_Arg, lambda m: ((), m.position), lambda p, _: _Arg(p))
jax.tree_util.register_pytree_node(_Same, lambda m: ((), m.index), lambda i, _: _Same(i))
jax.tree_util.register_pytree_node(_Shared, lambda s: ((s.tree,), None),
                                   lambda _, kids: _Shared(kids[0]))
jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda v, _: _Static(v))
jax.tree_util.register_pytree_node(_Changes, lambda c: (c.children, c.places),
                                   lambda places, children: _Changes(tuple(children), places))


def is_object(x: Any) -> bool:
    """An NNX object or an object-mode node (Variable, ``Rngs``): what the transforms
    track by identity."""
    return isinstance(x, Pytree) or is_node(x)


def objects_with_paths(tree: Any) -> list[tuple[tuple[str, ...], Any]]:
    """Every NNX object and object-mode node (Variable, ``Rngs``) in ``tree`` with its path,
    modules before their children, in tree order, each place once (an object at two places
    twice): the same list for the arguments outside a transform and their copies inside."""
    found: list[tuple[tuple[str, ...], Any]] = []

    def walk(t: Any, prefix: tuple[str, ...]) -> None:
        flat = jax.tree_util.tree_flatten_with_path(
            t, is_leaf=lambda y: y is not t and is_object(y))[0]
        for key_path, x in flat:
            if is_object(x):
                path = prefix + tuple(key_name(k) for k in key_path)
                found.append((path, x))
                if isinstance(x, Pytree):
                    walk(x, path)
    walk(tree, ())
    return found


def _one_level(obj: Any) -> tuple[list[Any], Any]:
    children, treedef = jax.tree_util.tree_flatten(obj, is_leaf=lambda x: x is not obj)
    return children, treedef


def _saved(obj: Any) -> dict[str, Any]:
    """``obj``'s attributes, containers copied one level (an ``nnx.List`` holds a list)."""
    return {k: type(v)(v) if type(v) in (list, dict, set) else v for k, v in obj.__dict__.items()}


def _attributes(treedef: Any, ids: list[int]) -> dict[Any, tuple]:
    """An object's attributes (a container's elements) from its one-level treedef and its
    children's ids: ``("data", id)`` or ``("static", value)`` per name."""
    kind, aux = treedef.node_data()
    if issubclass(kind, (List, Dict)):
        keys = [(k, data_, value) for k, data_, value in aux]
    else:
        names, statics = aux
        keys = [(n, True, None) for n in names] + [(n, False, v) for n, v in statics]
    kids = iter(ids)
    return {k: ("data", next(kids)) if data_ else ("static", value) for k, data_, value in keys}


def _walk(tree: Any, number: Callable[[Any], "int | _Same"],
          opaque: Callable[[Any], bool] = lambda x: False) -> Any:
    """``tree`` rebuilt with its objects numbered in tree order, modules before their
    children: ``number(x)`` gives an object met for the first time its number, or the
    ``_Same`` marker standing for one met before; a module is rebuilt one level at a time
    around its walked children, and a ``_Same(n)`` in ``tree`` becomes the rebuilt object
    numbered ``n``.  An ``opaque`` object (an argument's, which ``export`` makes an ``_Arg``)
    is left as it is.  ``_strip`` inside a transform and ``_restore`` outside walk an output
    in the same order, so their numbers agree."""
    made: dict[int, Any] = {}

    def one(x: Any) -> Any:
        if isinstance(x, _Same):
            return made[x.index]
        if not is_object(x) or opaque(x):
            return x
        n = number(x)
        if isinstance(n, _Same):
            return n
        if isinstance(x, Pytree):
            children, treedef = _one_level(x)
            x = treedef.unflatten([jax.tree.map(one, c, is_leaf=_marked) for c in children])
        made[n] = x
        return x
    return jax.tree.map(one, tree, is_leaf=_marked)


def _marked(x: Any) -> bool:
    return isinstance(x, _Same) or is_object(x)


def _strip(tree: Any, opaque: Callable[[Any], bool]) -> tuple[Any, bool]:
    """``tree`` with every object met a second time a ``_Same`` marker (so JAX's copy of it
    keeps one object per object); whether there was any."""
    seen: dict[int, int] = {}
    met = [0]

    def number(x: Any) -> int | _Same:
        met[0] += 1
        if id(x) in seen:
            return _Same(seen[id(x)])
        seen[id(x)] = len(seen)
        return seen[id(x)]
    stripped = _walk(tree, number, opaque)
    return stripped, met[0] > len(seen)


def _restore(tree: Any) -> Any:
    """JAX's copy of a ``_strip``ped tree with each ``_Same`` the one object it stands for."""
    count = itertools.count()
    return _walk(tree, lambda _: next(count))


def _show(path: tuple[str, ...]) -> str:
    return "/".join(path) or "the argument"


_NO_UPDATES = {"jit_partial", "make_jaxpr"}    # transforms flax.nnx runs without graph updates


class _Call:
    """One traced call of ``fn`` (see the module docstring)."""

    def __init__(self, what: str, args: tuple, kwargs: dict):
        self.what = what
        self.objects = objects_with_paths({"args": args, "kwargs": kwargs})
        self.position: dict[int, int] = {}
        for i, (_, x) in enumerate(self.objects):
            self.position.setdefault(id(x), i)
        self.before = []
        for i, (_, x) in enumerate(self.objects):
            if isinstance(x, Pytree) and self.position[id(x)] == i:
                children, treedef = _one_level(x)
                self.before.append((i, x, treedef, [id(c) for c in children], _saved(x)))

    def changed(self) -> list[tuple[int, Any, Any, list[Any]]]:
        """The argument objects whose structure changed, restored: ``(place, attributes
        before, new treedef, new children)``."""
        found = []
        for i, x, treedef, ids, saved in self.before:
            children, new = _one_level(x)
            if new != treedef or [id(c) for c in children] != ids:
                found.append((i, _attributes(treedef, ids), new, children))
                x.__dict__.clear()
                x.__dict__.update(saved)
                structure_changed()
        return found

    def export(self, tree: Any, statics: bool) -> tuple[Any, bool]:
        """``tree`` with argument objects as ``_Arg`` markers (and, with ``statics``, other
        non-array leaves as ``_Static``); whether a marker was placed."""
        placed = False

        def one(x: Any) -> Any:
            nonlocal placed
            p = self.position.get(id(x))
            if p is not None:
                placed = True
                return _Arg(p)
            if statics and not is_node(x) and not isinstance(x, (jax.Array, np.ndarray)):
                return _Static(x)
            return x
        out = jax.tree.map(one, tree, is_leaf=lambda x: id(x) in self.position or is_node(x))
        return out, placed

    def refuse_change(self, change: tuple[int, Any, Any, list[Any]]) -> None:
        """Without graph updates a structural change would be lost: ``TransformError``
        naming the attribute."""
        i, before, new, children = change
        path, obj = self.objects[i]
        after = _attributes(new, [id(c) for c in children])
        name = next(n for n in [*before, *after] if n not in before or n not in after
                    or not _equal(before[n], after[n]))
        how = "added" if name not in before else "removed" if name not in after else "changed"
        part = "element" if isinstance(obj, (List, Dict)) else "attribute"
        raise errors.TransformError(
            f"nnx.{self.what}: {part} {name!r} of {type(obj).__name__} {_show(path)} was {how} "
            "inside the function; without graph updates only Variable values come back, so "
            "this change would be lost (flax.nnx loses it silently).",
            path=path + (str(name),), **errors.where(),
            fix=f"make the change outside nnx.{self.what}"
                + ("" if self.what in _NO_UPDATES else ", or call it with graph=True and "
                   "graph_updates=True (the default)"))

    def refuse_returned(self, out: Any) -> None:
        """Without graph updates an argument's Variable among the outputs is refused, with
        the ``ValueError`` flax.nnx raises (its copy and the caller's would be two)."""
        given = {id(x): p for p, x in self.objects if is_node(x)}
        for path, x in objects_with_paths([out]):     # [out]: a bare Variable is one too
            path = path[1:]
            if is_node(x) and id(x) in given:
                raise errors.InconsistentAliasError(
                    f"nnx.{self.what}: {type(x).__name__} {_show(given[id(x)])} of the "
                    f"arguments is returned {'at output ' + _show(path) if path else 'as the output'}"
                    "; with graph_updates=False "
                    "an argument's Variable cannot be an output (flax.nnx refuses this Variable "
                    "aliasing too).", path=given[id(x)], **errors.where(),
                    fix="return arrays, or a copy made with nnx.clone()"
                        + ("" if self.what in _NO_UPDATES else
                           ", or call it with graph_updates=True"))

    def refuse_static_data(self) -> None:
        """Graph mode: a static attribute holding data (a Variable put in ``m.__dict__``
        bypassing assignment) is ``check_pytree``'s ``StaticDataError``, a ``ValueError``
        as flax.nnx raises; its updates would otherwise be lost.  Checked once per trace."""
        for _, x in self.objects:
            if isinstance(x, Pytree):
                check_pytree(x)

    def refuse_shared(self) -> None:
        """Tree mode: a Variable reached at two places among the arguments is refused, with
        the ``ValueError`` flax.nnx raises, naming both paths."""
        seen: dict[int, tuple[str, ...]] = {}
        for path, x in self.objects:
            if not is_node(x):
                continue
            if id(x) in seen:
                raise errors.InconsistentAliasError(
                    f"nnx.{self.what}: {type(x).__name__} is reached at {_show(seen[id(x)])} "
                    f"and at {_show(path)} of the arguments; tree mode (graph=False) takes "
                    "trees, without shared references (flax.nnx refuses this Variable "
                    "aliasing too).", path=path, **errors.where(),
                    fix="pass each Variable once (nnx.clone() makes a copy), or call it with "
                        "graph=True")
            seen[id(x)] = path


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:   # noqa: BLE001  (a static value without a boolean ==)
        return False


_CARRYING = LRU()    # (fn, what, graph, updates) -> the wrapper


def carrying(fn: Callable, what: str, graph: bool, updates: bool) -> Callable:
    """``fn`` returning ``(out, changes)`` for ``finish``, to run inside an object-mode
    transform (module docstring); one per ``(fn, what, graph, updates)``, so object mode's
    traces of it are cached across calls."""
    key = (fn, what, graph, updates)
    found = _CARRYING.get(key)
    if found is None:
        @functools.wraps(fn)
        def found(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
            call = _Call(what, args, kwargs)
            if not graph:
                call.refuse_shared()
            else:
                call.refuse_static_data()
            out = fn(*args, **kwargs)
            changed = call.changed()
            if not updates:
                if changed:
                    call.refuse_change(changed[0])
                call.refuse_returned(out)
                return shared_output(out, what, graph), ()
            out = shared_output(out, what, graph, lambda x: id(x) in call.position)
            out, placed = call.export(out, statics=False)
            if not changed and not placed:
                return out, ()
            children = tuple(call.export(kids, statics=True)[0] for _, _, _, kids in changed)
            return out, _Changes(children, tuple((i, new) for i, _, new, _ in changed))
        _CARRYING[key] = found
    return found


def shared_output(out: Any, what: str, graph: bool,
            opaque: Callable[[Any], bool] = lambda x: False) -> Any:
    """``out`` as it can cross JAX with what its objects share: as it is when they share
    nothing; in graph mode ``_Shared`` (``_strip``); in tree mode a refusal naming both
    places, as flax.nnx refuses it (``ValueError``)."""
    stripped, again = _strip(out, opaque)
    if not again:
        return out
    if not graph:
        seen: dict[int, tuple[str, ...]] = {}
        for path, x in objects_with_paths(out):
            if id(x) in seen:
                raise errors.InconsistentAliasError(
                    f"nnx.{what}: {type(x).__name__} is returned at {_show(seen[id(x)])} and "
                    f"at {_show(path)}; tree mode (graph=False) returns trees, without shared "
                    "references (flax.nnx refuses this aliasing too).", path=path,
                    **errors.where(), fix="return it once, or call it with graph=True")
            seen[id(x)] = path
    return _Shared(stripped)


def restored(out: Any) -> Any:
    """JAX's copy of a ``shared_output``, its objects shared again as they were inside."""
    return _restore(out.tree) if isinstance(out, _Shared) else out


def finish(args: tuple, kwargs: dict, out: Any, changes: Any) -> Any:
    """Outside the transform: ``out`` with the caller's objects of ``args``/``kwargs`` (as
    ``carrying``'s wrapper got them) where the markers are, and the changed objects'
    attributes set in place (``changes``: what the wrapper returned beside ``out``)."""
    out = restored(out)
    if not isinstance(changes, _Changes):
        return out
    objects = [x for _, x in objects_with_paths({"args": args, "kwargs": kwargs})]

    def resolve(tree: Any) -> Any:
        return jax.tree.map(lambda x: objects[x.position] if isinstance(x, _Arg)
                            else x.value if isinstance(x, _Static) else x, tree,
                            is_leaf=lambda x: isinstance(x, (_Arg, _Static)) or is_node(x))
    if isinstance(changes, _Changes):
        for (i, treedef), kids in zip(changes.places, changes.children):
            fresh = treedef.unflatten(resolve(kids))
            obj = objects[i]
            obj.__dict__.clear()
            obj.__dict__.update(fresh.__dict__)
            structure_changed()
    return resolve(out)


def per_object(carried: Callable) -> Callable:
    """``carried`` (a ``carrying`` wrapper) returning its changes as ``(per, placed)``: one
    entry per argument object (``objects_with_paths`` order; ``None`` where it did not
    change), and an empty ``_Changes`` when there is anything for ``finish`` to do (``None``
    when not: a call that changes nothing skips it).  ``jax.shard_map`` and ``jax.pmap``
    take their output prefix before tracing, when which objects change is not known; the
    tuple's length is, so each object's entry can be its argument's ``in_specs``/``in_axes``
    entry, and a changed module's new children come out as flax.nnx gives them back
    (sharded, stacked or once, as the module came in); ``placed`` has no leaves, so any
    entry covers it.  ``gathered`` turns the pair back into ``finish``'s changes."""
    @functools.wraps(carried)
    def spread(*args: Any, **kwargs: Any) -> tuple[Any, tuple]:
        out, changes = carried(*args, **kwargs)
        per: list[Any] = [None] * len(objects_with_paths({"args": args, "kwargs": kwargs}))
        if not isinstance(changes, _Changes):
            return out, (tuple(per), None)
        for (i, treedef), kids in zip(changes.places, changes.children):
            per[i] = _Changed(kids, treedef)
        return out, (tuple(per), _Changes((), ()))
    return spread


def gathered(spread: tuple) -> Any:
    """``per_object``'s changes as ``finish`` takes them."""
    per, placed = spread
    if placed is None:
        return ()
    changed = [(i, c) for i, c in enumerate(per) if c is not None]
    return _Changes(tuple(c.children for _, c in changed),
                    tuple((i, c.treedef) for i, c in changed))


def entries_of_objects(prefix: Any, tree: Any) -> dict[int, Any]:
    """The entry of the JAX prefix ``prefix`` covering each object of ``tree``, by id (an
    object at two places: its first's).  An object the prefix reaches one Variable at a
    time (an ``nnx.prefix`` tree over it) has none; a ``FilterMap`` entry covers its
    objects whole."""
    found: dict[int, Any] = {}

    def visit(entry: Any, sub: Any) -> None:
        for _, x in objects_with_paths([sub]):
            found.setdefault(id(x), entry)
    jax.tree.map(visit, prefix, tree, is_leaf=lambda x: x is None or isinstance(x, FilterMap))
    return found


def given_back(what: str, args: tuple, out: Any, in_axes: Any, out_axes: Any,
               updates: bool) -> Any:
    """Inside a mapped loop (``scan``'s stacked outputs): ``out`` with the argument objects
    it holds as ``_Arg`` markers, for ``resolved`` to make the caller's own outside, as
    flax.nnx gives them back.  flax.nnx does so only for an object that goes out along the
    axis it came in along (``in_axes``/``out_axes``: prefixes of ``args``/``out``); any
    other is the ``ValueError`` it raises (``InconsistentAliasError``).  Without graph
    updates an argument's Variable there is refused, as in ``carrying``."""
    call = _Call(what, args, {})
    if not updates:
        call.refuse_returned(out)
        return out
    given = {id(x): p for p, x in call.objects}
    returned = [(p, x) for p, x in objects_with_paths([out]) if id(x) in given]
    if not returned:
        return out
    ins, outs = entries_of_objects(in_axes, args), entries_of_objects(out_axes, out)
    for path, x in returned:
        came, goes = ins.get(id(x)), outs.get(id(x))
        if not (isinstance(came, int) and not isinstance(came, bool) and came == goes):
            raise errors.InconsistentAliasError(
                f"nnx.{what}: {type(x).__name__} {_show(given[id(x)])} of the arguments "
                f"comes in with axis {came!r} and is returned at output "
                f"{_show(path[1:])} with axis {goes!r}; an argument's object is given back "
                "only along the axis it is scanned along (flax.nnx refuses this aliasing "
                "too).", path=given[id(x)], **errors.where(),
                fix="return it at an output with its own axis, or return arrays")
    return call.export(out, statics=False)[0]


def resolved(args: tuple, out: Any) -> Any:
    """Outside: ``given_back``'s ``out`` with the caller's objects of ``args`` in place of
    the markers."""
    return finish(args, {}, out, _Changes((), ()))
