"""Op hooks on the generic lowering: what a few primitives need beyond binding on local shards.

Each hook receives the chosen factor sharding and the local operands, and
returns the local results; its ``*_collectives`` partner says what it will
communicate, for the cost model and the report (registry.py pairs them per
op). Hooks never choose shardings: the one mechanism in lower.py does.

- iota, random_bits: position-dependent values get the shard's global offset
  (GShard's PartitionId x shard size; partitionable threefry is a function of
  the global position, so its bits equal the unpartitioned ones).
- max/min/and/or/prod/argmax/argmin reductions and top_k over a split dim:
  local candidates, then a combine.
- cumsum & co along a split dim: local scan plus an exclusive scan of the
  shard totals.
- gather over a split indexed dim: indices shifted into the local range,
  rows held elsewhere zeroed, leaving a partial sum; scatter-add the same way,
  and with split update batch dims the operand counted on one shard only.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core.primitives import threefry2x32_p

from ..costs.cost import Collective
from ..costs.hardware import Hardware
from ..representation.factors import FactorSharding, Rule
from ..representation.program import Eqn
from ..representation.sharding import Axes, Sharding
from .reshard import linear_axis_index


@dataclasses.dataclass
class OpContext:
    eqn: Eqn
    rule: Rule
    fs: FactorSharding
    made: Sequence[Sharding]
    mesh_shape: Mapping[str, int]
    need: Sequence[Sharding] = ()
    cache: Optional[dict] = None  # the lowering's per-region cache: values already exchanged (XLA CSEs them)
    profile: Optional[Hardware] = None  # the lowering's, for hooks that choose between exchanges

    def axes(self, factor: str) -> Axes:
        return tuple(a for a in self.fs.get(factor, ()) if self.mesh_shape[a] > 1)

    def group(self, axes: Axes) -> int:
        return math.prod(self.mesh_shape[a] for a in axes)

    def index(self, axes: Axes):
        return linear_axis_index(axes, self.mesh_shape)

    def local_out(self, i: int = 0) -> tuple[int, ...]:
        return self.made[i].local_shape(self.eqn.outvars[i].shape, self.mesh_shape)

    def out_bytes(self, i: int = 0) -> int:
        return int(math.prod(self.local_out(i))) * self.eqn.outvars[i].dtype.itemsize


def _name(axes: Axes):
    return axes if len(axes) > 1 else axes[0]


def _reduced_axes(ctx: OpContext) -> Axes:
    return tuple(a for f in ctx.rule.reductions for a in ctx.axes(f))


# --------------------------------------------------------------------------- communication of each hook

def combine_collectives(ctx: OpContext) -> list[Collective]:
    """max/min/and/or over a split dim: one all-reduce of the local results; prod: gather the shards'."""
    axes = _reduced_axes(ctx)
    if not axes:
        return []
    n, b, shape, dt = ctx.group(axes), ctx.out_bytes(), ctx.local_out(), str(ctx.eqn.outvars[0].dtype)
    if ctx.eqn.name == "reduce_prod":
        return [Collective("all-gather", axes, n, b * n, (n,) + shape, dt, "combine")]
    return [Collective("all-reduce", axes, n, b, shape, dt, "combine")]


def arg_reduce_collectives(ctx: OpContext) -> list[Collective]:
    """argmax/argmin over a split dim: every shard's candidate values and indices gathered."""
    axes = _reduced_axes(ctx)
    if not axes:
        return []
    n, b, shape = ctx.group(axes), ctx.out_bytes(), ctx.local_out()
    x = ctx.eqn.invars[0].aval.dtype
    vb = int(math.prod(shape)) * x.itemsize
    return [Collective("all-gather", axes, n, vb * n, (n,) + shape, str(x), "candidate values"),
            Collective("all-gather", axes, n, b * n, (n,) + shape, str(ctx.eqn.outvars[0].dtype), "candidate indices")]


def top_k_collectives(ctx: OpContext) -> list[Collective]:
    """top_k along a split dim: values and indices of every shard's k candidates gathered."""
    axes = _reduced_axes(ctx)
    if not axes:
        return []
    n, shape = ctx.group(axes), ctx.local_out()
    return [Collective("all-gather", axes, n, ctx.out_bytes() * n, shape, str(ctx.eqn.outvars[0].dtype), "candidates"),
            Collective("all-gather", axes, n, ctx.out_bytes(1) * n, shape, "int32", "candidate indices")]


