"""lora: low-rank adapters on chosen kernels, trained while ``params`` stay frozen.

LoRA (Hu et al., 2021) fine-tunes a matrix ``W`` as ``W + scale * A @ B`` with ``A`` of shape
``(in, rank)`` and ``B`` of shape ``(rank, out)``, training only ``A`` and ``B``.  Written into
a model, that is a change to every layer class; written as a pass, the model's source does
not change: ``net.init(key, x, passes="lora{rank=4}")`` returns the adapters in a ``lora``
collection beside ``params``, and ``net.apply(variables, x, passes="lora{rank=4}")`` uses
them.  ``jax.grad`` with respect to ``variables['lora']`` alone trains only the adapters.

Which reads are adapted: a ``params`` read whose path matches ``targets`` (a regular
expression searched in ``Dense_0/kernel``) and whose value is an unbatched operand of a
``dot_general`` in the same jaxpr -- the kernel of a matmul -- possibly through dtype
casts.  Reading the consumer, not the name alone, gives the factorisation (the kernel's
contracted axes are ``in``, the others ``out``, so an attention kernel ``(embed, heads,
head_dim)`` gets ``A: (embed, r)`` and ``B: (r, heads * head_dim)``), and skips reads that
are not matmul operands: the stacked kernel a lifted ``nn.scan`` reads around its body is
adapted inside the body, per layer, where the body's own pipeline runs this pass.  A
kernel handed into a ``jit`` body (``jnp.einsum``, ``nn.Einsum``) is not adapted; the
counter ``lora.adapted`` in the pipeline statistics says how many reads were.

Each adapter is made by ``PassContext.in_module``: at the kernel's module
(``lora:Dense_0/kernel/a`` and ``.../b``), created in ``init`` and read in ``apply``.  ``A``
is drawn with ``lecun_normal`` from the ``params`` stream as that module's next draw, ``B``
is zeros, so the adapted model computes exactly what the base model does until trained.
``lifted_like`` makes the ``lora`` collection follow ``params`` through lifted transforms
(stacked by ``nn.scan``'s ``variable_axes={'params': 0}``, split keys included).

``merge(variables, ...)`` folds trained adapters into the kernels for inference: the
merged ``params`` without the pass compute what the adapted model computes with it.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Annotated, Any, Callable, Mapping

import jax
import jax.numpy as jnp

from varjax import _jax
from varjax.ir import errors, nested
from varjax.ir.primitives import Path, lift_of, var_get_p
from varjax.passes.framework.base import Pass, PassContext
from varjax.passes.framework.options import (
    AtLeast,
    Name,
    Regex,
    given_variables,
    program_variables,
    unmatched,
)
from varjax.passes.framework.rewrite import MovedCreations, Region, Rewriter, Rule
from varjax.trace.pass_scopes import declare

_CASTS = ("convert_element_type",)


@dataclasses.dataclass(frozen=True)
class Lora(Pass):
    """Adds trainable low-rank adapters ``scale * A @ B`` (collection ``collection``) to the
    matmul kernels whose path matches ``targets`` (``lora{rank=4}``)."""

    name = "lora"
    summary = "add scale * A @ B low-rank adapters (collection `collection`) to matmul kernels"
    # It creates variables and draws keys (lowered by lower-rng), and rewrites reads, which
    # forward-stores would otherwise have removed from init.  It finds a kernel by its read
    # feeding a matmul, so it runs before the passes that put code between the two; they
    # then change the frozen or quantized kernel read, and the adapters stay as they are.
    before = ("fake-quant", "stop-gradient", "cast-params", "lower-rng", "forward-stores",
              "discharge")
    rootable = True
    rank: Annotated[int, AtLeast(1)] = 4
    """The adapters' rank: ``A`` is ``(in, rank)``, ``B`` is ``(rank, out)``."""
    targets: Annotated[str, Regex()] = "kernel$"
    """A regular expression searched in a kernel's path (``Dense_0/kernel``): the kernels
    adapted."""
    scale: float = 1.0
    """The factor of the adapters' product added to the kernel."""
    collection: Annotated[str, Name()] = "lora"
    """The collection the adapters are created in (beside ``params``)."""

    def check(self) -> None:
        if self.collection == "params":   # A and B would sit under the kernel they adapt
            raise ValueError("collection must not be params: the adapters need their own")

    def lifted_like(self) -> Mapping[str, str]:
        return {self.collection: "params"}

    def run(self, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> _jax.ClosedJaxpr:
        targets = re.compile(self.targets)
        self._check_targets(targets, jaxpr, ctx)
        kernels = _matmul_kernels(jaxpr, self._targeted(targets))
        moved = MovedCreations(ctx.modules)
        if not kernels and not moved.pending():
            return jaxpr
        if kernels:
            ctx.count(self.name, "adapted", len(kernels))
        return Rewriter([_Adapt(self, ctx, kernels), moved]).run(jaxpr)

    def _check_targets(self, targets: re.Pattern, jaxpr: _jax.ClosedJaxpr, ctx: PassContext) -> None:
        """``targets`` must name some ``params`` variable of the program (a typo adapts
        nothing).  A program may adapt nothing with a good ``targets``: a method without
        matmuls, or one whose kernels are all in lifted bodies, which adapt their own."""
        if ctx.region or any(c == "params" and targets.search("/".join(p))
                             for c, p in given_variables(self, ctx)):
            return
        params = sorted("/".join(p) for c, p in program_variables(self, jaxpr, ctx) if c == "params")
        if not any(targets.search(p) for p in params):
            raise unmatched(self, f"targets={self.targets}", "matches no params variable",
                            "params variables", params)

    def _targeted(self, targets: re.Pattern) -> Callable[[Path], bool]:
        """Whether a ``params`` read at a program path is one ``targets`` names: searched in
        the path as the pass's options name it (``Pass.relative``), never outside its roots.
        The adapters are made at the kernel's module in the program, so under the root."""
        def targeted(path: Path) -> bool:
            named = self.relative(path)
            return named is not None and targets.search("/".join(named)) is not None
        return targeted


@dataclasses.dataclass(frozen=True)
class _Adapt(Rule):
    primitive = var_get_p
    lora: Lora
    ctx: PassContext = dataclasses.field(compare=False)
    kernels: Mapping[int, tuple[int, ...]] = dataclasses.field(compare=False)

    def match(self, eqn: _jax.JaxprEqn) -> bool:
        return id(eqn) in self.kernels

    def rewrite(self, eqn: _jax.JaxprEqn, invals: list, region: Region) -> list:
        (w,) = region.bind(eqn, invals)
        contracted = self.kernels[id(eqn)]
        n_in, n_out = factor(w.shape, contracted)
        kernel = eqn.params["path"][-1]
        spec, collection, rank = self.lora.spec(), self.lora.collection, self.lora.rank
        beside = (eqn.params["collection"], eqn.params["path"])
        with self.ctx.in_module(eqn):
            a = declare(spec, collection, (kernel, "a"), jax.nn.initializers.lecun_normal(),
                        (n_in, rank), w.dtype, eqn.source_info, beside)
            b = declare(spec, collection, (kernel, "b"), jax.nn.initializers.zeros,
                        (rank, n_out), w.dtype, eqn.source_info, beside)
        return [w + delta(a, b, w.shape, contracted, self.lora.scale).astype(w.dtype)]


def factor(shape: tuple[int, ...], contracted: tuple[int, ...]) -> tuple[int, int]:
    """``(in, out)``: the sizes of the kernel's contracted axes and of the others."""
    n_in = math.prod(shape[i] for i in contracted)
    return n_in, math.prod(shape) // n_in


def delta(a: jax.Array, b: jax.Array, shape: tuple[int, ...], contracted: tuple[int, ...],
          scale: float) -> jax.Array:
    """``scale * A @ B`` laid out as the kernel: contracted axes, then the others, moved
    back to the kernel's axis order."""
    free = [i for i in range(len(shape)) if i not in contracted]
    order = [*contracted, *free]
    d = (scale * (a @ b)).reshape([shape[i] for i in order])
    return jnp.transpose(d, [order.index(i) for i in range(len(shape))])


def _matmul_kernels(closed: _jax.ClosedJaxpr, targeted: Callable[[Path], bool]
                    ) -> dict[int, tuple[int, ...]]:
    """``id(var_get equation) -> contracted axes`` of each ``targeted`` ``params`` read used
    as an unbatched ``dot_general`` operand (directly or through casts), at any depth."""
    producer: dict[Any, _jax.JaxprEqn] = {}
    found: dict[int, tuple[int, ...]] = {}
    for eqn, _ in nested.walk_eqns(closed):
        for v in eqn.outvars:
            producer[v] = eqn
        if eqn.primitive.name != "dot_general":
            continue
        (contracting, batch) = eqn.params["dimension_numbers"]
        for operand, axes, batched in zip(eqn.invars, contracting, batch):
            read = _source_read(operand, producer)
            if read is None or batched or not targeted(read.params["path"]):
                continue
            found[id(read)] = tuple(sorted(axes))
    return found


def _source_read(v: Any, producer: Mapping[Any, _jax.JaxprEqn]) -> _jax.JaxprEqn | None:
    """The ``params`` read ``v`` comes from, through dtype casts; None otherwise."""
    while isinstance(v, _jax.Var) and v in producer:
        eqn = producer[v]
        if eqn.primitive is var_get_p:
            # A lift's boundary read feeds bodies that adapted their own reads of it.
            floating = jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.floating)
            ours = eqn.params["collection"] == "params" and lift_of(eqn) is None
            return eqn if ours and floating else None
        if eqn.primitive.name not in _CASTS:
            return None
        v = eqn.invars[0]
    return None


