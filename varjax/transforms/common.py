"""What a lifted transform can be applied to, and helpers the built-ins share.

A target is a Module class (lifted methods on a ``{Transform}{Class}``
subclass, named as Linen names it), or a function -- a plain function using
``vj.param``/``vj.variable``, or one taking a module first (Linen's
convention, also how a decorated method receives ``self``).  Every built-in
transform turns its options into a ``vj.lift`` call; this file holds the
glue that is the same for all of them.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping, Sequence

import jax

from varjax.ir import axis_metadata, errors
from varjax.ir.protocols import LiftableModule, LiftableModuleClass
from varjax.lifting.groups import is_array
from varjax.lifting.region import is_module
from varjax.objects.nodes import is_node
from varjax.trace.context import active, site


def apply_to(target: Any, transform: str, make: Callable[[Callable], Callable],
             methods: Any = None, objects: Callable[[Callable], Callable] | None = None) -> Any:
    """``make(fn)`` wrapped for ``target``: a lifted subclass for a Module class
    (``protocols.LiftableModuleClass``) or a ``functools.partial`` of one, else a function
    calling the lift -- or, for a call in object mode (``object_call``), the object-mode
    transform ``objects(fn)``."""
    if isinstance(target, type) and getattr(target, "_varjax_module", False):
        module_class: LiftableModuleClass = target
        return module_class._varjax_lift_class(transform, lambda fn: lifted_function(make(fn), fn),
                                         methods)
    if isinstance(target, functools.partial) and isinstance(target.func, type) \
            and getattr(target.func, "_varjax_module", False):
        # a constructor with some fields given (``partial(nn.Dense, features=2)``): Linen
        # lifts the class and gives those fields to the lifted one
        lifted_class = apply_to(target.func, transform, make, methods, objects)
        return functools.partial(lifted_class, *target.args, **target.keywords)
    if not callable(target):
        raise TypeError(f"vj.{transform} needs a Module class or a function, got "
                        f"{type(target).__name__}")
    lifted = make(target)
    if objects is None:
        return lifted_function(lifted, target)
    in_objects: list[Callable] = []

    @errors.api_boundary
    def dual(*args: Any, **kwargs: Any) -> Any:
        # ``active() is None`` first: outside any trace (a train step's loop) the call is
        # object mode, decided without another call
        if active() is None or object_call(transform, args, kwargs):
            if not in_objects:
                in_objects.append(objects(target))
            return in_objects[0](*args, **kwargs)
        return lifted(*args, **kwargs)
    return marked_lifted(dual, target)


def lift_methods(target: Any, transform: str, methods: Mapping[str, Mapping[str, Any]],
                 lift_one: Callable[[Mapping[str, Any], list[str]], type]) -> type:
    """Linen's ``methods={name: {option: value}}``: each method of the class ``target``
    lifted with its own options, in place of the transform's other arguments, as in Linen
    (``lift_one(options, [name])`` is the transform called with them), in one
    ``{Transform}{Class}``."""
    if not (isinstance(target, type) and getattr(target, "_varjax_module", False)):
        raise TypeError(f"vj.{transform}: methods= as a dict of per-method options needs a "
                        f"Module class, got {type(target).__name__}")
    attrs = {}
    for name, options in methods.items():
        if not isinstance(options, Mapping):
            raise TypeError(f"vj.{transform}: methods['{name}'] must be a dict of "
                            f"{transform} options, got {type(options).__name__}")
        attrs[name] = vars(lift_one(options, [name]))[name]
    return type(transform.capitalize() + target.__name__, (target,), attrs)


class _NoInit:
    def __repr__(self) -> str:
        return "<not given>"


# The default of a Linen-signature argument whose absence selects JAX's object-mode form
# (``while_loop(cond, body, init_val)``, ``grad(fn)``).
NO_INIT = _NoInit()


def object_call(transform: str, args: tuple, kwargs: dict) -> bool:
    """Whether a transformed function is called in object mode (``notes/object-mode.md``):
    outside any trace, or with object nodes (bound modules, ``vj.Variable``s, ``vj.Rngs``)
    among its arguments -- unless its first argument is a module of the running
    ``init``/``apply`` (Linen's convention, the lifted form).  Such a module anywhere else
    is an error: neither form can take it there."""
    if active() is None:
        return True
    first = args[0] if args else None
    if is_module(first) and not is_node(first):
        return False
    for i, x in enumerate(args):
        if is_module(x) and not is_node(x) and x.scope is not None:
            raise errors.TransformError(
                f"vj.{transform}: argument {i} is module {x._label()} of the running "
                "init/apply; a lifted transform takes such a module as its first argument "
                "only, and an object-mode transform takes modules made by bind.",
                **site(about=x), fix="pass the module first, or close over it")
    return any(is_node(x) for x in jax.tree.leaves((args, kwargs), is_leaf=is_node))


def object_options(transform: str, make: Callable[[Callable], Callable],
                   **linen_only: tuple[Any, Any]) -> Callable[[Callable], Callable]:
    """``make``, or -- when a Linen-only option (``name=(value, default)``) is set -- a
    factory raising ``TransformError`` that names it, for an object-mode call."""
    given = [name for name, (value, default) in linen_only.items() if value is not default
             and value != default]
    if not given:
        return make

    def refuse(fn: Callable) -> Callable:
        raise errors.TransformError(
            f"vj.{transform} was called in object mode (outside any functionalized function, "
            f"or on objects) with Linen's option{'s' * (len(given) > 1)} {', '.join(given)}.",
            **site(), fix="Linen's options belong to the lifted form: call it inside a "
                          "functionalized function or module method; object mode takes JAX's "
                          "options (split the state with vj.split, one in_axes per group)")
    return refuse


def lifted_function(lift: Callable, target: Callable) -> Callable:
    """A plain function calling ``lift`` (a ``Lift``, or lifted transforms composed), so a
    class body can use it as a method (see ``marked_lifted``)."""
    def fn(*args: Any, **kwargs: Any) -> Any:
        return lift(*args, **kwargs)
    return marked_lifted(fn, target)


def marked_lifted(fn: Callable, target: Callable) -> Callable:
    """``fn`` named as ``target`` and marked, so a Module runs its setup inside the lifted
    body, not before it."""
    functools.update_wrapper(fn, target)
    fn.varjax_lifted = True
    return fn


def traced_numbers(tree: Any) -> Any:
    """``tree`` with its Python numbers made (weakly typed) JAX values, as a JAX transform
    traces them: ``lax.scan``'s carry, Linen ``remat``'s arguments not marked static.
    Modules and object nodes are left whole (flattening a bound one would read it)."""
    return jax.tree.map(lambda x: jax.numpy.asarray(x)
                        if isinstance(x, (bool, int, float, complex)) else x, tree,
                        is_leaf=lambda x: is_module(x) or is_node(x))


def unbound(fn: Callable) -> Callable:
    """A module's bound method as its function: Linen's direct forms (``cond``,
    ``while_loop``, ...) call each function with the module first, so
    ``nn.cond(p, self.f1, self.f2, self, x)`` runs ``f1(self, x)``, as in Linen."""
    if inspect.ismethod(fn) and is_module(fn.__self__):
        return fn.__func__
    return fn


def call_direct(lift: Callable, mdl: Any, *args: Any) -> Any:
    """Linen's direct form ``transform(fn, mdl, *args)``; ``mdl=None`` for a plain function.
    A ``bind`` module given outside ``init``/``apply`` has no trace to lift in: the call
    runs in the module's bound scope (``LiftableModule._varjax_run_eager``), as Linen's
    runs in its scope."""
    if mdl is None:
        return lift(*args)
    if active() is None and is_module(mdl):
        module: LiftableModule = mdl
        return module._varjax_run_eager(lift, args)
    return lift(mdl, *args)


def filter_items(mapping: Mapping[Any, Any] | None, what: str) -> list[tuple[Any, Any]]:
    """``variable_axes={'params': 0}`` / ``split_rngs={'params': True}`` as a list."""
    if mapping is None:
        return []
    if not isinstance(mapping, Mapping):
        raise TypeError(f"{what} must be a dict of collection filter -> value, got "
                        f"{type(mapping).__name__}")
    return list(mapping.items())


def split_keys(rngs: Sequence[dict], split: Sequence[bool], n: int) -> tuple[dict, ...]:
    """Each RNG group whose ``split`` flag is set, with every key split into ``n``."""
    return tuple({s: jax.random.split(k, n) for s, k in g.items()} if do else g
                 for g, do in zip(rngs, split))


def rng_groups(split_rngs: Mapping[Any, bool] | None) -> tuple[tuple, list[bool]]:
    """RNG filters and split flags: the ``split_rngs`` entries, then every other stream
    (broadcast, as in Linen)."""
    items = filter_items(split_rngs, "split_rngs")
    return tuple(f for f, _ in items) + (True,), [bool(v) for _, v in items] + [False]


def array_axes(axes: Any, args: tuple) -> tuple:
    """``in_axes`` as a full per-leaf tree over ``args``, with ``None`` for leaves that are
    not arrays (Python scalars, modules, None are broadcast, never mapped)."""
    if not isinstance(axes, (tuple, list)):
        axes = (axes,) * len(args)
    if len(axes) != len(args):
        raise ValueError(f"in_axes has {len(axes)} entries for {len(args)} arguments")

    def per_arg(ax: Any, arg: Any) -> Any:
        return jax.tree.map(lambda a, x: a if is_array(x) else None,
                            _broadcast_prefix(ax, arg), arg, is_leaf=lambda x: x is None)
    return tuple(per_arg(ax, arg) for ax, arg in zip(axes, args))


def _broadcast_prefix(prefix: Any, tree: Any) -> Any:
    if prefix is None or isinstance(prefix, int):
        return jax.tree.map(lambda _: prefix, tree)
    return jax.tree.map(lambda p, sub: jax.tree.map(lambda _: p, sub), prefix, tree,
                        is_leaf=lambda x: x is None or isinstance(x, int))


def has_axis(x: Any, axis: int | None, n: int | None) -> bool:
    """Whether ``x`` can be mapped or scanned along ``axis`` (``None``: not mapped) of size
    ``n`` (``None``: unknown)."""
    if axis is None or n is None:
        return True
    shapes = [jax.numpy.shape(leaf) for leaf in jax.tree.leaves(x)]   # a box: its value
    return all(-len(s) <= axis < len(s) and s[axis] == n for s in shapes)


def axis_names(groups: Sequence[Mapping], axes: Sequence[int | None],
               metadata_params: Mapping[str, Any] | None, add: bool) -> tuple[dict, ...]:
    """Linen's ``metadata_params``: the boxed variables (``nn.Partitioned``) of each group
    mapped along an axis gain (``add``, leaving the body) or lose (entering it) the
    partition name at that axis, so a kernel stacked by ``nn.scan`` reads
    ``('layers', 'embed', 'mlp')`` outside and ``('embed', 'mlp')`` inside."""
    change = axis_metadata.add_axis if add else axis_metadata.remove_axis
    params = dict(metadata_params or {})
    return tuple(dict(g) if ax is None else {k: change(v, ax, params) for k, v in g.items()}
                 for g, ax in zip(groups, axes))


def reject(condition: bool, transform: str, message: str, fix: str, key: Any = None) -> None:
    """Raise ``TransformError`` about ``key`` (collection, path) when ``condition`` holds."""
    if condition:
        collection, path = key if key is not None else (None, None)
        raise errors.TransformError(f"vj.{transform}: {message}", collection=collection,
                                    path=path, **site(), fix=fix)