def cumulative_collectives(ctx: OpContext) -> list[Collective]:
    """cumsum & co along a split dim: the shard totals gathered."""
    axis = ctx.eqn.params["axis"]
    axes = ctx.axes(ctx.rule.operands[0][axis][0])
    if not axes:
        return []
    n, dtype = ctx.group(axes), ctx.eqn.outvars[0].dtype
    shape = list(ctx.local_out())
    shape[axis] = 1
    b = int(math.prod(shape)) * dtype.itemsize
    return [Collective("all-gather", axes, n, b * n, (n,) + tuple(shape), str(dtype), "shard totals")]


def identity_hook(ctx: OpContext, ins, params, bind):
    """An annotation (gs.shard, or a JAX spelling of one): a global-view identity, resolved by the plan."""
    return [ins[0]]


# --------------------------------------------------------------------------- hooks

def iota_hook(ctx: OpContext, ins, params, bind):
    (out,) = bind(*ins, **params)
    d = ctx.eqn.params["dimension"]
    axes = ctx.axes(ctx.rule.results[0][d][0])
    if axes:
        out = out + (ctx.index(axes) * out.shape[d]).astype(out.dtype)
    return [out]


def _pmax(x, name):
    """pmax with a derivative: the tangent of the maximal entries, averaged over ties (as reduce_max)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.pmax(x, name)
    return _pmax_diff(x, name)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _pmax_diff(x, name):
    return jax.lax.pmax(x, name)


@_pmax_diff.defjvp
def _pmax_diff_jvp(name, primals, tangents):
    (x,), (t,) = primals, tangents
    y = jax.lax.pmax(x, name)
    hit = (x == y).astype(x.dtype)
    return y, jax.lax.psum(t * hit, name) / jax.lax.psum(hit, name)


def combine_hook(ctx: OpContext, ins, params, bind):
    (out,) = bind(*ins, **params)
    axes = _reduced_axes(ctx)
    if not axes:
        return [out]
    name, kind = _name(axes), ctx.eqn.name
    if kind == "reduce_max":
        out = _pmax(out, name)
    elif kind == "reduce_min":
        out = -_pmax(-out, name) if jnp.issubdtype(out.dtype, jnp.floating) else jax.lax.pmin(out, name)
    elif kind in ("reduce_and", "reduce_or"):
        y = out.astype(jnp.int32)
        out = (jax.lax.pmin(y, name) if kind == "reduce_and" else jax.lax.pmax(y, name)).astype(out.dtype)
    else:  # reduce_prod
        out = jnp.prod(jax.lax.all_gather(out, name, axis=0), axis=0).astype(out.dtype)
    return [out]


def arg_reduce_hook(ctx: OpContext, ins, params, bind):
    """argmax/argmin over a split dim: local candidates with global indices, then the best of them."""
    (x,) = ins
    (axis,) = ctx.eqn.params["axes"]
    (idx,) = bind(x, **params)
    axes = _reduced_axes(ctx)
    if not axes:
        return [idx]
    val = jnp.take_along_axis(x, jnp.expand_dims(idx, axis).astype(jnp.int32), axis=axis).squeeze(axis)
    gidx = idx + (ctx.index(axes) * x.shape[axis]).astype(idx.dtype)
    vals = jax.lax.all_gather(val, _name(axes), axis=0)
    idxs = jax.lax.all_gather(gidx, _name(axes), axis=0)
    pick = jnp.argmax(vals, axis=0) if ctx.eqn.name == "argmax" else jnp.argmin(vals, axis=0)
    return [jnp.take_along_axis(idxs, pick[None], axis=0)[0]]


def top_k_hook(ctx: OpContext, ins, params, bind):
    """top_k along a split dim: local top-k with global indices, gather the candidates, top-k of those."""
    (x,) = ins
    axis = ctx.eqn.params.get("axis", -1) % x.ndim
    axes = _reduced_axes(ctx)
    k = ctx.eqn.params["k"]
    if axes and x.shape[axis] < k:  # too few local candidates: take the whole dim
        x, axes = jax.lax.all_gather(x, _name(axes), axis=axis, tiled=True), ()
    vals, idx = bind(x, **params)
    if not axes:
        return [vals, idx]
    idx = idx + (ctx.index(axes) * x.shape[axis]).astype(idx.dtype)
    vals = jax.lax.all_gather(vals, _name(axes), axis=axis, tiled=True)
    idx = jax.lax.all_gather(idx, _name(axes), axis=axis, tiled=True)
    best, pos = jax.lax.top_k(jnp.moveaxis(vals, axis, -1), k)
    pick = jnp.take_along_axis(jnp.moveaxis(idx, axis, -1), pos, axis=-1)
    return [jnp.moveaxis(best, -1, axis), jnp.moveaxis(pick, -1, axis)]


# combine(local, prefix) and the masked reduction of the gathered shard totals, per cumulative op.
CUMULATIVE = {
    "cumsum": (jnp.add, lambda g, m: jnp.sum(jnp.where(m, g, 0), axis=0)),
    "cumprod": (jnp.multiply, lambda g, m: jnp.prod(jnp.where(m, g, 1), axis=0)),
    "cummax": (jnp.maximum, lambda g, m: jnp.max(jnp.where(m, g, _lowest(g.dtype)), axis=0)),
    "cummin": (jnp.minimum, lambda g, m: jnp.min(jnp.where(m, g, _highest(g.dtype)), axis=0)),
    "cumlogsumexp": (jnp.logaddexp, lambda g, m: jax.nn.logsumexp(jnp.where(m, g, -jnp.inf), axis=0)),
}


def _lowest(dtype):
    if jnp.issubdtype(dtype, jnp.bool_):
        return False
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _highest(dtype):
    if jnp.issubdtype(dtype, jnp.bool_):
        return True
    return jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max


def cumulative_hook(ctx: OpContext, ins, params, bind):
    """Local scan, then combine with the exclusive scan of the shard totals along the split axis."""
    (out,) = bind(*ins, **params)
    axis, reverse = ctx.eqn.params["axis"], ctx.eqn.params["reverse"]
    axes = ctx.axes(ctx.rule.operands[0][axis][0])
    if not axes:
        return [out]
    combine, reduce_masked = CUMULATIVE[ctx.eqn.name]
    total = jax.lax.slice_in_dim(out, 0 if reverse else out.shape[axis] - 1, 1 if reverse else out.shape[axis],
                                 axis=axis)
    gathered = jax.lax.all_gather(total, _name(axes), axis=0)
    n, me = gathered.shape[0], ctx.index(axes)
    order = jnp.arange(n).reshape((n,) + (1,) * total.ndim)
    before = order > me if reverse else order < me
    prefix = reduce_masked(gathered, before)
    has = jnp.any(before)
    return [jnp.where(has, combine(out, prefix), out)]


def _fill_value(dtype, fill):
    if fill is not None:
        return fill
    if jnp.issubdtype(dtype, jnp.inexact):
        return np.nan
    if jnp.issubdtype(dtype, jnp.bool_):
        return True
    info = jnp.iinfo(dtype)
    return info.min if jnp.issubdtype(dtype, jnp.signedinteger) else info.max


def gather_hook(ctx: OpContext, ins, params, bind):
    operand, indices = ins
    dn = ctx.eqn.params["dimension_numbers"]
    os = ctx.eqn.invars[0].shape
    sizes = list(params["slice_sizes"])
    offset_operand = [d for d in range(len(os))
                      if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for d in offset_operand:
        if sizes[d] == os[d]:
            sizes[d] = operand.shape[d]
    params = dict(params, slice_sizes=tuple(sizes))
    split = [(j, d, ctx.axes(ctx.rule.operands[0][d][0])) for j, d in enumerate(dn.start_index_map)]
    split = [(j, d, ax) for j, d, ax in split if ax and ctx.rule.reductions.get(ctx.rule.operands[0][d][0]) == "sum"]
    if not split:
        return bind(operand, indices, **params)
    fill_drop = ctx.eqn.params["mode"] == jax.lax.GatherScatterMode.FILL_OR_DROP
    keep = jnp.ones(indices.shape[:-1], bool)
    valid = jnp.ones(indices.shape[:-1], bool)
    if fill_drop:  # a window out of range on any indexed dim gives the fill value
        for j, d in enumerate(dn.start_index_map):
            g = indices[..., j]
            valid &= (g >= 0) & (g <= os[d] - ctx.eqn.params["slice_sizes"][d])
    first = jnp.bool_(True)
    for j, d, axes in split:
        g = jnp.clip(indices[..., j], 0, os[d] - 1)
        local = g - (ctx.index(axes) * operand.shape[d]).astype(g.dtype)
        keep &= (local >= 0) & (local < operand.shape[d])
        indices = indices.at[..., j].set(jnp.clip(local, 0, operand.shape[d] - 1))
        first &= ctx.index(axes) == 0
    params = dict(params, mode=jax.lax.GatherScatterMode.CLIP, fill_value=None)
    (out,) = bind(operand, indices, **params)
    expand = lambda m: jnp.expand_dims(m, tuple(dn.offset_dims)) if dn.offset_dims else m
    out = jnp.where(expand(keep & valid), out, jnp.zeros((), out.dtype))
    if fill_drop:
        fill = _fill_value(out.dtype, ctx.eqn.params["fill_value"])
        out = jnp.where(expand(~valid) & first, jnp.asarray(fill, out.dtype), out)
    return [out]


def scatter_hook(ctx: OpContext, ins, params, bind):
    operand, indices, updates = ins
    dn = ctx.eqn.params["dimension_numbers"]
    os = ctx.eqn.invars[0].shape
    batch_axes = _reduced_axes(ctx)
    if batch_axes:  # every shard adds its own updates: count the operand once
        operand = jnp.where(ctx.index(batch_axes) == 0, operand, jnp.zeros((), operand.dtype))
    us = ctx.eqn.invars[2].shape
    window = [d for d in range(len(os)) if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    size = {d: us[dn.update_window_dims[k]] for k, d in enumerate(window)}
    # A split dim whose window is the whole dim lands at 0 on every shard (its index is clamped): not shifted.
    split = [(j, d, ctx.axes(ctx.rule.operands[0][d][0])) for j, d in enumerate(dn.scatter_dims_to_operand_dims)
             if size.get(d) != os[d]]
    split = [(j, d, ax) for j, d, ax in split if ax]
    if split:
        if ctx.eqn.params["mode"] == jax.lax.GatherScatterMode.CLIP:  # clamp globally first, on every dim
            for j, d in enumerate(dn.scatter_dims_to_operand_dims):
                indices = indices.at[..., j].set(jnp.clip(indices[..., j], 0, os[d] - size.get(d, 1)))
        for j, d, axes in split:
            g = indices[..., j]
            indices = indices.at[..., j].set(g - (ctx.index(axes) * operand.shape[d]).astype(g.dtype))
        params = dict(params, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
        # Shifted indices fall outside the shard on all but one device. XLA rewrites such a scatter as a
        # dynamic-update-slice at the clamped index and folds the operand's own slicing into that read,
        # clamping only the sum, so a dropped update would write a value from elsewhere: keep them apart.
        operand = jax.lax.optimization_barrier(operand)
    return bind(operand, indices, updates, **params)


def _add_2x32(hi, lo, add_hi, add_lo):
    """(hi, lo) + (add_hi, add_lo), 64-bit numbers as uint32 pairs (mod 2**64)."""
    out = lo + add_lo
    return hi + add_hi + (out < lo).astype(jnp.uint32), out


def mul_add_2x32(hi: jax.Array, lo: jax.Array, x: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) + x * c mod 2**64, with x uint32 and c a Python int below 2**64, in uint32 arithmetic (JAX
    may run without 64-bit types): 16-bit pieces of x and c, each product exact in 32 bits, shifted into place.
    JAX's partitionable threefry counts a value by its 64-bit flat position (iota_2x32_shape)."""
    for j, xj in enumerate((x & jnp.uint32(0xFFFF), x >> jnp.uint32(16))):
        for k in range(4):
            g = (c >> (16 * k)) & 0xFFFF
            if not g or j + k > 3:
                continue
            p = xj * jnp.uint32(g)  # < 2**32
            zero = jnp.zeros_like(p)
            shifted = {0: (zero, p), 1: (p >> jnp.uint32(16), p << jnp.uint32(16)), 2: (p, zero),
                       3: (p << jnp.uint32(16), zero)}[j + k]
            hi, lo = _add_2x32(hi, lo, *shifted)
    return hi, lo


