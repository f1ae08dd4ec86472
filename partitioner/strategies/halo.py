"""Halo exchange: the rows of a split dim that each device's windows read, received from its neighbours.

Shard i of a dim split k ways (blocks of S rows; the global dim has N rows,
padded to k*S) needs global rows [i*step + first, i*step + first + rows).
`exchange` sends each device the rows beyond its own block by one
collective-permute per hop (a window wider than a block takes several),
slices the window (statically when every device's window starts at the
same offset in its block, else at a device-dependent one) and sets rows
outside [0, N) to a pad value. Only rows some device's valid results read are
sent (`reads`): not the input's padded tail, rows outside [0, N), or rows only
the padding of an uneven result reads; the window's other rows are zeros. windowed.py and reorder.py build every
windowed op and every reordering on it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..costs.cost import Collective
from .reshard import mesh_order_index


@dataclasses.dataclass(frozen=True)
class Halo:
    """Shard i needs input rows [i*step + first, i*step + first + rows) of the global input (N rows, stored
    as k blocks of S); its local op then runs with padding (lo, hi) on those rows."""
    k: int
    S: int
    N: int
    step: int
    first: int
    rows: int
    lo: int
    hi: int
    reads: Optional[tuple[tuple[int, int], ...]] = None  # per shard, the rows [a, b) inside [0, N) its valid
    # results read (None: its whole window); the rest of the window only reaches results' padding
    shift: int = 0  # shards of a base-dilated input out of phase: shard i keeps its results from i * shift

    def _extent(self) -> tuple[int, int]:
        """Rows of the window left and right of the shard's block (the window's geometry)."""
        left = [i * self.S - (i * self.step + self.first) for i in (0, self.k - 1)]
        right = [i * self.step + self.first + self.rows - (i + 1) * self.S for i in (0, self.k - 1)]
        return max(0, *left), max(0, *right)

    def _sent(self) -> tuple[int, int]:
        """Rows left and right of the block that some shard must receive (at most _extent)."""
        if self.reads is None:
            return self._extent()
        spans = [(i, a, b) for i, (a, b) in enumerate(self.reads) if b > a]
        return (max([0] + [i * self.S - a for i, a, _ in spans]),
                max([0] + [b - (i + 1) * self.S for i, _, b in spans]))

    def pieces(self) -> list[tuple[int, int]]:
        """(hop, rows) of each collective-permute: negative hops bring rows from the left neighbours."""
        left, right = self._sent()
        out = []
        for side, total in ((-1, left), (1, right)):
            if not self.S:  # an empty piece: nothing to send
                continue
            hops = -(-total // self.S)
            for h in range(1, hops + 1):
                if h < self.k:
                    out.append((side * h, self.S if h < hops else total - (hops - 1) * self.S))
        return out

    def masked(self) -> bool:
        """Whether some shard's window reaches outside the input's N rows (padding, uneven tail)."""
        return self.first < 0 or (self.k - 1) * self.step + self.first + self.rows > self.N


def ppermute(x, axes: tuple, pairs: list, mesh_shape):
    """ppermute with pairs of row-major indices over `axes` (major first). JAX numbers the devices of a tuple
    of axes in mesh order, so the pairs are renumbered when `axes` lists them in another order."""
    order = tuple(a for a in mesh_shape if a in axes)
    if order != tuple(axes):
        pairs = [(mesh_order_index(s, axes, mesh_shape), mesh_order_index(t, axes, mesh_shape)) for s, t in pairs]
    return jax.lax.ppermute(x, order if len(order) > 1 else order[0], pairs)


def exchange(x, dim: int, axes: tuple, h: Halo, index, pad_value, mesh_shape, cache=None, key=None):
    """x's rows [i*step + first, ... + rows) of the global input, with rows outside it set to pad_value.
    Pieces already received for the same value (cache[key + piece]) are reused, as XLA's CSE would."""
    left_rows, right_rows = h._extent()
    parts_left, parts_right = [], []
    for hop, rows in h.pieces():
        piece_key = None if cache is None or key is None else key + (dim, axes, hop, rows)
        if piece_key is not None and piece_key in cache:
            got = cache[piece_key]
        elif hop < 0:
            part = jax.lax.slice_in_dim(x, h.S - rows, h.S, axis=dim)
            got = ppermute(part, axes, [(j, j - hop) for j in range(h.k + hop)], mesh_shape)
        else:
            part = jax.lax.slice_in_dim(x, 0, rows, axis=dim)
            got = ppermute(part, axes, [(j + hop, j) for j in range(h.k - hop)], mesh_shape)
        if piece_key is not None:
            cache[piece_key] = got
        if hop < 0:
            parts_left.insert(0, got)
        else:
            parts_right.append(got)
    for parts, total, at in ((parts_left, left_rows, 0), (parts_right, right_rows, None)):
        have = sum(p.shape[dim] for p in parts)
        if total > have:  # hops past the last shard: nothing to receive, rows outside the input
            zshape = list(x.shape)
            zshape[dim] = total - have
            z = jnp.zeros(zshape, x.dtype)
            parts.insert(0, z) if at == 0 else parts.append(z)
    ext = jnp.concatenate(parts_left + [x] + parts_right, axis=dim) if parts_left or parts_right else x
    # ext holds global rows [i*S - left_rows, ...); the window starts at i*step + first.
    if h.S == h.step:
        start = left_rows + h.first
        full = start == 0 and h.rows == ext.shape[dim]
        win = ext if full else jax.lax.slice_in_dim(ext, start, start + h.rows, axis=dim)
    else:
        start = left_rows + h.first + index * (h.step - h.S)
        win = jax.lax.dynamic_slice_in_dim(ext, start, h.rows, axis=dim)
    if pad_value is None or not h.masked():  # None: rows outside the input only reach result padding
        return win
    row = jax.lax.broadcasted_iota(jnp.int32, win.shape, dim) + index * h.step + h.first
    return jnp.where((row >= 0) & (row < h.N), win, jnp.asarray(pad_value, win.dtype))


def gather_rows(x, dim: int, axes: tuple, size: int, pad_value):
    """The whole dim (every block gathered, one axis at a time from the minor one, so blocks land in
    row-major order whatever the mesh order), rows past `size` set to pad_value."""
    full = x
    for a in reversed(axes):
        full = jax.lax.all_gather(full, a, axis=dim, tiled=True)
    row = jax.lax.broadcasted_iota(jnp.int32, full.shape, dim)
    return jnp.where(row < size, full, jnp.asarray(pad_value, full.dtype))


def gather_collectives(shape: list, dim: int, axes: tuple, dtype: str, itemsize: int, mesh_shape, note: str) -> list:
    """The per-axis all-gathers of gather_rows (minor axis first); grows shape[dim] in place."""
    out = []
    for a in reversed(axes):
        n = mesh_shape[a]
        before = tuple(shape)
        shape[dim] *= n
        out.append(Collective("all-gather", (a,), n, math.prod(shape) * itemsize, before, dtype, note))
    return out


def pad_value(kind: str, dtype):
    if kind == "sum":
        return 0
    info = jnp.finfo(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype)
    if kind == "max":
        return -np.inf if jnp.issubdtype(dtype, jnp.floating) else info.min
    return np.inf if jnp.issubdtype(dtype, jnp.floating) else info.max
