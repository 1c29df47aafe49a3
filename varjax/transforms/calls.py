"""Lifted ``jit``, ``remat`` (= ``checkpoint``), ``named_call`` and ``map_variables``:
transforms that run the body once, as a call.

Every lifted call is already one ``jit`` equation in the IR (see
``varjax.lifting``); ``jit`` adds JAX's own options (static arguments,
donation) and ``remat`` wraps the region in ``jax.checkpoint``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from varjax.lifting import from_tree, lift, partition, to_tree
from varjax.scope import is_initializing
from varjax.transforms.target import apply_to, reject


def _static_positions(args: tuple, argnums: Sequence[int] | int) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    return tuple(sorted({i % len(args) for i in nums} if args else set()))


def jit(target: Any, variables: Any = True, rngs: Any = True, static_argnums: Any = (),
        static_argnames: Any = (), donate_argnums: Any = (), device: Any = None,
        backend: Any = None, methods: Any = None) -> Any:
    """Lifted ``jax.jit``.  Non-array arguments are static anyway (as in
    ``vj.functionalize``); ``static_argnums``/``argnames`` may mark more."""
    reject(device is not None or backend is not None, "jit", "device= and backend= are "
           "deprecated in JAX and not supported.", "place inputs with jax.device_put")

    def transform(region: Callable, groups: tuple, rngs: tuple, *args: Any, **kwargs: Any) -> Any:
        static = set(_static_positions(args, static_argnums))
        dynamic = [i for i in range(len(args)) if i not in static]
        leaves, rebuild = partition(tuple(args[i] for i in dynamic))
        fixed = {i: args[i] for i in static}
        names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        fixed_kw = {k: v for k, v in kwargs.items() if k in names}
        dyn_kw, rebuild_kw = partition(({k: v for k, v in kwargs.items() if k not in names},))
        donate = tuple(2 + dynamic.index(i) for i in _static_positions(args, donate_argnums)
                       if i in dynamic)

        def call(gs, ks, *arrays):
            dyn = rebuild(arrays[:len(leaves)])
            full = [fixed[i] if i in fixed else dyn[dynamic.index(i)] for i in range(len(args))]
            (kw,) = rebuild_kw(arrays[len(leaves):])
            return region(gs, ks, *full, **kw, **fixed_kw)
        return jax.jit(call, donate_argnums=donate)(groups, rngs, *leaves, *dyn_kw)

    return apply_to(target, "jit", lambda fn: lift(
        transform, fn, variables=(variables,), rngs=(rngs,), name="jit"), methods)


def checkpoint(target: Any, variables: Any = True, rngs: Any = True, concrete: bool = False,
               prevent_cse: bool = True, static_argnums: Any = (), policy: Any = None,
               methods: Any = None) -> Any:
    """Lifted ``jax.checkpoint``: the body's activations are recomputed on the backward
    pass.  Non-array arguments are static; ``static_argnums`` may mark more."""
    reject(concrete, "remat", "concrete=True is deprecated in JAX and not supported.",
           "mark the argument static with static_argnums")

    def transform(region: Callable, groups: tuple, rngs: tuple, *args: Any, **kwargs: Any) -> Any:
        static = set(_static_positions(args, static_argnums))
        leaves, rebuild = partition((tuple(None if i in static else a for i, a in enumerate(args)),
                                     kwargs))

        def call(gs, ks, *arrays):
            a, kw = rebuild(arrays)
            full = [args[i] if i in static else x for i, x in enumerate(a)]
            return region(gs, ks, *full, **kw)
        return jax.checkpoint(call, prevent_cse=prevent_cse, policy=policy)(groups, rngs, *leaves)

    return apply_to(target, "checkpoint", lambda fn: lift(
        transform, fn, variables=(variables,), rngs=(rngs,), name="remat"), methods)


remat = checkpoint


def named_call(target: Any, name: str | None = None, methods: Any = None) -> Any:
    """The body as one named ``jit`` equation (``jax.named_call``): it shows in the IR
    and in profiles under ``name`` (default: the function's name)."""
    def transform(region: Callable, groups: tuple, rngs: tuple, *args: Any, **kwargs: Any) -> Any:
        leaves, rebuild = partition((args, kwargs))

        def call(gs, ks, *arrays):
            a, kw = rebuild(arrays)
            return region(gs, ks, *a, **kw)
        return jax.named_call(call, name=name or region.__name__)(groups, rngs, *leaves)

    return apply_to(target, "named_call", lambda fn: lift(
        transform, fn, name="named_call"), methods)


def _identity(tree: Any) -> Any:
    return tree


def map_variables(target: Any, mapped_collections: Any = True,
                  trans_in_fn: Callable[[Any], Any] = _identity,
                  trans_out_fn: Callable[[Any], Any] = _identity, init: bool = False,
                  mutable: bool = False, rngs: Any = True, variables: Any = True,
                  methods: Any = None) -> Any:
    """Lifted variable mapping (Linen's ``nn.map_variables``): the body sees
    ``trans_in_fn(vars)`` of the mapped collections, as Linen's nested dict relative to
    the module; with ``mutable`` (or ``init``) what it writes is stored as
    ``trans_out_fn(vars)``.  With ``init``, variables missing at init are first created
    by running the body unmapped (the body is traced twice then)."""
    def transform(region: Callable, groups: tuple, rngs_: tuple, *args: Any, **kwargs: Any) -> Any:
        mapped, rest = groups
        path = region.path
        if init and is_initializing():
            _, (mapped, rest) = region((mapped, rest), rngs_, *args, **kwargs)
        inner = from_tree(trans_in_fn(to_tree(mapped, path)), path)
        out, (mapped_out, rest_out) = region((inner, rest), rngs_, *args, **kwargs)
        if mutable or init:
            mapped_out = from_tree(trans_out_fn(to_tree(mapped_out, path)), path)
        else:
            changed = sorted(k for k, v in mapped_out.items() if k not in inner or v is not inner[k])
            reject(bool(changed), "map_variables", "the body writes a mapped variable "
                   f"({', '.join('/'.join(k[1]) for k in changed)}) but mutable=False.",
                   "pass mutable=True with a trans_out_fn", changed[0] if changed else None)
            mapped_out = mapped
        return out, (mapped_out, rest_out)

    return apply_to(target, "map_variables", lambda fn: lift(
        transform, fn, variables=(mapped_collections, variables), rngs=(rngs,),
        name="map_variables"), methods)
