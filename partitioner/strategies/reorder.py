"""Reordering a split dim without gathering it: split, concatenate, rev, and dynamic_update_slice at
constant offsets.

split and concatenate tie each piece's rows to the whole array's (a split's ties propagate, a
concatenation's do not: the plan decides each side); each device's block of each piece (of the
concatenation) is assembled from the rows it holds and rows the devices holding them send, by rounds of
collective-permutes or one all-to-all (relayout.py). rev reverses the local block and sends it to the mirror
device (one collective-permute; an uneven dim is gathered and cut). The cost model weighs each against
gathering.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..costs.cost import Collective
from ..costs.hardware import GENERIC, Hardware
from ..representation.factors import FactorNames, Rule
from ..representation.program import Const, Eqn, shape_of
from ..rules.factor_rules import pieces_rule
from .halo import gather_collectives, gather_rows, ppermute
from .relayout import Relayout, relayout, relayout_collectives, run_relayout
from .reshard import linear_axis_index


def concat_rule(eqn: Eqn) -> Rule:
    """Other dims shared; along the concatenated dim each piece's rows are tied to the result's rows (not
    propagated: the plan decides each side), and a split result reads its rows from the pieces' shards."""
    d = eqn.params["dimension"]
    return pieces_rule("concatenate", shape_of(eqn.outvars[0]), d, [shape_of(x)[d] for x in eqn.invars], True,
                       ties_propagate=False)


def split_rule(eqn: Eqn) -> Rule:
    """jnp.split: other dims shared; each piece's rows along the split dim are tied to the operand's (a split
    carries to the pieces and back), and each device's block of each piece is assembled from the operand's
    shards (`relayout`)."""
    shape = shape_of(eqn.invars[0])
    d = eqn.params["axis"] % len(shape)
    return pieces_rule("split", shape, d, [shape_of(v)[d] for v in eqn.outvars], False)


def _row_bytes(ctx, i: int, dim: int) -> int:
    """The bytes of one row (along dim) of operand i's local block."""
    x = ctx.eqn.invars[i]
    shape = ctx.need[i].local_shape(x.shape, ctx.mesh_shape)
    return math.prod(s for e, s in enumerate(shape) if e != dim) * x.aval.dtype.itemsize


def _profile(ctx) -> Hardware:
    """The lowering's hardware profile when the context carries one, else the default one."""
    return ctx.profile or GENERIC


def _split_plan(ctx) -> Optional[tuple[Relayout, tuple]]:
    """The relayout of a split whose split dim is split over some axes (None when it is whole)."""
    x = ctx.eqn.invars[0]
    d = ctx.eqn.params["axis"] % len(x.shape)
    axes = ctx.axes(ctx.rule.operands[0][d][0])
    if not axes:
        return None
    src = ctx.need[0].local_shape(x.shape, ctx.mesh_shape)[d]
    dst = [ctx.local_out(i)[d] for i in range(len(ctx.eqn.outvars))]
    segments, offset = [], 0
    for b, v in enumerate(ctx.eqn.outvars):
        segments.append((0, offset, b, 0, v.shape[d]))
        offset += v.shape[d]
    return relayout(ctx.group(axes), [src], dst, segments, _row_bytes(ctx, 0, d), axes, _profile(ctx)), axes


def split_collectives(ctx) -> list[Collective]:
    found = _split_plan(ctx)
    if found is None:
        return []
    x = ctx.eqn.invars[0]
    d = ctx.eqn.params["axis"] % len(x.shape)
    return relayout_collectives(found[0], ctx.need[0].local_shape(x.shape, ctx.mesh_shape), d, found[1],
                                x.aval.dtype, "split pieces re-laid")


def split_hook(ctx, ins, params, bind):
    found = _split_plan(ctx)
    if found is None:
        return bind(*ins, **params)
    d = ctx.eqn.params["axis"] % ins[0].ndim
    return run_relayout(found[0], list(ins), d, found[1], ctx.mesh_shape)


def _concat_plan(ctx) -> Optional[tuple[Relayout, tuple]]:
    """The relayout of a concatenation whose result is split along the concatenated dim (None when whole)."""
    d = ctx.eqn.params["dimension"]
    axes = ctx.axes(ctx.rule.results[0][d][0])
    if not axes:
        return None
    src = [n.local_shape(x.shape, ctx.mesh_shape)[d] for n, x in zip(ctx.need, ctx.eqn.invars)]
    segments, offset = [], 0
    for a, x in enumerate(ctx.eqn.invars):
        segments.append((a, 0, 0, offset, x.shape[d]))
        offset += x.shape[d]
    return relayout(ctx.group(axes), src, [ctx.local_out()[d]], segments, _row_bytes(ctx, 0, d), axes,
                    _profile(ctx)), axes


def concat_collectives(ctx) -> list[Collective]:
    found = _concat_plan(ctx)
    if found is None:
        return []
    x = ctx.eqn.invars[0]
    return relayout_collectives(found[0], ctx.need[0].local_shape(x.shape, ctx.mesh_shape),
                                ctx.eqn.params["dimension"], found[1], x.aval.dtype, "concatenated rows re-laid")


def concat_hook(ctx, ins, params, bind):
    found = _concat_plan(ctx)
    if found is None:
        return bind(*ins, **params)
    return run_relayout(found[0], [jnp.asarray(x) for x in ins], params["dimension"], found[1], ctx.mesh_shape)