def merge(variables: Mapping[str, Any], *, scale: float = 1.0, collection: str = "lora",
          contracted: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    """``variables`` with each adapted kernel replaced by ``W + scale * A @ B`` and the
    ``collection`` of adapters dropped: apply without the pass then computes what apply
    with it did.  A kernel's contracted axes are its leading axes whose sizes multiply to
    ``A``'s rows (right for ``Dense`` and ``DenseGeneral``); ``contracted`` maps a kernel
    path (``'Dense_0/kernel'``) to them when they are not leading.  ``scale`` must be the
    pass's."""
    adapters = variables.get(collection)
    if adapters is None:
        raise errors.MissingVariableError(
            f"there is no '{collection}' collection to merge.", collection=collection,
            **errors.where(), fix="pass the variables that init/training returned with the lora pass")
    params = dict(variables["params"])
    for path, ab in _adapter_pairs(adapters):
        node = params
        for depth, name in enumerate(path):
            if not isinstance(node, Mapping) or name not in node:
                raise _no_kernel(collection, path, path[:depth], node)
            if depth < len(path) - 1:
                node[name] = dict(node[name])
                node = node[name]
        w = node[path[-1]]
        lead = ab["a"].ndim - 2          # layer axes a lifted nn.scan / nn.vmap stacked
        axes = _contracted(path, w.shape[lead:], ab["a"].shape[-2], contracted)
        fn = lambda a, b, w: delta(a, b, w.shape, axes, scale)  # noqa: E731
        for _ in range(lead):
            fn = jax.vmap(fn)
        node[path[-1]] = w + fn(ab["a"], ab["b"], w).astype(w.dtype)
    return {k: v for k, v in {**variables, "params": params}.items() if k != collection}


def _no_kernel(collection: str, path: tuple[str, ...], found: tuple[str, ...],
               node: Any) -> errors.MissingVariableError:
    """The error for an adapter whose kernel ``params`` lacks: ``found`` is the part of its
    path that exists, ``node`` what is there."""
    there = (", ".join(sorted(node)) or "nothing") if isinstance(node, Mapping) else \
        f"a {type(node).__name__}, not a scope"
    scope_ = errors.format_path(found) if found else "the top of params"
    return errors.MissingVariableError(
        f"lora.merge: the adapter {collection}:{errors.format_path(path)} adapts kernel "
        f"{errors.format_path(path)}, which params does not have (at {scope_} it has: "
        f"{there}).", collection="params", path=path, **errors.where(),
        fix="merge the adapters into the params of the model they were trained with "
            "(the variables init returned with the lora pass)")


def _contracted(path: tuple[str, ...], shape: tuple[int, ...], rows: int,
                contracted: Mapping[str, tuple[int, ...]] | None) -> tuple[int, ...]:
    """The kernel's contracted axes: as given, else its leading axes whose sizes multiply to
    ``A``'s rows (a ``Dense``/``DenseGeneral`` kernel is ``in_axes + out_axes``).  A given
    or inferred choice that does not fit ``A`` is an error, not a wrong kernel."""
    name = "/".join(path)
    given = (contracted or {}).get(name)
    if given is None:
        given = next((tuple(range(k)) for k in range(1, len(shape))
                      if math.prod(shape[:k]) == rows), None)
    if given is None or math.prod(shape[i] for i in given) != rows:
        raise errors.VariableShapeError(
            f"cannot merge the LoRA adapter of {name}: its A has {rows} rows, which "
            f"{'no leading axes' if given is None else f'axes {given}'} of the kernel's "
            f"shape {tuple(shape)} multiply to.", collection="params", path=path,
            **errors.where(), fix=f"pass contracted={{'{name}': <the kernel axes its matmul "
                                  "contracts>}} to merge")
    return given


def _adapter_pairs(tree: Mapping[str, Any], path: tuple[str, ...] = ()):
    """``(kernel path, {'a': A, 'b': B})`` for every adapter pair in a ``lora`` tree (an
    ``nn.scan``-stacked pair has a leading layer axis; ``delta`` maps over it)."""
    for name, node in tree.items():
        if isinstance(node, Mapping) and set(node) == {"a", "b"} and not isinstance(node["a"], Mapping):
            yield path + (name,), node
        elif isinstance(node, Mapping):
            yield from _adapter_pairs(node, path + (name,))
