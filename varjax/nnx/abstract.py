"""Abstract models with their shardings: ``as_abstract``, ``get_abstract_model`` (and the
deprecated ``abstract_with_sharding``), as flax.nnx's.

``nnx.eval_shape`` builds a model whose Variables hold ``jax.ShapeDtypeStruct``s without
allocating it.  To create the real one already sharded (``jax.jit(init, out_shardings=...)``)
each of those needs its ``NamedSharding``, which a Variable's ``out_sharding`` metadata says
(``varjax.nnx.spmd``).  flax.nnx puts it on while tracing (its eager sharding); varjax does
not, so ``as_abstract`` is where an abstract Variable gets it, from its ``mesh`` metadata or
the current abstract mesh.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, TypeVar

import jax
from jax.sharding import NamedSharding

from varjax.ir.typing import Node
from varjax.nnx.control import eval_shape
from varjax.nnx.graph import GraphDef, split
from varjax.nnx.spmd import get_named_sharding, get_partition_spec
from varjax.nnx.state_ops import map
from varjax.nnx.statelib import State
from varjax.trace.variable import Variable, held

__all__ = ["as_abstract", "abstract_with_sharding", "get_abstract_model"]

A = TypeVar("A")


def _with_sharding(_: tuple, x: Any) -> Any:
    if not isinstance(x, Variable):
        return x
    value, metadata = x.value, x.get_metadata()
    if (not hasattr(value, "shape") or not hasattr(value, "dtype")
            or getattr(value, "sharding", None) is not None
            or metadata.get("out_sharding") is None):
        return x
    mesh = metadata.get("mesh") or jax.sharding.get_abstract_mesh()
    sharding = NamedSharding(mesh, get_partition_spec(x).value)
    return held(type(x), x.collection, jax.ShapeDtypeStruct(value.shape, value.dtype,
                                                             sharding=sharding), metadata)


def as_abstract(tree: A, graph: bool | None = None) -> A:
    """``tree`` (an object from ``nnx.eval_shape``) with each abstract Variable that has
    ``out_sharding`` metadata and no sharding yet holding a ``ShapeDtypeStruct`` with its
    ``NamedSharding`` (on its ``mesh`` metadata, else the current abstract mesh)."""
    return map(_with_sharding, tree, graph=graph)


def abstract_with_sharding(tree: A, graph: bool | None = None) -> A:
    """``as_abstract`` under its old name (deprecated in flax.nnx, which warns too)."""
    warnings.warn("nnx.abstract_with_sharding is deprecated: use nnx.as_abstract",
                  DeprecationWarning, stacklevel=2)
    return as_abstract(tree, graph)


def get_abstract_model(init_fn: Callable[[], Node], mesh: jax.sharding.Mesh, *,
                       graph: bool | None = None) -> tuple[GraphDef, State]:
    """``(graphdef, abstract state)`` of the model ``init_fn`` builds, under ``mesh``: each
    leaf a ``ShapeDtypeStruct`` carrying its ``NamedSharding`` on ``mesh`` (from its
    ``out_sharding`` metadata; replicated without)."""
    with jax.set_mesh(mesh):
        g, abstract = split(eval_shape(init_fn, graph=graph), graph=graph)
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            abstract, get_named_sharding(abstract, mesh))
    return g, abstract
