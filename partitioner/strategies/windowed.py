"""Windowed ops on split dims: convolutions and pooling, by halo exchange (docs/references.md).

A windowed op's rule ties each spatial dim of its input to the dim a split
of it carries to (factors.Rule.ties): the output rows (each device computes
the windows of its block of output rows), or, when the window is longer than
the output (the kernel gradient of a convolution, whose window is the
forward output), the window rows (each device contracts its block: a partial
sum, combined like any other). The hook then gives each device the input
rows its windows read: it receives the rows its neighbours hold by one
collective-permute per hop, sets rows outside the input to the op's pad
value (0 for convolutions and sums, the identity of max/min), and runs the op
on that local window with the padding it still needs. A base-dilated input
whose shards start at different dilation phases (a strided slice's gradient)
gets a wider window and keeps its results from a shifted start; the split dim
is gathered only where that cannot be (a contracted window, or a stride that
splits the phase), as XLA's partitioner gathers all such dims. The geometry
is window_geometry.py's.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from ..costs.cost import Collective
from ..representation.factors import FactorNames, Rule
from ..representation.program import Eqn, Value, shape_of
from .halo import Halo, exchange, gather_collectives, gather_rows, pad_value
from .reshard import linear_axis_index
from .window_geometry import GATHER, GENERIC, POOLS, SCATTER, Spatial, _input, _plain, halo, spatial_dims


def conv_rule(eqn: Eqn) -> Rule:
    """Batch and output features pass through; input features are a contraction; feature groups (grouped,
    depthwise) and batch groups (the kernel gradient of a grouped conv) are major factors; spatial dims are
    tied to the output rows or, for a kernel gradient, to the contracted window rows."""
    p = eqn.params
    dn = p["dimension_numbers"]
    xs, ws, os_ = shape_of(eqn.invars[0]), shape_of(eqn.invars[1]), shape_of(eqn.outvars[0])
    fg, bg = p["feature_group_count"], p["batch_group_count"]
    n = FactorNames()
    lhs: list = [None] * len(xs)
    rhs: list = [None] * len(ws)
    out: list = [None] * len(os_)
    reductions, ties, replicated = {}, {}, set()
    (lb, lf), (ro, ri), (ob, of) = dn.lhs_spec[:2], dn.rhs_spec[:2], dn.out_spec[:2]
    ci = n.new(ws[ri])
    rhs[ri] = (ci,)
    reductions[ci] = "sum"
    if bg > 1:  # lhs batch = (group, batch), rhs and result features = (group, feature)
        g, b, co = n.new(bg), n.new(xs[lb] // bg), n.new(ws[ro] // bg)
        lhs[lb], out[ob], rhs[ro], out[of] = (g, b), (b,), (g, co), (g, co)
        lhs[lf] = (ci,)
    else:
        b = n.new(xs[lb])
        lhs[lb], out[ob] = (b,), (b,)
        if fg > 1:  # lhs features = (group, in), rhs and result features = (group, out)
            g, co = n.new(fg), n.new(ws[ro] // fg)
            lhs[lf], rhs[ro], out[of] = (g, ci), (g, co), (g, co)
        else:
            co = n.new(ws[ro])
            lhs[lf], rhs[ro], out[of] = (ci,), (co,), (co,)
    for sp in spatial_dims(eqn):
        fl, fr, fo = n.new(sp.size), n.new(sp.window), n.new(sp.out_size)
        lhs[sp.lhs], rhs[sp.rhs], out[sp.out] = (fl,), (fr,), (fo,)
        if sp.contracted:
            ties[fr] = fl
            reductions[fr] = "sum"
            replicated.add(fo)
        else:
            ties[fo] = fl
            replicated.add(fr)
    return Rule("conv", (tuple(lhs), tuple(rhs)), (tuple(out),), n.sizes, reductions, frozenset(replicated), ties)


def pool_rule(eqn: Eqn) -> Rule:
    """reduce_window_{sum,max,min}, pad and slice: dims without a window pass through, windowed dims tie input
    to output rows."""
    n = FactorNames()
    ins, outs, ties = [], [], {}
    for sp in spatial_dims(eqn):
        if _plain(sp):
            f = n.new(sp.size)
            ins.append((f,))
            outs.append((f,))
        else:
            fi, fo = n.new(sp.size), n.new(sp.out_size)
            ins.append((fi,))
            outs.append((fo,))
            ties[fo] = fi
    kind = f"pool({POOLS[eqn.name]})" if eqn.name in POOLS else f"{eqn.name}(windowed)"
    extra = tuple(() for _ in eqn.invars[1:])  # pad's padding value
    return Rule(kind, (tuple(ins),) + extra, (tuple(outs),), n.sizes, ties=ties, ties_propagate=_carries_split(eqn))


def _carries_split(eqn: Eqn) -> bool:
    """Whether propagation carries a split across the op. Pooling does; a slice or pad does where it cuts or adds
    fewer rows at either end than both sides hold: a device's block then drifts from the input block it reads by
    at most those rows, so a halo brings it fewer rows than gathering the result would (x[2:62:2], x[:, :-1]).
    A far window (x[500:520] of 1024 rows) or a dilating pad is left to the plan, which decides each side."""
    if eqn.name in POOLS:
        return True
    return all(_plain(sp) or (sp.base == 1 and max(-sp.lo, sp.lo, -sp.hi, sp.hi) < min(sp.size, sp.out_size))
               for sp in spatial_dims(eqn))


def generic_pool_rule(eqn: Eqn) -> Rule:
    """reduce_window with its own computation (variadic): every operand and result as pool_rule's; the init
    values are scalars."""
    base = pool_rule(eqn)
    k = len(eqn.outvars)
    return Rule("pool(generic)", (base.operands[0],) * k + ((),) * k, base.results * k, base.sizes, ties=base.ties)


def _split(ctx, eqn: Eqn) -> list[tuple[int, Spatial, tuple, int]]:
    """(index, spatial dim, its axes, shards) of each split spatial dim."""
    out = []
    for k, sp in enumerate(spatial_dims(eqn)):
        axes = ctx.axes(ctx.rule.operands[_input(eqn)][sp.lhs][0])
        if axes:
            out.append((k, sp, axes, ctx.group(axes)))
    return out


def _local(ctx, sp: Spatial) -> int:
    if sp.contracted:
        return ctx.need[1].local_shape(ctx.eqn.invars[1].shape, ctx.mesh_shape)[sp.rhs]
    if ctx.eqn.name == SCATTER:
        return ctx.need[0].local_shape(ctx.eqn.invars[0].shape, ctx.mesh_shape)[sp.out]
    return ctx.local_out()[sp.out]


def _plans(ctx) -> list[tuple[int, Spatial, tuple, int, Optional[Halo]]]:
    i = _input(ctx.eqn)
    lshape = ctx.need[i].local_shape(ctx.eqn.invars[i].shape, ctx.mesh_shape)
    shifted = ctx.eqn.name not in (SCATTER, GATHER)  # their hooks set the window's padding themselves
    return [(k, sp, axes, n, halo(sp, n, lshape[sp.lhs], _local(ctx, sp), shifted))
            for k, sp, axes, n in _split(ctx, ctx.eqn)]


def collectives(ctx) -> list[Collective]:
    """The halo exchanges (and gathers of base-dilated dims) a windowed op's hook emits; a scatter sends each
    halo back the way it came, with the contributions to the neighbours' rows."""
    if ctx.eqn.name == GATHER:  # the tangent's and the operand's halos
        return _receives(ctx, 0) + _receives(ctx, 1)
    if ctx.eqn.name == GENERIC:  # every operand's halos
        return [c for i in range(len(ctx.eqn.outvars)) for c in _receives(ctx, i)]
    out = _receives(ctx)
    if ctx.eqn.name == SCATTER:  # the transposed exchange (never shared), in reverse order
        trip = _receives(dataclasses.replace(ctx, cache=None)) if ctx.cache else out
        out = out + [dataclasses.replace(c, note=c.note.replace("from", "back to"))
                     for c in reversed(trip) if c.kind == "collective-permute"]
    return out


