"""Resharding: from one sharding to another in the fewest, cheapest collectives.

A change of padding (see sharding.py) happens where the dim is whole: the
dim is gathered, padded or cut locally, then split again. Otherwise the
order is Shardy's reshard-to-collectives: partial axes are reduced first
(reduce-scatter where the target splits a dim on that axis, else all-reduce);
then a single collective-permute when only the device order of equal tiles
differs; then, repeatedly, all-slice (free), all-to-all (an axis moves between
dims), all-gather. ``plan`` is pure (used by the cost model); ``apply`` runs
the steps on a local shard inside shard_map.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from ..costs.cost import Collective
from ..representation.sharding import Axes, Sharding


@dataclasses.dataclass(frozen=True)
class Step:
    kind: str  # all-slice | collective-permute | all-to-all | all-gather | all-reduce | reduce-scatter
    axes: Axes
    before: Sharding
    after: Sharding
    dim: Optional[int] = None  # all-slice / all-gather / reduce-scatter dim; all-to-all: the dim that gets split
    src_dim: Optional[int] = None  # all-to-all: the dim that gets gathered
    perm: tuple[tuple[int, int], ...] = ()  # collective-permute pairs over `axes`
    size: int = 0  # pad / unpad: the dim's new global size


def _is_prefix(a: Axes, b: Axes) -> bool:
    return b[: len(a)] == a


def _lin_coords(mesh_shape: Mapping[str, int], axes: Axes):
    """All device coordinates over `axes`, in row-major (linear index) order."""
    return list(itertools.product(*(range(mesh_shape[a]) for a in axes)))


def _permutation(src: Sharding, dst: Sharding, mesh_shape, mesh_axes: Sequence[str]):
    """Pairs (source, target) over the involved axes when dst is src's tiles on other devices."""
    axes = tuple(a for a in mesh_axes if a in (src.axes | dst.axes))
    holders: dict = {}
    coords = _lin_coords(mesh_shape, axes)
    for lin, c in enumerate(coords):
        holders.setdefault(src.tile_index(dict(zip(axes, c)), mesh_shape), []).append(lin)
    wanted: dict = {}
    for lin, c in enumerate(coords):
        wanted.setdefault(dst.tile_index(dict(zip(axes, c)), mesh_shape), []).append(lin)
    if set(holders) != set(wanted) or any(len(holders[t]) != len(wanted[t]) for t in holders):
        return None
    pairs = tuple((s, t) for tile in holders for s, t in zip(sorted(holders[tile]), sorted(wanted[tile])))
    return axes, pairs


def plan(src: Sharding, dst: Sharding, shape: Sequence[int], mesh_shape: Mapping[str, int],
         mesh_axes: Sequence[str]) -> list[Step]:
    """The steps that turn a value sharded as `src` into one sharded as `dst` (dst is never partial): partial
    sums reduced first (scattered where dst splits the dim), then one collective-permute where only the
    order of the devices differs, else all-slices, all-to-alls and all-gathers, in that preference."""
    if dst.partial:
        raise ValueError(f"cannot reshard to a partial sharding {dst}")
    src, dst = _strip(src, mesh_shape), _strip(dst, mesh_shape)
    mesh_axes = [a for a in mesh_axes if mesh_shape[a] > 1]
    if src.padded != dst.padded:
        return _repadded(src, dst, shape, mesh_shape, mesh_axes)
    steps, cur = _reduced(src, dst, shape, mesh_shape, mesh_axes)
    if cur == dst:
        return steps
    if all(cur.tiles(d, mesh_shape) == dst.tiles(d, mesh_shape) for d in range(cur.rank)) and cur.axes == dst.axes:
        found = _permutation(cur, dst, mesh_shape, mesh_axes)
        if found is not None:
            axes, pairs = found
            steps.append(Step("collective-permute", axes, cur, dst, perm=pairs))
            return steps
    for _ in range(4 * (len(mesh_axes) + 1) * max(cur.rank, 1)):
        if cur == dst:
            break
        made = _slices(cur, dst) or [step for step in (_swap(cur, dst) or _gather(cur, dst),) if step]
        if not made:
            raise AssertionError(f"reshard made no progress from {cur} to {dst}")
        steps += made
        cur = made[-1].after
    if cur != dst:
        raise AssertionError(f"reshard did not reach {dst} from {src}")
    return steps


def _repadded(src: Sharding, dst: Sharding, shape: Sequence[int], mesh_shape: Mapping[str, int],
              mesh_axes: Sequence[str]) -> list[Step]:
    """A change of padding, made where the dim is whole: gather it, pad or cut locally, then go on."""
    change = src.padded ^ dst.padded
    mid = Sharding(tuple(() if d in change else ax for d, ax in enumerate(src.dims)), frozenset(), src.padded)
    steps = plan(src, mid, shape, mesh_shape, mesh_axes)
    cur = mid
    for d in sorted(change):
        nxt = dataclasses.replace(cur, padded=cur.padded ^ {d})
        kind = "pad" if d in dst.padded else "unpad"
        steps.append(Step(kind, (), cur, nxt, dim=d, size=nxt.physical_shape(shape, mesh_shape)[d]))
        cur = nxt
    return steps + plan(cur, dst, shape, mesh_shape, mesh_axes)


