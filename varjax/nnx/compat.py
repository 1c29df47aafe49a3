"""``nnx.compat``: NNX's functions with graph mode and graph updates on, whatever the
current settings (the Tree Mode note's porting path: ``nnx.jit`` -> ``nnx.compat.jit``).

Each name is the ``varjax.nnx`` function with ``graph=True`` (and, where it takes one,
``graph_updates=True``) given, so code written for graph mode keeps its meaning after
``nnx.set_graph_mode(False)``.
"""
from __future__ import annotations

import functools

from varjax.nnx import (
    abstract,
    batching,
    compilation,
    control,
    differentiation,
    graph,
    iteration,
    module,
    module_helpers,
    rnglib,
    sharding_transforms,
    state_ops,
    transforms,
)

__all__ = [
    "split", "state", "clone", "graphdef", "flatten", "iter_graph", "recursive_map",
    "cached_partial", "view", "view_info", "iter_modules", "iter_children", "split_rngs",
    "fork_rngs", "reseed", "backup_keys", "jit", "shard_map", "grad", "value_and_grad",
    "custom_vjp", "vjp", "jvp", "remat", "vmap", "scan", "pmap", "while_loop", "fori_loop",
    "eval_shape", "cond", "switch", "checkify", "get_abstract_model",
]

_GRAPH = {"graph": True}
_UPDATES = {"graph": True, "graph_updates": True}

split = functools.partial(graph.split, **_GRAPH)
state = functools.partial(graph.state, **_GRAPH)
clone = functools.partial(graph.clone, **_GRAPH)
graphdef = functools.partial(graph.graphdef, **_GRAPH)
flatten = functools.partial(graph.flatten, **_GRAPH)
iter_graph = functools.partial(state_ops.iter_graph, **_GRAPH)
recursive_map = functools.partial(state_ops.recursive_map, **_GRAPH)
cached_partial = functools.partial(compilation.cached_partial, **_UPDATES)
view = functools.partial(module_helpers.view, **_GRAPH)
view_info = functools.partial(module_helpers.view_info, **_GRAPH)
iter_modules = functools.partial(module.iter_modules, **_GRAPH)
iter_children = functools.partial(module.iter_children, **_GRAPH)
split_rngs = functools.partial(rnglib.split_rngs, **_UPDATES)
fork_rngs = functools.partial(rnglib.fork_rngs, **_UPDATES)
reseed = functools.partial(rnglib.reseed, **_GRAPH)
backup_keys = functools.partial(rnglib.backup_keys, **_GRAPH)
jit = functools.partial(transforms.jit, **_UPDATES)
shard_map = functools.partial(sharding_transforms.shard_map, **_UPDATES)
grad = functools.partial(transforms.grad, **_UPDATES)
value_and_grad = functools.partial(transforms.value_and_grad, **_UPDATES)
custom_vjp = functools.partial(differentiation.custom_vjp, **_UPDATES)
vjp = functools.partial(differentiation.vjp, **_UPDATES)
jvp = functools.partial(differentiation.jvp, **_UPDATES)
remat = functools.partial(transforms.remat, **_UPDATES)
vmap = functools.partial(batching.vmap, **_UPDATES)
scan = functools.partial(iteration.scan, **_UPDATES)
pmap = functools.partial(sharding_transforms.pmap, **_UPDATES)
while_loop = functools.partial(control.while_loop, **_UPDATES)
fori_loop = functools.partial(control.fori_loop, **_UPDATES)
eval_shape = functools.partial(control.eval_shape, **_UPDATES)
cond = functools.partial(control.cond, **_UPDATES)
switch = functools.partial(control.switch, **_UPDATES)
checkify = functools.partial(compilation.checkify, **_UPDATES)
get_abstract_model = functools.partial(abstract.get_abstract_model, **_GRAPH)
