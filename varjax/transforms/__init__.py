"""The built-in lifted transforms, each a ``vj.lift`` call (see ``varjax.lifting.region``).

Exported from ``varjax`` and ``varjax.nn``; one file per family: ``batching``
(vmap, shard_map, pmap), ``loops`` (scan, remat_scan, while_loop, fori_loop),
``branches`` (cond, switch), ``calls`` (jit, remat, named_call, map_variables,
fold_rngs)
and ``autodiff`` (jvp, vjp, grad, value_and_grad, custom_vjp, custom_jvp).
``common`` is the glue they share.
"""
from varjax.transforms.autodiff import custom_jvp as custom_jvp
from varjax.transforms.autodiff import custom_vjp as custom_vjp
from varjax.transforms.autodiff import grad as grad
from varjax.transforms.autodiff import jvp as jvp
from varjax.transforms.autodiff import value_and_grad as value_and_grad
from varjax.transforms.autodiff import vjp as vjp
from varjax.transforms.batching import pmap as pmap
from varjax.transforms.batching import shard_map as shard_map
from varjax.transforms.batching import vmap as vmap
from varjax.transforms.branches import cond as cond
from varjax.transforms.branches import switch as switch
from varjax.transforms.calls import checkpoint as checkpoint
from varjax.transforms.calls import fold_rngs as fold_rngs
from varjax.transforms.calls import jit as jit
from varjax.transforms.calls import map_variables as map_variables
from varjax.transforms.calls import named_call as named_call
from varjax.transforms.calls import remat as remat
from varjax.transforms.loops import broadcast as broadcast
from varjax.transforms.loops import fori_loop as fori_loop
from varjax.transforms.loops import remat_scan as remat_scan
from varjax.transforms.loops import scan as scan
from varjax.transforms.loops import while_loop as while_loop

__all__ = ["broadcast", "checkpoint", "cond", "custom_jvp", "custom_vjp", "fold_rngs", "fori_loop",
           "grad", "jit", "jvp", "map_variables", "named_call", "pmap", "remat", "remat_scan",
           "scan", "shard_map", "switch", "value_and_grad", "vjp", "vmap", "while_loop"]