def received_keys(ctx) -> list[tuple]:
    """The cache entries the hook fills (the halo pieces it receives, reused by later ops), for a walk that
    costs the program without running the hook (Lowering.cost)."""
    if ctx.cache is None:
        return []
    if ctx.eqn.name == GATHER:
        operands = [0, 1]
    elif ctx.eqn.name == GENERIC:
        operands = list(range(len(ctx.eqn.outvars)))
    else:
        operands = [_input(ctx.eqn)]
    return [key + (sp.lhs, axes, hop, rows) for i in operands for _, sp, axes, _, h, key in _keyed_plans(ctx, i)
            if h is not None and key is not None for hop, rows in h.pieces()]


def _receives(ctx, operand: Optional[int] = None) -> list[Collective]:
    """What the hook receives: halo pieces not received already, gathers."""
    i = _input(ctx.eqn) if operand is None else operand
    x = ctx.eqn.invars[i]
    shape = list(ctx.need[i].local_shape(x.shape, ctx.mesh_shape))
    out = []
    for _, sp, axes, n, h, key in _keyed_plans(ctx, i):
        if h is None:
            out += gather_collectives(shape, sp.lhs, axes, str(x.aval.dtype), x.aval.dtype.itemsize, ctx.mesh_shape,
                            "base-dilated rows")
            if sp.contracted:
                w = ctx.eqn.invars[1]
                wshape = list(ctx.need[1].local_shape(w.shape, ctx.mesh_shape))
                out += gather_collectives(wshape, sp.rhs, axes, str(w.aval.dtype), w.aval.dtype.itemsize,
                                          ctx.mesh_shape,
                                "window rows")
            continue
        for hop, rows in h.pieces():
            if ctx.cache is not None and key is not None and key + (sp.lhs, axes, hop, rows) in ctx.cache:
                continue  # received already for an earlier op
            piece = list(shape)
            piece[sp.lhs] = rows
            out.append(Collective("collective-permute", axes, n, math.prod(piece) * x.aval.dtype.itemsize,
                                  tuple(piece), str(x.aval.dtype), f"halo {rows} rows from {abs(hop)} "
                                  f"{'left' if hop < 0 else 'right'}"))
        shape[sp.lhs] = h.rows
    return out


