"""Re-laying blocks of a split dim: target arrays whose blocks are made of rows of source arrays' blocks.

The engine behind split and concatenate on a split dim (reorder.py): which rows each device copies, which it
receives as packets, and whether the packets travel in rounds of collective-permutes or one all-to-all,
whichever the cost model finds faster.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..costs.cost import Collective
from ..costs.hardware import Hardware
from .halo import ppermute
from .reshard import linear_axis_index, mesh_order_index


@dataclasses.dataclass(frozen=True)
class Move:
    """Rows [at, at + rows) of source a's block on device s become rows [to, to + rows) of target b's block on
    device d (devices numbered row-major over the split dim's axes)."""
    a: int
    s: int
    at: int
    b: int
    d: int
    to: int
    rows: int


@dataclasses.dataclass(frozen=True)
class Relayout:
    """Target arrays whose blocks (k per array along one dim) are made of rows of the source arrays' blocks.

    Rows a device holds are copied. The others travel as packets, one per (source device, target device):
    either in rounds of collective-permutes (each round a matching: every device sends and receives at most
    one packet, padded to the round's largest), or in one all-to-all (every packet padded to the largest),
    whichever the cost model finds faster: the all-to-all where the layout is a transposition of the blocks
    or messages are small, the rounds where they move fewer bytes.
    """
    k: int
    src_block: tuple[int, ...]
    dst_block: tuple[int, ...]
    moves: tuple[Move, ...]
    all_to_all: bool = False

    @functools.cached_property
    def packets(self) -> dict[tuple[int, int], list[Move]]:
        """The moves from device s to another device d, in the order they are sent."""
        out: dict[tuple[int, int], list[Move]] = {}
        for m in self.moves:
            if m.s != m.d:
                out.setdefault((m.s, m.d), []).append(m)
        return out

    def size(self, pair: tuple[int, int]) -> int:
        return sum(m.rows for m in self.packets[pair])

    @functools.cached_property
    def rounds(self) -> list[tuple[list[tuple[int, int]], int]]:
        """(source-target pairs, rows sent) of each collective-permute: packets taken largest first, each into
        the first round where its sender and receiver are free; or one round per shift (d - s mod k) if
        that sends fewer rows."""
        greedy: list[list] = []  # [pairs, senders, receivers, rows]
        for p in sorted(self.packets, key=lambda p: (-self.size(p), (p[1] - p[0]) % self.k, p)):
            for r in greedy:
                if p[0] not in r[1] and p[1] not in r[2]:
                    r[0].append(p), r[1].add(p[0]), r[2].add(p[1])
                    break
            else:
                greedy.append([[p], {p[0]}, {p[1]}, self.size(p)])
        shifts = []
        for h in range(1, self.k):
            pairs = [p for p in self.packets if (p[1] - p[0]) % self.k == h]
            if pairs:
                shifts.append((pairs, max(self.size(p) for p in pairs)))
        out = [(r[0], r[3]) for r in greedy]
        cost = lambda rs: (sum(n for _, n in rs), len(rs))
        return [(sorted(p), n) for p, n in min(out, shifts, key=cost)]

    @property
    def chunk(self) -> int:
        """Rows each device sends each peer in the all-to-all: the largest packet."""
        return max((self.size(p) for p in self.packets), default=0)


def relayout(k: int, src_block: Sequence[int], dst_block: Sequence[int], segments: Sequence[tuple],
             row_bytes: int, axes: tuple, profile: Hardware) -> Relayout:
    """The moves that build each target block, and how they travel. segments: (a, a0, b, b0, n), target b's
    global rows [b0, b0 + n) are source a's rows [a0, a0 + n); rows of no segment (a target's padding) are
    left unset. row_bytes: the bytes of one row of a block."""
    out = []
    for a, a0, b, b0, n in segments:
        S, T = src_block[a], dst_block[b]
        if n <= 0 or not S or not T:
            continue
        for d in range(k):
            lo, hi = max(b0, d * T), min(b0 + n, (d + 1) * T)
            while lo < hi:  # target rows [lo, hi) held by d, split at the source's block boundaries
                src = a0 + lo - b0
                s = src // S
                take = min(hi - lo, (s + 1) * S - src)
                out.append(Move(a, s, src - s * S, b, d, lo - d * T, take))
                lo += take
    plan = Relayout(k, tuple(src_block), tuple(dst_block), tuple(out))
    if len(plan.rounds) < 2:
        return plan
    permutes = sum(Collective("collective-permute", axes, 2, n * row_bytes).time(profile) for _, n in plan.rounds)
    exchange = Collective("all-to-all", axes, k, k * plan.chunk * row_bytes).time(profile)
    return dataclasses.replace(plan, all_to_all=True) if exchange < permutes else plan


def relayout_collectives(plan: Relayout, shape: Sequence[int], dim: int, axes: tuple, dtype,
                         what: str) -> list[Collective]:
    """What `run_relayout` sends; shape: a block's local shape (its dim is replaced by the rows sent)."""
    def of(rows: int) -> tuple[tuple[int, ...], int]:
        s = list(shape)
        s[dim] = rows
        return tuple(s), math.prod(s) * dtype.itemsize

    if plan.all_to_all:
        s, nbytes = of(plan.k * plan.chunk)
        return [Collective("all-to-all", axes, plan.k, nbytes, s, str(dtype),
                           f"{what}: {plan.chunk} rows to each peer")]
    out = []
    for pairs, rows in plan.rounds:
        s, nbytes = of(rows)
        out.append(Collective("collective-permute", axes, max(len(pairs), 2), nbytes, s, str(dtype),
                              f"{what}: {rows} rows to each of {len(pairs)} devices"))
    return out


def _jax_index(axes: tuple, mesh_shape) -> list[int]:
    """For each row-major index over `axes`, the device's index in a collective over the same axes."""
    return [mesh_order_index(j, axes, mesh_shape) for j in range(math.prod(mesh_shape[a] for a in axes))]


def _assemble(pool, dim: int, rows: int, table: list, index):
    """A block of `rows` rows along dim: per device, [(row in pool, row in block, rows)]; other rows zero."""
    shape = list(pool.shape)
    shape[dim] = rows
    zeros = lambda n: jnp.zeros(shape[:dim] + [n] + shape[dim + 1:], pool.dtype)
    if not any(table):  # an empty block, or one made only of padding
        return zeros(rows)
    if all(t == table[0] for t in table):  # the same on every device: static slices
        parts, at = [], 0
        for start, to, n in table[0]:
            if to > at:
                parts.append(zeros(to - at))
            parts.append(jax.lax.slice_in_dim(pool, start, start + n, axis=dim))
            at = to + n
        if at < rows:
            parts.append(zeros(rows - at))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=dim)
    slots = max(len(t) for t in table)
    tabs = np.zeros((3, slots, len(table)), np.int32)
    for d, t in enumerate(table):
        for j, (start, to, n) in enumerate(t):
            tabs[:, j, d] = (start - to + rows, to, n)
    here = jnp.asarray(tabs)[:, :, index]
    padded = jnp.pad(pool, [(rows, rows) if e == dim else (0, 0) for e in range(pool.ndim)])
    row = jax.lax.broadcasted_iota(jnp.int32, shape, dim)
    out = zeros(rows)
    for j in range(slots):
        win = jax.lax.dynamic_slice_in_dim(padded, here[0, j], rows, axis=dim)
        out = jnp.where((row >= here[1, j]) & (row < here[1, j] + here[2, j]), win, out)
    return out


