"""Lifted ``jit``, ``remat`` (= ``checkpoint``), ``named_call``, ``map_variables`` and
``fold_rngs``: transforms that run the body once, as a call.

Every lifted call is already one ``jit`` equation in the IR (see
``varjax.lifting.region``); ``jit`` adds JAX's own options (static arguments,
donation) and ``remat`` wraps the region in ``jax.checkpoint``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np

from varjax.ir.typing import CollectionFilter, Passes, StreamFilter, Target
from varjax.lifting.groups import group_to_variables, is_array, partition, variables_to_group
from varjax.lifting.region import is_module, lift
from varjax.objects import object_transforms as objects
from varjax.trace.variable_api import is_initializing
from varjax.transforms.common import apply_to, object_options, reject, traced_numbers


def _positions(args: tuple, argnums: Sequence[int] | int, shift: int) -> tuple[int, ...]:
    """``argnums`` count the target's parameters, a module (``self``) first, as in Linen;
    the lifted call sees the ``args`` after the module (``shift`` is 1 when there is one).
    Positions past the arguments given (parameters left to their defaults) are ignored."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    at = {i + len(args) if i < 0 else i - shift for i in nums}
    return tuple(sorted(i for i in at if 0 <= i < len(args)))


class _Static:
    """An array argument marked static: hashable and not an array, so the lift passes it
    as a constant (non-array arguments are static anyway) and the body gets the concrete
    value back."""

    __slots__ = ("value", "key")

    def __init__(self, value: Any):
        v = np.asarray(value)
        self.value = value
        self.key = (v.dtype.str, v.shape, v.tobytes())

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Static) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


def _static(transform: str, value: Any, where: str) -> Any:
    if not is_array(value):
        return value
    reject(isinstance(value, jax.core.Tracer), transform, f"{where} is marked static but is a "
           "traced array: its value is not known while tracing.",
           "pass a Python or NumPy value, or drop it from the static arguments")
    return _Static(value)