# --------------------------------------------------------------------------- hooks

def _windowed(ctx, x, pad_value, padding: list, operand: Optional[int] = None) -> tuple:
    """x with each split spatial dim replaced by the rows its local windows need; the local padding, and
    per gathered (base-dilated) or shifted dim the output block this device keeps."""
    keep = []
    for k, sp, axes, n, h, key in _keyed_plans(ctx, operand):
        index = linear_axis_index(axes, ctx.mesh_shape)
        if h is None:
            x = gather_rows(x, sp.lhs, axes, sp.size, pad_value)
            keep.append((sp, axes, index, n, None))
            continue
        x = exchange(x, sp.lhs, axes, h, index, pad_value, ctx.mesh_shape, ctx.cache, key)
        padding[k] = (h.lo, h.hi)
        if h.shift:
            keep.append((sp, axes, index, n, h.shift))
    return x, padding, keep


def _keyed_plans(ctx, operand: Optional[int] = None) -> list:
    """_plans with, per split dim, the cache key of the rows exchanged so far (None: not cacheable)."""
    i = _input(ctx.eqn) if operand is None else operand
    v = ctx.eqn.invars[i]
    prefix: tuple = ("halo", v, ctx.need[i]) if isinstance(v, Value) else None
    out = []
    for k, sp, axes, n, h in _plans(ctx):
        out.append((k, sp, axes, n, h, prefix))
        if prefix is not None:
            prefix = prefix + ((sp.lhs, axes, h),)
    return out