def _reduced(src: Sharding, dst: Sharding, shape: Sequence[int], mesh_shape: Mapping[str, int],
             mesh_axes: Sequence[str]) -> tuple[list[Step], Sharding]:
    """(The steps, the sharding after them) that reduce src's partial sums: a reduce-scatter onto each dim dst
    splits further over partial axes (where the dim divides), an all-reduce over the rest."""
    steps: list[Step] = []
    cur = src
    if not cur.partial:
        return steps, cur
    dims = list(cur.dims)
    scatter: dict[int, Axes] = {}
    physical = cur.physical_shape(shape, mesh_shape)
    for d, want in enumerate(dst.dims):
        if not _is_prefix(dims[d], want):
            continue
        extra = ()
        for a in want[len(dims[d]):]:
            if a in cur.partial and a not in extra:
                extra += (a,)
            else:
                break
        if extra and physical[d] % (math.prod(mesh_shape[a] for a in dims[d] + extra)) == 0:
            scatter[d] = extra
    for d, axes in scatter.items():
        nxt = Sharding(tuple(cur.dims[:d]) + (cur.dims[d] + axes,) + tuple(cur.dims[d + 1:]),
                       cur.partial - set(axes), cur.padded)
        steps.append(Step("reduce-scatter", axes, cur, nxt, dim=d))
        cur = nxt
    if cur.partial:
        rest = tuple(a for a in mesh_axes if a in cur.partial)
        nxt = cur.without_partial()
        steps.append(Step("all-reduce", rest, cur, nxt))
        cur = nxt
    return steps, cur


def _slices(cur: Sharding, dst: Sharding) -> list[Step]:
    """All-slices: append to each dim the axes dst adds after it that no dim uses yet."""
    steps = []
    for d in range(cur.rank):
        while (_is_prefix(cur.dims[d], dst.dims[d]) and len(cur.dims[d]) < len(dst.dims[d])
               and dst.dims[d][len(cur.dims[d])] not in cur.axes):
            a = dst.dims[d][len(cur.dims[d])]
            nxt = _with_dim(cur, d, cur.dims[d] + (a,))
            steps.append(Step("all-slice", (a,), cur, nxt, dim=d))
            cur = nxt
    return steps


def _swap(cur: Sharding, dst: Sharding) -> Optional[Step]:
    """An all-to-all: the minor axis of a dim that must lose it is the next axis another dim wants."""
    for d in range(cur.rank):
        if not cur.dims[d] or _is_prefix(cur.dims[d], dst.dims[d]):
            continue
        a = cur.dims[d][-1]
        for e in range(cur.rank):
            if e != d and _is_prefix(cur.dims[e], dst.dims[e]) and len(cur.dims[e]) < len(dst.dims[e]) \
                    and dst.dims[e][len(cur.dims[e])] == a:
                nxt = _with_dim(_with_dim(cur, d, cur.dims[d][:-1]), e, cur.dims[e] + (a,))
                return Step("all-to-all", (a,), cur, nxt, dim=e, src_dim=d)
    return None


def _gather(cur: Sharding, dst: Sharding) -> Optional[Step]:
    """An all-gather: the minor axes of the first dim that is not a prefix of its target, until it is."""
    for d in range(cur.rank):
        if not _is_prefix(cur.dims[d], dst.dims[d]):
            keep = 0
            while keep < len(cur.dims[d]) and keep < len(dst.dims[d]) and cur.dims[d][keep] == dst.dims[d][keep]:
                keep += 1
            return Step("all-gather", cur.dims[d][keep:], cur, _with_dim(cur, d, cur.dims[d][:keep]), dim=d)
    return None


def _strip(s: Sharding, mesh_shape) -> Sharding:
    """Drop size-1 mesh axes: they split nothing and need no communication."""
    return Sharding(tuple(tuple(a for a in d if mesh_shape[a] > 1) for d in s.dims),
                    frozenset(a for a in s.partial if mesh_shape[a] > 1), s.padded)


def _with_dim(s: Sharding, d: int, axes: Axes) -> Sharding:
    return dataclasses.replace(s, dims=tuple(s.dims[:d]) + (tuple(axes),) + tuple(s.dims[d + 1:]))


LOCAL = ("all-slice", "pad", "unpad")


