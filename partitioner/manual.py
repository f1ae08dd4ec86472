"""Manual regions: a shard_map body (gs.manual, or a user's own jax.shard_map) as one op with fixed specs.

GShard's auto_to_manual / manual_to_auto. Outside, the region is an op whose
operands must arrive in its in_specs and whose results leave in its
out_specs: propagation treats both as user shardings, lowering reshards into
and out of it. Inside, the body runs unchanged on local shards, so its
collectives (psum, all_gather, all_to_all, ppermute, psum_scatter, ...) bind
by mesh axis name inside the per-device program's own shard_map. The report
lists them, read off the body, so explain() still equals the compiled HLO.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from jax._src import core as jcore

from .cost import Collective
from .program import Eqn
from .sharding import Sharding

PRIMITIVE = "shard_map"

# Collective primitives a body may bind, and the HLO collective each becomes.
KINDS = {"psum": "all-reduce", "pmax": "all-reduce", "pmin": "all-reduce", "all_gather": "all-gather",
         "all_to_all": "all-to-all", "ppermute": "collective-permute", "reduce_scatter": "reduce-scatter",
         "ragged_all_to_all": "all-to-all"}


def is_region(eqn: Eqn) -> bool:
    return eqn.name == PRIMITIVE


def check(eqn: Eqn, mesh_shape: Mapping[str, int]) -> None:
    """The region's mesh must be the partition mesh, manual over all of its axes."""
    mesh = eqn.params["mesh"]
    theirs = dict(mesh.shape)
    if theirs != dict(mesh_shape):
        raise ValueError(f"manual region at {eqn.source}: its mesh {theirs} is not the partition mesh "
                         f"{dict(mesh_shape)}; build the region over the mesh given to gs.partition")
    manual = set(eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes", mesh_shape)))
    auto = sorted(set(mesh_shape) - manual)
    if auto:
        raise ValueError(f"manual region at {eqn.source}: manual over {sorted(manual)} only, with {auto} left "
                         f"automatic; make it manual over every mesh axis (jax.shard_map without axis_names, "
                         f"or gs.manual)")


def _sharding(spec, rank: int) -> Sharding:
    return Sharding.from_spec(tuple(spec), rank)


def specs(eqn: Eqn) -> tuple[list[Sharding], list[Sharding]]:
    """The fixed shardings of the region's operands and results."""
    ins = [_sharding(s, len(x.shape)) for s, x in zip(eqn.params["in_specs"], eqn.invars)]
    outs = [_sharding(s, len(v.shape)) for s, v in zip(eqn.params["out_specs"], eqn.outvars)]
    return ins, outs


def run(eqn: Eqn, local_args: Sequence) -> list:
    """The body on local shards, inside the per-device program (its collectives bind by axis name)."""
    return list(jcore.eval_jaxpr(eqn.params["jaxpr"], (), *local_args))


def _group(eqn, mesh_shape: Mapping[str, int]) -> int:
    p = eqn.params
    axes = p.get("axes", p.get("axis_name", ()))
    axes = (axes,) if isinstance(axes, str) else tuple(a for a in axes if isinstance(a, str))
    if eqn.primitive.name == "ppermute":
        return 2 if any(s != t for s, t in p["perm"]) else 1
    return math.prod(mesh_shape[a] for a in axes)


def _nbytes(aval) -> int:
    return int(math.prod(aval.shape)) * aval.dtype.itemsize


def collectives(jaxpr, mesh_shape: Mapping[str, int]) -> list[Collective]:
    """The collectives a body binds, once each (as the HLO lists them), with nested bodies included."""
    out = []
    for e in jaxpr.eqns:
        kind = KINDS.get(e.primitive.name)
        if kind is not None:
            group = _group(e, mesh_shape)
            axes = e.params.get("axes", e.params.get("axis_name", ()))
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            for x, y in zip(e.invars, e.outvars):
                if group <= 1:
                    continue
                if kind == "all-gather":
                    payload = _nbytes(y.aval)
                else:  # all-reduce, all-to-all, permute: operand = result; reduce-scatter: the operand
                    payload = _nbytes(x.aval)
                out.append(Collective(kind, axes, group, payload, tuple(y.aval.shape), str(y.aval.dtype),
                                      "inside the manual region"))
        for sub in jcore.jaxprs_in_params(e.params):
            out += collectives(sub, mesh_shape)
    return out