def _keep_blocks(ctx, y, keep):
    """From a result computed over whole (gathered) dims, this device's block of rows."""
    local = ctx.local_out()
    for sp, _, index, n, shift in keep:
        if shift is not None:  # results of a wider window: this device's start at index * shift
            y = jax.lax.dynamic_slice_in_dim(y, index * shift, local[sp.out], axis=sp.out)
            continue
        if sp.contracted:  # every device computed the whole sum: one of them keeps it
            y = jnp.where(index == 0, y, jnp.zeros((), y.dtype))
            continue
        dim = sp.out
        rows = local[dim]
        extra = max(0, n * rows - y.shape[dim])
        y = jnp.pad(y, [(0, extra if d == dim else 0) for d in range(y.ndim)])
        y = jax.lax.dynamic_slice_in_dim(y, index * rows, rows, axis=dim)
    return y


def conv_hook(ctx, ins, params, bind):
    lhs, rhs = ins
    padding = [tuple(p) for p in params["padding"]]
    lhs, padding, keep = _windowed(ctx, lhs, 0, padding)
    for sp, axes, _, _, shift in keep:  # a gathered kernel-gradient window: its rows are gathered too
        if sp.contracted and shift is None:
            rhs = gather_rows(rhs, sp.rhs, axes, sp.window, 0)
    p = dict(params, padding=tuple(padding))
    for key in ("feature_group_count", "batch_group_count"):
        if p[key] > 1:
            g = ctx.rule.operands[1][ctx.eqn.params["dimension_numbers"].rhs_spec[0]][0]
            p[key] //= ctx.group(ctx.axes(g))
    (y,) = bind(lhs, rhs, **p)
    return [_keep_blocks(ctx, y, keep) if keep else y]


def pool_hook(ctx, ins, params, bind):
    (x,) = ins
    padding = [tuple(p) for p in params["padding"]]
    x, padding, keep = _windowed(ctx, x, pad_value(POOLS[ctx.eqn.name], x.dtype), padding)
    (y,) = bind(x, **dict(params, padding=tuple(padding)))
    return [_keep_blocks(ctx, y, keep) if keep else y]


def generic_pool_hook(ctx, ins, params, bind):
    """Each operand's halo rows padded with its init value (what reduce_window pads with)."""
    k = len(ins) // 2
    windows, padding, keep = [], None, []
    for i in range(k):
        x, padding, keep = _windowed(ctx, ins[i], ins[k + i], [tuple(p) for p in params["padding"]], i)
        windows.append(x)
    ys = bind(*windows, *ins[k:], **dict(params, padding=tuple(padding)))
    return [_keep_blocks(ctx, y, keep) if keep else y for y in ys]


def pad_hook(ctx, ins, params, bind):
    x, value = ins
    cfg = [tuple(c) for c in params["padding_config"]]
    padding = [(lo, hi) for lo, hi, _ in cfg]
    x, padding, keep = _windowed(ctx, x, value, padding)
    (y,) = bind(x, value, padding_config=tuple((lo, hi, i) for (lo, hi), (_, _, i) in zip(padding, cfg)))
    return [_keep_blocks(ctx, y, keep) if keep else y]


def slice_hook(ctx, ins, params, bind):
    """Windowed dims read their exchanged rows from 0; dims passed through whole may be split (local size)."""
    (x,) = ins
    gshape = ctx.eqn.invars[0].shape
    strides = params.get("strides") or (1,) * x.ndim
    starts, limits = list(params["start_indices"]), list(params["limit_indices"])
    split = {sp.lhs for _, sp, _, _, _ in _plans(ctx)}
    # No mask: a slice's windows lie inside the input; rows past it only reach the result's padding.
    x, _, keep = _windowed(ctx, x, None, [(0, 0)] * x.ndim)
    for d in range(x.ndim):
        if d in split and not any(sp.lhs == d for sp, *_ in keep):
            starts[d], limits[d] = 0, x.shape[d]
        elif x.shape[d] != gshape[d] and not any(sp.lhs == d for sp, *_ in keep):
            limits[d] = x.shape[d]  # a dim passed through whole, split
    if all(a == 0 for a in starts) and tuple(limits) == x.shape and not any(s != 1 for s in strides):
        return [x]  # the local block itself (XLA would drop the slice, then merge what reads it)
    (y,) = bind(x, start_indices=tuple(starts), limit_indices=tuple(limits), strides=params.get("strides"))
    return [_keep_blocks(ctx, y, keep) if keep else y]