def random_bits_hook(ctx: OpContext, ins, params, bind):
    """Partitionable threefry: bits at global position p are threefry(key, p), so compute them locally. A key
    array's bits: each device's keys draw their own (whole) rows, as the primitive does."""
    (key,) = ins
    if ctx.eqn.invars[0].shape:
        return bind(key, **params)
    gshape = tuple(ctx.eqn.params["shape"])
    if math.prod(gshape) > 2 ** 64:
        raise NotImplementedError("random bits array of size exceeding 2 ** 64")  # as JAX's own
    local = ctx.local_out()
    hi = lo = jnp.zeros(local, jnp.uint32)  # each value's global flat position, 64 bits as JAX counts them
    stride = 1
    for d in reversed(range(len(gshape))):
        axes = ctx.axes(ctx.rule.results[0][d][0])
        pos = jax.lax.broadcasted_iota(jnp.uint32, local, d)
        if axes:
            pos = pos + (ctx.index(axes) * local[d]).astype(jnp.uint32)
        hi, lo = mul_add_2x32(hi, lo, pos, stride)
        stride *= gshape[d]
    k = jax.random.key_data(key)
    bits1, bits2 = threefry2x32_p.bind(k[0], k[1], hi, lo)
    width = ctx.eqn.params["bit_width"]
    dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[width]
    if width == 64:
        hi, lo = bits1.astype(dtype), bits2.astype(dtype)
        return [jax.lax.shift_left(hi, jnp.asarray(32, dtype)) | lo]
    if width == 32:
        return [bits1 ^ bits2]
    return [(bits1 ^ bits2).astype(dtype)]