def run_relayout(plan: Relayout, srcs: list, dim: int, axes: tuple, mesh_shape) -> list:
    """The targets' local blocks from the sources' (inside shard_map; see Relayout)."""
    index = linear_axis_index(axes, mesh_shape)
    k = plan.k
    src_at = np.cumsum([0] + [x.shape[dim] for x in srcs]).tolist()
    src_pool = srcs[0] if len(srcs) == 1 else jnp.concatenate(srcs, axis=dim)
    parts, base = [src_pool], src_at[-1]
    arrived: dict[tuple[int, int], int] = {}  # (s, d) -> the packet's first row in d's pool

    def send_table(place) -> list:
        table = [[] for _ in range(k)]
        for (s, d), ms in plan.packets.items():
            at = place(s, d)
            if at is None:
                continue
            for m in ms:
                table[s].append((src_at[m.a] + m.at, at, m.rows))
                at += m.rows
        return [sorted(t, key=lambda e: e[1]) for t in table]

    if plan.all_to_all:
        C, jax_index = plan.chunk, _jax_index(axes, mesh_shape)
        buf = _assemble(src_pool, dim, k * C, send_table(lambda s, d: jax_index[d] * C), index)
        shape = list(buf.shape)
        y = jnp.moveaxis(buf.reshape(shape[:dim] + [k, C] + shape[dim + 1:]), dim, 0)
        order = tuple(a for a in mesh_shape if a in axes)
        y = jax.lax.all_to_all(y, order if len(order) > 1 else order[0], 0, 0, tiled=True)
        parts.append(jnp.moveaxis(y, 0, dim).reshape(shape))
        arrived = {(s, d): base + jax_index[s] * C for s, d in plan.packets}
    else:
        for pairs, rows in plan.rounds:
            members = set(pairs)
            buf = _assemble(src_pool, dim, rows, send_table(lambda s, d: 0 if (s, d) in members else None), index)
            parts.append(ppermute(buf, axes, pairs, mesh_shape))
            arrived.update({p: base for p in pairs})
            base += rows
    pool = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=dim)
    offset: dict[int, int] = {}  # id(move) -> its first row in the receiver's pool
    for (s, d), ms in plan.packets.items():
        at = arrived[(s, d)]
        for m in ms:
            offset[id(m)] = at
            at += m.rows
    outs = []
    for b, rows in enumerate(plan.dst_block):
        table = [[] for _ in range(k)]
        for m in plan.moves:
            if m.b == b:
                start = src_at[m.a] + m.at if m.s == m.d else offset[id(m)]
                table[m.d].append((start, m.to, m.rows))
        outs.append(_assemble(pool, dim, rows, [sorted(t, key=lambda e: e[1]) for t in table], index))
    return outs