def collectives(steps: Sequence[Step], shape: Sequence[int], dtype, mesh_shape: Mapping[str, int]) -> list[Collective]:
    """The communication of a reshard, per device, as the compiled HLO shows it."""
    itemsize = dtype.itemsize  # also for extended dtypes (PRNG keys)
    out = []
    for st in steps:
        if st.kind in LOCAL:
            continue
        group = math.prod(mesh_shape[a] for a in st.axes)
        if st.kind == "reduce-scatter":
            local = st.before.local_shape(shape, mesh_shape)
        elif st.kind == "collective-permute":
            local = st.after.local_shape(shape, mesh_shape)
            group = len(st.perm)
        else:
            local = st.after.local_shape(shape, mesh_shape)
        size = 4 if st.kind == "reduce-scatter" and str(dtype) == "bool" else itemsize  # see apply()
        out.append(Collective(st.kind, st.axes, group, int(math.prod(local)) * size, tuple(local), str(dtype)))
    return out


def mesh_order_index(j: int, axes: Sequence[str], mesh_shape: Mapping[str, int]) -> int:
    """Device j of the row-major numbering over `axes` (as listed) in JAX's numbering of a collective over the
    same axes, which takes them in mesh order."""
    coords = {}
    for a in reversed(axes):
        j, coords[a] = divmod(j, mesh_shape[a])
    out = 0
    for a in (a for a in mesh_shape if a in axes):
        out = out * mesh_shape[a] + coords[a]
    return out


def linear_axis_index(axes: Axes, mesh_shape: Mapping[str, int]):
    """This device's row-major index over `axes` (inside shard_map)."""
    idx = jnp.int32(0)
    for a in axes:
        idx = idx * mesh_shape[a] + jax.lax.axis_index(a)
    return idx


def _all_to_all(x, axis: str, n: int, split: int, concat: int):
    """A tiled all-to-all (dim `split` shrinks n-fold, dim `concat` grows) exchanged along a new leading dim.

    XLA:CPU splits an all-to-all whose split and concat dims differ into per-peer chunks, and for some
    layouts its verifier then rejects the chunks ("operands with different shapes"); exchanging the
    peers' chunks along a leading dim of their own is the same collective with one array operand.
    """
    shape = list(x.shape)
    parts = shape[:split] + [n, shape[split] // n] + shape[split + 1:]
    y = jnp.moveaxis(x.reshape(parts), split, 0)                      # [n, ..., s/n, ...]: chunk k for peer k
    y = jax.lax.all_to_all(y, axis, split_axis=0, concat_axis=0, tiled=True)  # [n, ...]: chunk from peer k
    y = jnp.moveaxis(y, 0, concat)                                    # peer-major before the concat dim
    out = shape[:split] + [shape[split] // n] + shape[split + 1:]
    out[concat] *= n
    return y.reshape(out)


def apply(steps: Sequence[Step], x, mesh_shape: Mapping[str, int]):
    """Run reshard steps on a local shard (inside shard_map)."""
    for st in steps:
        if st.kind == "all-slice":
            n = mesh_shape[st.axes[0]]
            size = x.shape[st.dim] // n
            start = jax.lax.axis_index(st.axes[0]) * size
            x = jax.lax.dynamic_slice_in_dim(x, start, size, axis=st.dim)
        elif st.kind == "pad":
            x = jnp.pad(x, [(0, st.size - x.shape[d]) if d == st.dim else (0, 0) for d in range(x.ndim)])
        elif st.kind == "unpad":
            x = jax.lax.slice_in_dim(x, 0, st.size, axis=st.dim)
        elif st.kind == "all-gather":
            x = jax.lax.all_gather(x, st.axes if len(st.axes) > 1 else st.axes[0], axis=st.dim, tiled=True)
        elif st.kind == "all-to-all":
            x = _all_to_all(x, st.axes[0], mesh_shape[st.axes[0]], split=st.dim, concat=st.src_dim)
        elif st.kind == "all-reduce" and x.dtype == jnp.bool_:  # a sum of bools is their or: max, in 1 byte
            x = jax.lax.pmax(x.astype(jnp.uint8), st.axes).astype(jnp.bool_)
        elif st.kind == "all-reduce":
            x = jax.lax.psum(x, st.axes)
        elif st.kind == "reduce-scatter":
            wide = x.dtype == jnp.bool_  # count the summands (in 4 bytes, as collectives() says), then or
            y = jax.lax.psum_scatter(x.astype(jnp.int32) if wide else x, st.axes if len(st.axes) > 1 else st.axes[0],
                                     scatter_dimension=st.dim, tiled=True)
            x = (y > 0) if wide else y
        elif st.kind == "collective-permute":
            pairs = [(s, t) for s, t in st.perm if s != t] + [(s, t) for s, t in st.perm if s == t]
            x = jax.lax.ppermute(x, st.axes if len(st.axes) > 1 else st.axes[0], perm=pairs)
        else:  # pragma: no cover
            raise AssertionError(st.kind)
    return x