def dynamic_slice_hook(ctx: OpContext, ins, params, bind):
    """Start indices clamped here, as dynamic_slice would: XLA folds a following slice into this one
    (adding the offsets) and then clamps the sum, which differs when the start index was out of range."""
    sizes = ctx.local_out()
    starts = [jnp.clip(i, 0, n - s).astype(i.dtype) for i, n, s in zip(ins[1:], ins[0].shape, sizes)]
    return bind(ins[0], *starts, **dict(params, slice_sizes=sizes))


# --------------------------------------------------------------------------- padding of uneven splits

def _identity(kind: str, dtype):
    if kind in ("sum", "or"):
        return jnp.zeros((), dtype)
    if kind in ("prod", "and"):
        return jnp.ones((), dtype)
    if kind in ("max", "argmax", "top_k", "cummax", "cumlogsumexp"):
        return jnp.asarray(_lowest(dtype), dtype)
    if kind in ("min", "argmin", "cummin"):
        return jnp.asarray(_highest(dtype), dtype)
    raise AssertionError(kind)


# Which factors' padding an op would read, and the identity kind that neutralises it (registry.Op.padding).
def reduced_padding(ctx: OpContext) -> dict[str, str]:
    """An op reads the padding of the factors it reduces over (most ops)."""
    return dict(ctx.rule.reductions)