def rev_rule(eqn: Eqn) -> Rule:
    """Every dim passes through; a split reversed dim is fixed up by the hook (blocks swap ends)."""
    n = FactorNames()
    dims = tuple((n.new(s),) for s in shape_of(eqn.invars[0]))
    return Rule("rev", (dims,), (dims,), n.sizes)


def _rev_dims(ctx) -> list:
    return [(d, ctx.axes(ctx.rule.operands[0][d][0])) for d in ctx.eqn.params["dimensions"]
            if ctx.axes(ctx.rule.operands[0][d][0])]


def rev_collectives(ctx) -> list[Collective]:
    x = ctx.eqn.invars[0]
    shape = list(ctx.need[0].local_shape(x.shape, ctx.mesh_shape))
    out = []
    for d, axes in _rev_dims(ctx):
        n = ctx.group(axes)
        nbytes = math.prod(shape) * x.aval.dtype.itemsize
        if x.shape[d] % n == 0:
            out.append(Collective("collective-permute", axes, n, nbytes, tuple(shape), str(x.aval.dtype),
                                  "blocks to the mirror device"))
        else:
            out += gather_collectives(list(shape), d, axes, str(x.aval.dtype), x.aval.dtype.itemsize, ctx.mesh_shape,
                            "uneven reversed rows")
    return out


def rev_hook(ctx, ins, params, bind):
    """Reverse locally, then block i goes to device k-1-i (an uneven dim is gathered and cut instead)."""
    (x,) = ins
    (x,) = bind(x, **params)
    for d, axes in _rev_dims(ctx):
        n, size = ctx.group(axes), ctx.eqn.invars[0].shape[d]
        if size % n == 0:
            x = ppermute(x, axes, [(j, n - 1 - j) for j in range(n)], ctx.mesh_shape)
            continue
        # x holds reversed padded blocks; gather them in order, restore the global order, cut block i
        local = x.shape[d]
        full = jax.lax.rev(gather_rows(jax.lax.rev(x, (d,)), d, axes, size, 0), (d,))
        start = n * local - size  # the reversed array's first row sits after the padding
        index = linear_axis_index(axes, ctx.mesh_shape)
        x = jax.lax.dynamic_slice_in_dim(jnp.pad(full, [(0, local if e == d else 0) for e in range(x.ndim)]),
                                         start + index * local, local, axis=d)
    return [x]


def _static_starts(eqn: Eqn) -> Optional[list]:
    """The (clamped, as dynamic_update_slice clamps) constant start indices, or None if one is traced."""
    if not all(isinstance(x, Const) and np.ndim(x.val) == 0 for x in eqn.invars[2:]):
        return None
    return [min(max(int(np.asarray(x.val)), 0), n - u) for x, n, u in
            zip(eqn.invars[2:], shape_of(eqn.invars[0]), shape_of(eqn.invars[1]))]


def update_rule(eqn: Eqn, fallback) -> Rule:
    """dynamic_update_slice at constant offsets: the operand's dims pass through to the result (a split one
    stays split); the update's shorter dims are kept whole, each device writing the rows that land in its
    block. At traced offsets, `fallback` (every updated dim of the operand kept whole too)."""
    if _static_starts(eqn) is None:
        return fallback(eqn)
    n = FactorNames()
    dims = [(n.new(s),) for s in shape_of(eqn.invars[0])]
    upd, whole = [], set()
    for d, u in enumerate(shape_of(eqn.invars[1])):
        if u == shape_of(eqn.invars[0])[d]:
            upd.append(dims[d])
        else:
            f = n.new(u)
            whole.add(f)
            upd.append((f,))
    idx = tuple(() for _ in eqn.invars[2:])
    return Rule("update", (tuple(dims), tuple(upd)) + idx, (tuple(dims),), n.sizes, replicated=frozenset(whole))


def update_hook(ctx, ins, params, bind):
    """On a split dim, each device cuts the update rows that land in its block from the (whole) update,
    writes them at row 0 of its block, and keeps its own rows where the update does not reach."""
    starts = _static_starts(ctx.eqn)
    shape, ushape = ctx.eqn.invars[0].shape, ctx.eqn.invars[1].shape
    split = {d: ctx.axes(f) for d, (f,) in enumerate(ctx.rule.results[0])
             if ctx.axes(f) and ushape[d] != shape[d]} if starts is not None else {}
    if not split:
        return bind(*ins, **params)
    operand, update = ins[0], ins[1]
    offset = {}
    for d, axes in split.items():
        rows = operand.shape[d]
        offset[d] = linear_axis_index(axes, ctx.mesh_shape) * rows
        padded = jnp.pad(update, [(rows, rows) if e == d else (0, 0) for e in range(update.ndim)])
        # update rows [block start - start, + rows), read from the update padded by `rows` on both ends
        at = jnp.clip(offset[d] - starts[d] + rows, 0, padded.shape[d] - rows)
        update = jax.lax.dynamic_slice_in_dim(padded, at, rows, axis=d)
    local_starts = [jnp.int32(0) if d in split else jnp.int32(s) for d, s in enumerate(starts)]
    placed = bind(operand, update, *local_starts, **params)[0]
    written = None
    for d, (n, u) in enumerate(zip(shape, ushape)):
        if u == n:
            continue
        row = jax.lax.broadcasted_iota(jnp.int32, operand.shape, d) + offset.get(d, 0)
        inside = (row >= starts[d]) & (row < starts[d] + u)
        written = inside if written is None else written & inside
    return [jnp.where(written, placed, operand)]
