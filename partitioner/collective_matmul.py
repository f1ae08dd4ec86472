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
permute with its matmul only where the HardwareProfile says the platform
overlaps communication with compute. The loop is unrolled (static trip count;
XLA keeps every permute), and its gradient is differentiated through it: a
ppermute transposes to a ppermute, so the backward pass of an all-gather ring
is a reduce-scatter ring and vice versa.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from .cost import Collective, HardwareProfile
from .factors import Rule
from .halo import ppermute
from .reshard import Step, linear_axis_index
from .sharding import Axes, Sharding

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
    """The permutes of the ring: n - 1 per direction, each of a piece (or accumulator) split over the streams."""
    shape = list(piece_shape)
    shape[ring.dim] //= ring.streams
    payload = int(math.prod(shape)) * dtype.itemsize
    what = "operand piece" if ring.kind == "all-gather" else "partial-sum accumulator"
    return [Collective("collective-permute", ring.axes, ring.n, payload, tuple(shape), str(dtype),
                       f"collective matmul {what}, step {t + 1}")
            for t in range(ring.n - 1) for _ in range(ring.streams)]


def time(ring: Ring, permutes: Sequence[Collective], compute: float, profile: HardwareProfile) -> float:
    """Ring time: a step's permutes (both directions at once) against its block of the matmul.

    With overlap, each of the n - 1 steps costs the longer of the two and the last block runs alone;
    without, the permutes and the blocks add up.
    """
    step_comm = max((c.time(profile) for c in permutes), default=0.0)
    block = compute / ring.n
    if profile.overlap:
        return (ring.n - 1) * max(step_comm, block) + block
    return (ring.n - 1) * ring.streams * step_comm + compute


def _where(rule: Rule, factor: str) -> tuple[list[Optional[int]], Optional[int]]:
    """The dim holding `factor` in each operand and in the result (None where it is absent)."""
    def find_dim(tf):
        return next((d for d, fd in enumerate(tf) if factor in fd), None)
    return [find_dim(tf) for tf in rule.operands], find_dim(rule.results[0])


def _pairs(n: int, step: int) -> list[tuple[int, int]]:
    return [(i, (i + step) % n) for i in range(n)]


def run(ring: Ring, rule: Rule, local_in: list, out_shape: tuple, mesh_shape: Mapping[str, int],
        bind: Callable, travelled: Optional[list] = None) -> tuple[object, list]:
    """The ring on local shards: the gathered operand as it is held (all-gather ring) or the result already
    scattered (reduce-scatter ring); every other operand as the candidate needs it.

    Returns the local result and, for an all-gather ring, the pieces held at each step: passed back in as
    `travelled` for another ring of the same value, they are reused instead of sent again (XLA would merge
    the identical permutes).
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
        if travelled is None:
            travelled = [[jax.lax.slice_in_dim(held, s * size, (s + 1) * size, axis=ring.dim)
                          for s in range(ring.streams)]]
            for _ in range(n - 1):
                travelled.append([ppermute(p, ring.axes, _pairs(n, dr), mesh_shape)
                                  for p, dr in zip(travelled[-1], directions)])
        acc = None
        for t, pieces in enumerate(travelled):
            for s, (piece, dr) in enumerate(zip(pieces, directions)):
                start = ((idx - dr * t) % n) * rows + s * size
                args = [piece if i == ring.operand else block(x, dims[i], start, size) for i, x in enumerate(local_in)]
                (y,) = bind(*args)
                if out_dim is None:
                    acc = y if acc is None else acc + y
                else:
                    acc = jnp.zeros(out_shape, y.dtype) if acc is None else acc
                    acc = jax.lax.dynamic_update_slice_in_dim(acc, y, start, axis=out_dim)
        return acc, travelled
    rows = out_shape[ring.dim]
    size = rows // ring.streams
    accs: list = [None] * ring.streams
    for t in range(n):
        for s, dr in enumerate(directions):
            start = ((idx + dr * (n - 1 - t)) % n) * rows + s * size
            (y,) = bind(*[block(x, dims[i], start, size) for i, x in enumerate(local_in)])
            accs[s] = y if t == 0 else ppermute(accs[s], ring.axes, _pairs(n, dr), mesh_shape) + y
    return (accs[0] if ring.streams == 1 else jnp.concatenate(accs, axis=ring.dim)), []