def no_padding(ctx: OpContext) -> dict[str, str]:
    """An op that reads no padding (gather: only valid rows are ever indexed)."""
    return {}


def scan_padding(kind: str, ctx: OpContext) -> dict[str, str]:
    """A cumulative op reads the padding along its axis: neutralised by its own identity (`kind`)."""
    return {ctx.rule.operands[0][ctx.eqn.params["axis"]][0]: kind}


def mask_padding(ctx: OpContext, ins: list, padding=reduced_padding, operands: Optional[Sequence[int]] = None) -> list:
    """Replace the padding of uneven split dims that the op reduces over by the op's identity. padding: ctx ->
    the factors whose padding the op reads and their identity kinds; operands: the only operands masked (None:
    all; a scatter-add masks its updates, whose indices then add zeros)."""
    if not any(n.padded for n in ctx.need):
        return ins
    kinds = padding(ctx)
    out = list(ins)
    for i, (x, need, tf) in enumerate(zip(ins, ctx.need, ctx.rule.operands)):
        if not need.padded or not hasattr(x, "ndim"):
            continue
        if operands is not None and i not in operands:
            continue
        for d in need.padded:
            (f,) = tf[d]
            if f not in kinds:
                continue
            size = ctx.eqn.invars[i].shape[d]
            axes = ctx.axes(f)
            pos = jax.lax.broadcasted_iota(jnp.int32, x.shape, d)
            if axes:
                pos = pos + ctx.index(axes) * x.shape[d]
            out[i] = jnp.where(pos < size, out[i], _identity(kinds[f], x.dtype))
    return out