def select_gather_rule(eqn: Eqn) -> Rule:
    """select_and_gather_add: tangent and operand share every factor; windowed dims tie them to the output
    (a base-dilated one is kept whole instead)."""
    base = pool_rule(eqn)
    dilated = {f for sp, (f,) in zip(spatial_dims(eqn), base.operands[0]) if sp.base > 1}
    ties = {o: i for o, i in base.ties.items() if i not in dilated}
    whole = dilated | {o for o, i in base.ties.items() if i in dilated}
    return Rule("select_and_gather", (base.operands[0], base.operands[0]), base.results, base.sizes,
                replicated=frozenset(whole), ties=ties)


def select_gather_hook(ctx, ins, params, bind):
    """Both inputs get the same halo rows; rows outside the operand are never selected."""
    tangent, operand = ins
    never = pad_value("max" if params["select_prim"] is jax.lax.ge_p else "min", operand.dtype)
    padding = [tuple(p) for p in params["padding"]]
    for k, sp, axes, _, h, key in _keyed_plans(ctx, 0):
        padding[k] = (h.lo, h.hi)  # never None: base-dilated dims are kept whole by the rule
    windows = []
    for i, (x, pad) in enumerate(((tangent, 0), (operand, never))):
        for k, sp, axes, _, h, key in _keyed_plans(ctx, i):
            x = exchange(x, sp.lhs, axes, h, linear_axis_index(axes, ctx.mesh_shape), pad, ctx.mesh_shape,
                          ctx.cache, key)
        windows.append(x)
    return bind(*windows, **dict(params, padding=tuple(padding)))


def select_scatter_rule(eqn: Eqn) -> Rule:
    """select_and_scatter_add: the operand's and the result's rows are one factor, tied to the source's rows
    in windowed dims."""
    n = FactorNames()
    src, op, ties = [], [], {}
    for sp in spatial_dims(eqn):
        fi = n.new(sp.size)
        op.append((fi,))
        if _plain(sp):
            src.append((fi,))
        else:
            fo = n.new(sp.out_size)
            src.append((fo,))
            ties[fo] = fi
    return Rule("select_and_scatter", (tuple(src), tuple(op)), (tuple(op),), n.sizes, ties=ties)


def select_scatter_hook(ctx, ins, params, bind):
    """Select within each device's operand window (halo rows received), scatter onto that window, then send
    the rows that belong to the neighbours back (the transpose of the exchange) and add them."""
    source, operand = ins
    plans = _plans(ctx)
    padding = [tuple(p) for p in params["padding"]]
    never = pad_value("max" if params["select_prim"] is jax.lax.ge_p else "min", operand.dtype)  # not selected

    def received(x, cached: bool):
        for k, sp, axes, _, h, key in _keyed_plans(ctx):
            x = exchange(x, sp.lhs, axes, h, linear_axis_index(axes, ctx.mesh_shape), 0, ctx.mesh_shape,
                          ctx.cache if cached else None, key)
        return x

    window = received(operand, True)  # the operand's halos, shared with the pooling that read them
    back = jax.linear_transpose(lambda x: received(x, False), operand)  # only the return trip is emitted
    valid = None
    for k, sp, axes, _, h in plans:
        padding[k] = (h.lo, h.hi)
        row = (jax.lax.broadcasted_iota(jnp.int32, window.shape, sp.lhs)
               + linear_axis_index(axes, ctx.mesh_shape) * h.step + h.first)
        ok = (row >= 0) & (row < h.N)
        valid = ok if valid is None else valid & ok
    if valid is not None:
        window = jnp.where(valid, window, jnp.asarray(never, window.dtype))
    (y,) = bind(source, window, **dict(params, padding=tuple(padding)))
    return list(back(y))
