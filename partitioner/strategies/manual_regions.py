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

import numpy as np
from jax.extend import core as jcore
from jax.extend.core.primitives import all_gather_p, psum_p

from ..costs.cost import Collective
from ..representation.program import Eqn
from ..representation.sharding import Sharding

PRIMITIVE = "shard_map"

# Collective primitives a body may bind, and the HLO collective each becomes.
# (check_vma=True bodies bind the *_invariant forms; async *_start forms send what their plain forms do.)
KINDS = {"psum": "all-reduce", "psum_invariant": "all-reduce", "pmax": "all-reduce", "pmin": "all-reduce",
         "all_gather": "all-gather", "all_gather_invariant": "all-gather", "all_to_all": "all-to-all",
         "ppermute": "collective-permute", "reduce_scatter": "reduce-scatter", "ragged_all_to_all": "all-to-all",
         "psum_start": "all-reduce", "psum_invariant_start": "all-reduce", "all_gather_start": "all-gather",
         "reduce_scatter_start": "reduce-scatter", "all_to_all_start": "all-to-all",
         "ppermute_start": "collective-permute"}


def is_region(eqn: Eqn) -> bool:
    return eqn.name == PRIMITIVE


def check(eqn: Eqn, mesh_shape: Mapping[str, int]) -> None:
    """The region's mesh must be the partition mesh."""
    mesh = eqn.params["mesh"]
    theirs = dict(mesh.shape)
    if theirs != dict(mesh_shape):
        raise ValueError(f"manual region at {eqn.source}: its mesh {theirs} is not the partition mesh "
                         f"{dict(mesh_shape)}; build the region over the mesh given to gs.partition")


def auto_axes(eqn: Eqn, mesh_shape: Mapping[str, int]) -> list[str]:
    """The mesh axes a partial-manual region leaves automatic (jax.shard_map's axis_names a subset): its body
    sees its operands whole along them (in_specs cannot name them), so they run replicated over those axes."""
    manual = set(eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes", mesh_shape)))
    return [a for a in mesh_shape if a not in manual]


def _sharding(spec, rank: int) -> Sharding:
    return Sharding.from_spec(tuple(spec), rank)


def specs(eqn: Eqn) -> tuple[list[Sharding], list[Sharding]]:
    """The fixed shardings of the region's operands and results."""
    ins = [_sharding(s, len(x.shape)) for s, x in zip(eqn.params["in_specs"], eqn.invars)]
    outs = [_sharding(s, len(v.shape)) for s, v in zip(eqn.params["out_specs"], eqn.outvars)]
    return ins, outs


def run(eqn: Eqn, local_args: Sequence) -> list:
    """The body on local shards, inside the per-device program (its collectives bind by axis name).

    The per-device program is a shard_map with check_vma=False, manual over every axis, so a body traced with
    check_vma=True (jax.shard_map's default) runs as it would have been traced with check_vma=False: its
    collectives that exist only for the varying-axes types (psum_invariant, pvary, all_gather_invariant) bind
    as their plain forms, which compute the same values and differentiate as the plain forms do. A
    partial-manual body sees its operands whole along its automatic axes.
    """
    return _eval_plain(eqn.params["jaxpr"], (), local_args, eqn.source)


def _psum(x, *, axes):
    return psum_p.bind(x, axes=tuple(axes), axis_index_groups=None)


def _all_gather(x, **params):
    return all_gather_p.bind(x, axis_index_groups=None, **params)


PLAIN = {"psum_invariant": _psum, "psum_invariant_start": _psum, "pvary": lambda x, *, axes: x,
         "all_gather_invariant": _all_gather}
CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
         "custom_jvp_call": "call_jaxpr",
         "custom_vjp_call": "call_jaxpr"}


# Custom derivatives bound as they are where their bodies allow, so a per-device program differentiated
# (jax.grad(gs.partition(f))) runs the region's own backward rule (ring attention's ring backward).
CUSTOM = ("custom_jvp_call", "custom_vjp_call")


def _jaxpr(e):
    j = e.params[CALLS[e.primitive.name]]
    return j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j


def _uses_types(jaxpr) -> bool:
    """Whether a jaxpr (or one nested in it) binds a collective that only exists for varying-axes types."""
    return any(e.primitive.name in PLAIN or any(_uses_types(j) for j in jcore.jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


def _eval_plain(jaxpr, consts, args, where: str) -> list:
    """eval_jaxpr with the varying-axes collectives bound as their plain forms; calls are evaluated inline, and
    custom derivatives too where their bodies bind such collectives (they then differentiate through their
    primal body)."""
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr, consts = jaxpr.jaxpr, jaxpr.consts
    env: dict = {}
    # A literal as a plain array: its own type carries the region's mesh, whose automatic axes are manual here.
    read = lambda v: np.asarray(v.val) if isinstance(v, jcore.Literal) else env[v]
    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        name = e.primitive.name
        if name in PLAIN:
            outs = [PLAIN[name](*ins, **e.params)]
        elif name in CALLS and CALLS[name] in e.params and (name not in CUSTOM or _uses_types(_jaxpr(e))):
            outs = _eval_plain(e.params[CALLS[name]], (), ins, where)
        elif any(_uses_types(j) for j in jcore.jaxprs_in_params(e.params)):
            raise NotImplementedError(
                f"manual region at {where}: its {name} holds a psum or pvary of the check_vma=True kind, which "
                f"cannot run inside the per-device program; pass check_vma=False to this jax.shard_map")
        else:
            # (Not under the eqn's own context: its mesh types the region's automatic axes, while here every
            # axis is manual.)
            outs = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
            outs = list(outs) if e.primitive.multiple_results else [outs]
        for v, x in zip(e.outvars, outs):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _group(eqn, mesh_shape: Mapping[str, int]) -> int:
    p = eqn.params
    axes = p.get("axes", p.get("axis_name", ()))
    axes = (axes,) if isinstance(axes, str) else tuple(a for a in axes if isinstance(a, str))
    if eqn.primitive.name == "ppermute":
        return 2 if any(s != t for s, t in p["perm"]) else 1
    return math.prod(mesh_shape[a] for a in axes)


def _nbytes(aval) -> int:
    return int(math.prod(aval.shape)) * aval.dtype.itemsize


def collectives(jaxpr, mesh_shape: Mapping[str, int], runs: int = 1) -> list[Collective]:
    """The collectives a body binds, once each (as the HLO lists them), with nested bodies included; one in a
    scan (a fori_loop with static bounds) runs its length times per call (`runs`)."""
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
                note = "inside the manual region"
                if kind == "all-gather":
                    payload = _nbytes(y.aval)
                elif e.primitive.name == "ragged_all_to_all":
                    # Only the rows its sizes name move, which the trace does not know: counted at the
                    # router's balance, where each device sends and receives as many rows as its smaller
                    # buffer holds (its rows going out; the rows it received, coming back).
                    payload = min(_nbytes(x.aval), _nbytes(y.aval))
                    note = "inside the manual region, ragged: the rows routed, at the router's balance"
                else:  # all-reduce, all-to-all, permute: operand = result; reduce-scatter: the operand
                    payload = _nbytes(x.aval)
                out.append(Collective(kind, axes, group, payload, tuple(y.aval.shape), str(y.aval.dtype),
                                      note, runs))
        inner = runs * (e.params["length"] if e.primitive.name == "scan" else 1)
        for sub in jcore.jaxprs_in_params(e.params):
            out += collectives(sub, mesh_shape, inner)
    return out
