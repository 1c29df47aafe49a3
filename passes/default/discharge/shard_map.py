"""Discharge rule for a raw ``shard_map`` (and ``jax.pmap``, which runs as one).

Variables enter and leave the body replicated (``P()``): every shard sees the whole value.
That is right only for a value that is the same on every shard, which JAX's type system
tracks inside the body (the varying mesh axes of each value, with ``check_vma=True``), so a
written value that varies over a mesh axis raises ``TransformError``, as does any write
under ``check_vma=False``.  RNG draws in the body give every shard the same key.
"""
from __future__ import annotations

from typing import Any

import jax

from varjax import _jax
from varjax.ir import errors, nested
from varjax.ir.primitives import Key, var_set_p
from varjax.passes.default.discharge.discharger import (
    Discharger,
    Env,
    leaves_of,
    register_discharge_rule,
    require,
    split_vars,
    var_type,
)
from varjax.passes.framework.analysis import key_of, traffic
from varjax.passes.framework.rewrite import Region

ClosedJaxpr = _jax.ClosedJaxpr


@register_discharge_rule(_jax.shard_map_p)
def _shard_map(d: Discharger, eqn: _jax.JaxprEqn, invals: list[Any], env: Env,
               region: Region) -> list[Any]:
    """Variables enter a raw shard_map replicated (``P()``: every shard sees the whole
    value) and leave it the same way, which is right only for a value that is the same on
    every shard: a write JAX's type says varies over a mesh axis raises."""
    p = eqn.params
    body = nested.closed(p["jaxpr"])
    t = traffic(body)
    in_keys, out_keys = sorted(t.needs), sorted(t.may_write)
    require(eqn, in_keys, env, "'shard_map'")
    if out_keys and not p["check_vma"]:
        k = out_keys[0]
        raise errors.TransformError(
            "this variable is written inside a raw jax.shard_map with check_vma=False (or "
            "inside a raw jax.pmap, which runs as one), so varjax cannot check that the "
            "written value is the same on every shard.",
            collection=k[0], path=k[1], **errors.where(_last_write(body, k).source_info),
            fix="keep check_vma=True (the default) in jax.shard_map, or use the lifted "
                f"vj.shard_map (nn.shard_map) with variable_specs={{'{k[0]}': P(...)}} or "
                f"vj.pmap (nn.pmap) with variable_axes={{'{k[0]}': 0}}")
    in_types = [(k, var_type(env[k])) for k in in_keys]
    trees: list = []

    def per_shard(var_leaves, *args):
        benv, _ = split_vars(var_leaves, in_types)
        outs = d.run_body(body, benv, list(args))
        for k in out_keys:
            axes = frozenset().union(*map(_jax.varying_axes, benv[k][1]))
            if axes:
                raise errors.TransformError(
                    "this variable is written inside a raw jax.shard_map with a value that "
                    f"differs between shards (it varies over mesh axis "
                    f"{', '.join(map(repr, sorted(axes)))}); a variable has one value, so "
                    "varjax cannot tell which shard's value should win.",
                    collection=k[0], path=k[1], **errors.where(_last_write(body, k).source_info),
                    fix="use the lifted vj.shard_map (nn.shard_map) with variable_specs="
                        f"{{'{k[0]}': P(...)}}, which keeps one copy per shard (or make the "
                        "value the same on every shard, e.g. with jax.lax.pmean)")
        trees[:] = [benv[k][0] for k in out_keys]
        return tuple(outs), [list(benv[k][1]) for k in out_keys]

    P = jax.sharding.PartitionSpec
    with _jax.source_info_of(eqn):
        outs, var_out = jax.shard_map(
            per_shard, mesh=p["mesh"], in_specs=(P(), *p["in_specs"]),
            out_specs=(tuple(p["out_specs"]), P()), axis_names=p["newly_manual_axes"],
            check_vma=p["check_vma"])(leaves_of(env, in_keys), *invals)
    for k, tree, vals in zip(out_keys, trees, var_out):
        env[k] = (tree, list(vals))
    return list(outs)


def _last_write(body: ClosedJaxpr, k: Key) -> _jax.JaxprEqn:
    writes = [e for e, _ in nested.walk_eqns(body) if e.primitive is var_set_p and key_of(e) == k]
    return writes[-1]