def _unwrapping(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        return fn(*(a.value if isinstance(a, _Static) else a for a in args),
                  **{k: v.value if isinstance(v, _Static) else v for k, v in kwargs.items()})
    return body


def _with_static(transform: str, make: Callable[[int, Callable], Callable], fn: Callable,
                 static_argnums: Any, static_argnames: Any, trace_numbers: bool = False
                 ) -> Callable:
    """``make(shift, body)``'s lift, called with the static arguments made constants.
    ``shift`` is 1 when the call has a module first (Linen's argument positions count
    it), else 0; there is one lift per case.  ``trace_numbers``: Python numbers not marked
    static are traced (``remat``: in Linen they reach the body as tracers, and
    ``static_argnums`` is how a body gets a Python ``bool``)."""
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
    body = _unwrapping(fn)
    lifts: dict[int, Callable] = {}

    def call(*args: Any, **kwargs: Any) -> Any:
        shift = int(bool(args) and is_module(args[0]))
        head, args = args[:shift], list(args[shift:])
        static = _positions(tuple(args), static_argnums, shift)
        if trace_numbers:
            args = [a if i in static else traced_numbers(a) for i, a in enumerate(args)]
            kwargs = {k: v if k in names else traced_numbers(v) for k, v in kwargs.items()}
        for i in static:
            args[i] = _static(transform, args[i], f"argument {i + shift}")
        kwargs = {k: _static(transform, v, f"argument '{k}'") if k in names else v
                  for k, v in kwargs.items()}
        if shift not in lifts:
            lifts[shift] = make(shift, body)
        return lifts[shift](*head, *args, **kwargs)
    return call


def jit(target: Target, variables: CollectionFilter = True,
        rngs: StreamFilter = True,
        static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (), device: jax.Device | None = None,
        backend: str | None = None, methods: Sequence[str] | None = None,
        passes: Passes = ()) -> Target:
    """``jax.jit`` for stateful code, in either of its two forms.

    **Object mode** -- a function (``vj.jit(step)`` or ``@vj.jit``) called outside any
    module method or functionalized function: its arguments may be objects holding
    variables (a Linen module made by ``bind``, an object with ``vj.Variable`` attributes, a
    ``vj.Rngs``).  Their variables are traced inputs, and what the call writes to them
    (``batch_stats``, RNG counts, an optimizer's state) is written back to the objects
    after it::

        model = nn.Dense(3).bind(variables, rngs=vj.Rngs(dropout=1), mutable=True)
        step = vj.jit(lambda model, x: model(x))   # compiled once per argument structure
        y = step(model, x)

    Object mode takes ``static_argnums``, ``donate_argnums`` and ``passes``; a Linen-only
    option there is a ``TransformError``.

    **Linen's lifted form** -- called on a Module class (``vj.jit(nn.Dense)``) or inside a
    module method on a function whose first argument is the module, as ``nn.jit``:
    non-array arguments are static anyway (as in ``vj.functionalize``);
    ``static_argnums``/``argnames`` may mark more (NumPy values).  Argument positions count
    the module first, as in Linen.  ``variables``/``rngs`` choose the collections and
    streams the body sees; ``methods`` the methods a lifted class wraps.

    ``passes``: passes run on the body's IR (after those of the enclosing program,
    ``vj.lift``).  ``device``/``backend`` are deprecated in JAX and refused."""
    reject(device is not None or backend is not None, "jit", "device= and backend= are "
           "deprecated in JAX and not supported.", "place inputs with jax.device_put")

    def transform(shift: int, region: Callable, groups: tuple, rngs: tuple, *args: Any,
                  **kwargs: Any) -> Any:
        leaves, rebuild = partition((args, kwargs))
        # donated arguments -> positions of their array leaves after (groups, rngs)
        donated = set(_positions(args, donate_argnums, shift))
        owner = [i for i, a in enumerate(args) for x in jax.tree.leaves(a) if is_array(x)]
        donate = tuple(2 + j for j, i in enumerate(owner) if i in donated)

        def call(gs, ks, *arrays):
            a, kw = rebuild(arrays)
            return region(gs, ks, *a, **kw)
        return jax.jit(call, donate_argnums=donate)(groups, rngs, *leaves)

    return apply_to(target, "jit", lambda fn: _with_static("jit", lambda shift, body: lift(
        functools.partial(transform, shift), body, variables=(variables,), rngs=(rngs,),
        name="jit", fork_rngs=True, passes=passes), fn, static_argnums, static_argnames), methods,
        object_options(
            "jit", lambda fn: objects.jit(fn, static_argnums=static_argnums,
                                         donate_argnums=donate_argnums, passes=passes),
            variables=(variables, True), rngs=(rngs, True), static_argnames=(static_argnames, ())))


def checkpoint(target: Target, variables: CollectionFilter = True,
               rngs: StreamFilter = True, concrete: bool = False,
               prevent_cse: bool = True, static_argnums: int | Sequence[int] = (),
               policy: Callable[..., bool] | None = None, methods: Sequence[str] | None = None,
               passes: Passes = ()) -> Target:
    """Lifted ``jax.checkpoint``: the body's activations are recomputed on the backward
    pass.  As in Linen, Python numbers (positional or keyword) are traced unless
    ``static_argnums`` marks them (then the body gets the Python value); other non-array
    arguments are static, and ``static_argnums`` may mark NumPy values too.  Argument
    positions count the module first, as in Linen.  ``passes``: passes run on the body's
    IR, after those of the enclosing program (``vj.lift``)."""
    reject(concrete, "remat", "concrete=True is deprecated in JAX and not supported.",
           "mark the argument static with static_argnums")

    def transform(region: Callable, groups: tuple, rngs: tuple, *args: Any,
                  **kwargs: Any) -> Any:
        leaves, rebuild = partition((args, kwargs))

        def call(gs, ks, *arrays):
            a, kw = rebuild(arrays)
            return region(gs, ks, *a, **kw)
        return jax.checkpoint(call, prevent_cse=prevent_cse, policy=policy)(groups, rngs, *leaves)

    return apply_to(target, "checkpoint", lambda fn: _with_static(
        "remat", lambda shift, body: lift(transform, body, variables=(variables,), rngs=(rngs,),
                                          name="remat", passes=passes), fn, static_argnums, (),
        trace_numbers=True),
        methods,
        object_options("remat", lambda fn: objects.remat(
            fn, prevent_cse=prevent_cse, static_argnums=static_argnums, policy=policy,
            passes=passes),
            variables=(variables, True), rngs=(rngs, True)))


remat = checkpoint


def named_call(target: Target, name: str | None = None,
               methods: Sequence[str] | None = None) -> Target:
    """The body as one ``jit`` equation named ``name``, inside the transform's own
    equation: it shows under that name in the IR and in profiles (``jax.named_call``
    alone only extends the name stack).  The default name is Linen's: the module's name
    (else its class name), plus ``.method`` for a method other than ``__call__``; for a
    plain function, its name."""
    def transform(label: str, region: Callable, groups: tuple, rngs: tuple, *args: Any,
                  **kwargs: Any) -> Any:
        leaves, rebuild = partition((args, kwargs))

        def call(gs, ks, *arrays):
            a, kw = rebuild(arrays)
            return region(gs, ks, *a, **kw)
        call.__name__ = call.__qualname__ = label
        return jax.jit(call)(groups, rngs, *leaves)

    def make(fn: Callable) -> Callable:
        fn_name = getattr(fn, "__name__", "fn")
        lifts: dict[str, Callable] = {}

        def call(*args: Any, **kwargs: Any) -> Any:
            label = name
            if label is None and args and is_module(args[0]):
                module = args[0].name or type(args[0]).__name__
                label = module + ("" if fn_name == "__call__" else f".{fn_name}")
            label = label or fn_name
            if label not in lifts:
                lifts[label] = lift(functools.partial(transform, label), fn, name="named_call")
            return lifts[label](*args, **kwargs)
        return call

    return apply_to(target, "named_call", make, methods)


def fold_rngs(target: Target, variables: CollectionFilter = True,
              rngs: StreamFilter = True,
              methods: Sequence[str] | None = None) -> Target:
    """The body draws from one fresh key per stream, drawn once from the enclosing stream
    per call (Linen's ``nn.fold_rngs``).  Every lift does this; ``fold_rngs`` does only
    this, so it isolates the body's randomness: adding or removing draws inside it leaves
    the keys of every draw after it unchanged."""
    def transform(region: Callable, groups: tuple, rngs_: tuple, *args: Any, **kwargs: Any) -> Any:
        return region(groups, rngs_, *args, **kwargs)

    return apply_to(target, "fold_rngs", lambda fn: lift(
        transform, fn, variables=(variables,), rngs=(rngs,), name="fold_rngs",
        fork_rngs=True), methods)


def _identity(tree: Any) -> Any:
    return tree


def map_variables(target: Target, mapped_collections: CollectionFilter = True,
                  trans_in_fn: Callable[[Any], Any] = _identity,
                  trans_out_fn: Callable[[Any], Any] = _identity, init: bool = False,
                  mutable: bool = False, rngs: StreamFilter = True,
                  variables: CollectionFilter = True, methods: Sequence[str] | None = None,
                  passes: Passes = ()) -> Target:
    """Lifted variable mapping (Linen's ``nn.map_variables``): the body sees
    ``trans_in_fn(vars)`` of the mapped collections, as Linen's nested dict relative to
    the module; with ``mutable`` (or ``init``) what it writes is stored as
    ``trans_out_fn(vars)``.  With ``init``, variables missing at init are first created
    by running the body unmapped (the body is traced twice then).  ``passes``: passes run
    on the body's IR (``vj.lift``)."""
    def transform(region: Callable, groups: tuple, rngs_: tuple, *args: Any, **kwargs: Any) -> Any:
        mapped, rest = groups
        path = region.path
        if init and is_initializing():
            _, (mapped, rest) = region((mapped, rest), rngs_, *args, **kwargs)
        inner = variables_to_group(trans_in_fn(group_to_variables(mapped, path)), path)
        out, (mapped_out, rest_out) = region((inner, rest), rngs_, *args, **kwargs)
        if mutable or init:
            mapped_out = variables_to_group(trans_out_fn(group_to_variables(mapped_out, path)), path)
        else:
            changed = sorted(k for k, v in mapped_out.items() if k not in inner or v is not inner[k])
            reject(bool(changed), "map_variables", "the body writes a mapped variable "
                   f"({', '.join('/'.join(k[1]) for k in changed)}) but mutable=False.",
                   "pass mutable=True with a trans_out_fn", changed[0] if changed else None)
            mapped_out = mapped
        return out, (mapped_out, rest_out)

    return apply_to(target, "map_variables", lambda fn: lift(
        transform, fn, variables=(mapped_collections, variables), rngs=(rngs,),
        name="map_variables", passes=passes), methods)
