"""The geometry of windowed ops on split dims: each spatial dim's window, and the rows (a Halo) each shard's
windows read. windowed.py builds rules and hooks on it."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ..representation.program import Eqn, shape_of
from .halo import Halo

CONV = "conv_general_dilated"
POOLS = {"reduce_window_sum": "sum", "reduce_window_max": "max", "reduce_window_min": "min"}
SCATTER = "select_and_scatter_add"  # max pooling's transpose: (source [output rows], operand) -> operand shape
GATHER = "select_and_gather_add"  # max pooling's JVP: (tangent, operand) -> the tangent at each window's max
GENERIC = "reduce_window"  # lax.reduce_window with any computation: (operands..., init values...) -> results...


def _input(eqn: Eqn) -> int:
    """The operand whose rows the windows read."""
    return 1 if eqn.name == SCATTER else 0


@dataclasses.dataclass(frozen=True)
class Spatial:
    """One spatial dim of a windowed op: where it sits and its window geometry."""
    lhs: int  # dim of the input
    rhs: Optional[int]  # dim of the kernel (convolutions)
    out: int  # dim of the result
    size: int  # N: input rows
    window: int  # T: window (kernel) rows
    out_size: int  # O: output rows
    stride: int
    lo: int  # padding (may be negative)
    hi: int
    base: int  # lhs (base) dilation
    dilation: int  # window (rhs) dilation
    contracted: bool  # the split goes to the window rows (a partial sum), not to the output rows


def spatial_dims(eqn: Eqn) -> list[Spatial]:
    p = eqn.params
    x = shape_of(eqn.invars[_input(eqn)])
    out = shape_of(eqn.invars[0] if eqn.name == SCATTER else eqn.outvars[0])
    n = len(x)
    ones = (1,) * n
    if eqn.name == CONV:
        dn, w = p["dimension_numbers"], shape_of(eqn.invars[1])
        dims = [(a, r, o, w[r]) for a, r, o in zip(dn.lhs_spec[2:], dn.rhs_spec[2:], dn.out_spec[2:])]
        strides, pads, base, dil = p["window_strides"], p["padding"], p["lhs_dilation"], p["rhs_dilation"]
    elif eqn.name == "pad":  # a window of 1 over the input dilated by interior+1 and padded
        dims = [(d, None, d, 1) for d in range(n)]
        cfg = p["padding_config"]
        strides, pads, base, dil = ones, [(lo, hi) for lo, hi, _ in cfg], [i + 1 for _, _, i in cfg], ones
    elif eqn.name == "slice":  # a window of 1, strided, with the cut rows as negative padding
        dims = [(d, None, d, 1) for d in range(n)]
        strides = p.get("strides") or ones
        pads = [(-a, b - size) for a, b, size in zip(p["start_indices"], p["limit_indices"], x)]
        base, dil = ones, ones
    else:
        dims = [(d, None, d, p["window_dimensions"][d]) for d in range(n)]
        strides, pads = p["window_strides"], p["padding"]
        base, dil = p.get("base_dilation", ones), p.get("window_dilation", ones)
    result = []
    for k, (a, r, o, t) in enumerate(dims):
        lo, hi = pads[k]
        contracted = eqn.name == CONV and t > out[o]
        result.append(Spatial(a, r, o, x[a], t, out[o], strides[k], lo, hi, base[k], dil[k], contracted))
    return result


def _plain(sp: Spatial) -> bool:
    return (sp.window, sp.stride, sp.lo, sp.hi, sp.base, sp.dilation) == (1, 1, 0, 0, 1, 1)


def halo(sp: Spatial, k: int, S: int, local: int, shifted: bool = True) -> Optional[Halo]:
    """The rows each of k shards needs; `local` is the local output rows (or window rows when contracted).

    Where the shards of a base-dilated input start at different dilation phases (step % base != 0), each
    receives a wider window whose start is linear in its index, computes `shift` more results per later
    shard, and keeps its block at index * shift (`shifted`; stride and phase must agree). None: not possible
    (a contracted window, a stride that splits the phase), the dim is gathered."""
    extent = 1 + (sp.window - 1) * sp.dilation
    if sp.contracted:
        unit, total = sp.dilation, sp.window
        span = lambda v: (v - 1) * sp.dilation + (sp.out_size - 1) * sp.stride + 1
    else:
        unit, total = sp.stride, sp.out_size
        span = lambda v: (v - 1) * sp.stride + extent
    step = local * unit
    phase = step % sp.base
    if phase and (sp.contracted or not shifted or phase % sp.stride):
        return None
    shift = phase // sp.stride  # extra results per shard index
    lo, first = sp.lo % sp.base, -(sp.lo // sp.base)
    last = lambda i, v: (i * step + span(v) - 1 - sp.lo) // sp.base  # the last input row shard i's v results read
    if phase:  # the window of shard k-1, the widest (starts are linear in i, ends grow by step / base)
        rows = last(k - 1, local) - ((k - 1) * (step // sp.base) + first) + 1
    else:
        rows = -(-(span(local) - lo) // sp.base)
    reads = []
    for i in range(k):  # only valid results (the padding of an uneven split reads nothing) and rows in [0, N)
        v = min(max(total - i * local, 0), local)
        a, b = max(-(-(i * step - sp.lo) // sp.base), 0), min(last(i, v) + 1, sp.size)
        reads.append((a, b) if v and b > a else (0, 0))
    width = (local + (k - 1) * shift - 1) * unit + extent if phase else span(local)  # dilated rows computed
    return Halo(k, S, sp.size, step // sp.base, first, rows, lo, width - 1 - (rows - 1) * sp.base - lo,
                tuple(reads), shift)
