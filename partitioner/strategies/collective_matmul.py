"""Collective matmul (windowed einsum): a dot_general's all-gather or reduce-scatter run as a ring.

Where the strategy chosen for a dot_general all-gathers an operand along a dim
over mesh axes A (the sequence-parallel or FSDP pattern), the ring instead
multiplies the piece each device holds and passes the pieces on by
collective-permute, n - 1 times; where it reduce-scatters the result over A
(row-parallel), the partial-sum accumulators travel instead. Which operand is
sliced and where each block lands follows from the factor of the ring's dim in
the dot's rule: a contracting factor accumulates, a free or batch factor
places blocks of the result. The bidirectional ring sends half of each piece
each way, halving each step's bytes on a bidirectional link.

This is a strategy of lower.py's one choice, not an engine of its own: it is
offered only where a candidate's plan already has exactly that all-gather or
reduce-scatter, and costed against it. The cost credits overlap of a step's
permute with its matmul only where the Hardware says the platform
overlaps communication with compute. The ring is a loop of n - 1 trips (a
known trip count, one permute per direction a trip), and its gradient is
differentiated through it: a ppermute transposes to a ppermute, so the
backward pass of an all-gather ring is a reduce-scatter ring and vice versa.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from ..costs.cost import Collective
from ..costs.hardware import Hardware
from ..representation.factors import Rule
from ..representation.sharding import Axes, Sharding
from .halo import ppermute
from .reshard import Step, linear_axis_index

MODES = ("auto", "off", "unidirectional", "bidirectional")


@dataclasses.dataclass(frozen=True)
class Ring:
    """A collective matmul: which collective it replaces, along which dim, over which axes, how many ways."""

    kind: str  # "all-gather": operand pieces travel; "reduce-scatter": partial-sum accumulators travel
    operand: int  # all-gather: the operand whose pieces travel; reduce-scatter: -1 (the result)
    dim: int  # that operand's dim (all-gather) or the result's dim (reduce-scatter)
    factor: str  # the rule's factor of that dim
    axes: Axes
    n: int
    streams: int  # 1: unidirectional; 2: bidirectional (half of each piece each way)

    @property
    def direction(self) -> str:
        return "bidirectional" if self.streams == 2 else "unidirectional"

    def describe(self) -> str:
        what = (f"all-gather of operand {self.operand} dim {self.dim}" if self.kind == "all-gather"
                else f"reduce-scatter of the result dim {self.dim}")
        return (f"collective matmul ({self.direction}, {self.n - 1} steps): {what} over {'*'.join(self.axes)} "
                f"as a ring of collective-permutes")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"collective_matmul={mode!r}; expected one of {MODES} ('auto' lets the cost model "
                         f"choose, crediting overlap only where the hardware profile overlaps communication)")
    return mode


def _streams(mode: str, rows: int) -> list[int]:
    """Ring directions to consider: halves need an even piece."""
    both = [1, 2] if rows % 2 == 0 else [1]
    return {"auto": both, "unidirectional": [1], "bidirectional": both[-1:]}.get(mode, [])


def find(rule: Rule, have: Sequence[Sharding], need: Sequence[Sharding], made: Sharding, planned: Sharding,
         in_steps: Sequence[Sequence[Step]], out_steps: Sequence[Step], shapes: Sequence[tuple],
         out_shape: tuple, mesh_shape: Mapping[str, int], mode: str) -> list[Ring]:
    """The rings that can replace a candidate's single all-gather of an operand or reduce-scatter of its result.

    in_steps[i]: the reshard steps of operand i from what it has to what the candidate needs; out_steps: the
    result's from what the candidate makes to the plan. Uneven (padded) dims are left to the plain collectives.
    """
    if mode == "off":
        return []
    out: list[Ring] = []
    for i, steps in enumerate(in_steps):
        if len(steps) != 1 or steps[0].kind != "all-gather" or have[i].padded or need[i].padded:
            continue
        st = steps[0]
        (f,) = rule.operands[i][st.dim]
        n = math.prod(mesh_shape[a] for a in st.axes)
        rows = have[i].local_shape(shapes[i], mesh_shape)[st.dim]
        if n > 1 and rows:
            out += [Ring("all-gather", i, st.dim, f, st.axes, n, s) for s in _streams(mode, rows)]
    if len(out_steps) == 1 and out_steps[0].kind == "reduce-scatter" and not made.padded and not planned.padded:
        st = out_steps[0]
        (f,) = rule.results[0][st.dim]
        n = math.prod(mesh_shape[a] for a in st.axes)
        rows = planned.local_shape(out_shape, mesh_shape)[st.dim]
        if n > 1 and rows and set(st.axes) == set(made.partial):
            out += [Ring("reduce-scatter", -1, st.dim, f, st.axes, n, s) for s in _streams(mode, rows)]
    return out


def collectives(ring: Ring, piece_shape: tuple, dtype) -> list[Collective]:
    """The permutes of one trip of the ring (n - 1 trips): one per direction, of a piece (or accumulator) split
    over the directions."""
    shape = list(piece_shape)
    shape[ring.dim] //= ring.streams
    payload = int(math.prod(shape)) * dtype.itemsize
    what = "operand piece" if ring.kind == "all-gather" else "partial-sum accumulator"
    return [Collective("collective-permute", ring.axes, ring.n, payload, tuple(shape), str(dtype),
                       f"collective matmul {what}, {'forward' if s == 0 else 'backward'}")
            for s in range(ring.streams)]


def time(ring: Ring, permutes: Sequence[Collective], compute: float, profile: Hardware) -> float:
    """Ring time: a step's permutes (both directions at once) against its block of the matmul.

    With overlap, each of the n - 1 steps costs the longer of the two and the last block runs alone;
    without, the permutes and the blocks add up.
    """
    step_comm = max((c.time(profile) for c in permutes), default=0.0)
    block = compute / ring.n
    if profile.overlap:
        return (ring.n - 1) * max(step_comm, block) + block
    return (ring.n - 1) * sum(c.time(profile) for c in permutes) + compute


def _where(rule: Rule, factor: str) -> tuple[list[Optional[int]], Optional[int]]:
    """The dim holding `factor` in each operand and in the result (None where it is absent)."""
    def find_dim(tf):
        return next((d for d, fd in enumerate(tf) if factor in fd), None)
    return [find_dim(tf) for tf in rule.operands], find_dim(rule.results[0])


def _pairs(n: int, step: int) -> list[tuple[int, int]]:
    return [(i, (i + step) % n) for i in range(n)]


def run(ring: Ring, rule: Rule, local_in: list, out_shape: tuple, mesh_shape: Mapping[str, int],
        bind: Callable):
    """The ring on local shards: the gathered operand as it is held (all-gather ring) or the result already
    scattered (reduce-scatter ring); every other operand as the candidate needs it.

    A loop of n - 1 trips whose permute is independent of its matmul (so the two can overlap): an unrolled
    ring lets XLA run every block's matmul first and hold all their partial products, n times the result.
    """
    idx = linear_axis_index(ring.axes, mesh_shape)
    n = ring.n
    dims, out_dim = _where(rule, ring.factor)
    directions = [1, -1][: ring.streams]

    def block(x, d, start, size):
        return x if d is None else jax.lax.dynamic_slice_in_dim(x, start, size, axis=d)

    if ring.kind == "all-gather":
        held = local_in[ring.operand]
        rows = held.shape[ring.dim]
        size = rows // ring.streams

        def blocks(t, pieces):
            for s, (piece, dr) in enumerate(zip(pieces, directions)):
                start = ((idx - dr * t) % n) * rows + s * size
                yield start, [piece if i == ring.operand else block(x, dims[i], start, size)
                              for i, x in enumerate(local_in)]

        def multiply(t, pieces, acc):
            if out_dim is None:  # a contracting dim: both directions' blocks in one matmul, one partial product
                parts = [args for _, args in blocks(t, pieces)]
                args = [a[0] if len(parts) == 1 or (i != ring.operand and dims[i] is None) else
                        jnp.concatenate([p[i] for p in parts], axis=ring.dim if i == ring.operand else dims[i])
                        for i, a in enumerate(zip(*parts))]
                return acc + bind(*args)[0]
            for start, args in blocks(t, pieces):
                acc = jax.lax.dynamic_update_slice_in_dim(acc, bind(*args)[0], start, out_dim)
            return acc

        def step(t, carry):  # the pieces held go on to the neighbour while they are multiplied
            acc, pieces = carry
            sent = [ppermute(p, ring.axes, _pairs(n, dr), mesh_shape) for p, dr in zip(pieces, directions)]
            return multiply(t, pieces, acc), sent

        pieces = [jax.lax.slice_in_dim(held, s * size, (s + 1) * size, axis=ring.dim) for s in range(ring.streams)]
        _, first = next(blocks(0, pieces))
        y = jax.eval_shape(lambda *a: bind(*a)[0], *first)
        acc = jnp.zeros(y.shape if out_dim is None else out_shape, y.dtype)
        acc, pieces = jax.lax.fori_loop(0, n - 1, step, (acc, pieces))
        return multiply(n - 1, pieces, acc)
    rows = out_shape[ring.dim]
    size = rows // ring.streams

    def products(t):
        for s, dr in enumerate(directions):
            start = ((idx + dr * (n - 1 - t)) % n) * rows + s * size
            yield bind(*[block(x, dims[i], start, size) for i, x in enumerate(local_in)])[0]

    def step(t, accs):  # an accumulator goes on to the neighbour while the next block's product is computed
        return [ppermute(a, ring.axes, _pairs(n, dr), mesh_shape) + y
                for a, dr, y in zip(accs, directions, products(t))]

    accs = jax.lax.fori_loop(1, n, step, list(products(0)))
    return accs[0] if ring.streams == 1 else jnp.concatenate(accs, axis=ring.dim)
