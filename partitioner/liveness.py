"""The step's temporaries: which values an op makes are alive at each point of the program, and their peak.

A value is alive from the op that makes it to its last reader, in program order (the order the per-device
program is emitted in). The points are the ops, with a body's ops (a scan's, a while loop's, a branch's) as
points of their own nested in the op that runs them: a value of the caller read by the loop is alive through
all of them, a body's values only within it, one trip's at a time (its buffers are reused from trip to
trip). A checkpointed region's ops are the caller's. Arguments and outputs are not temporaries (the report's
arguments and outputs count them, as memory_analysis() does). An op's operands resharded to what it needs
are copies alive while it runs: explain() adds them at its point, from what the lowering did.

What this is: the program's own values, each in the sharding the plan gives it, at their per-device size.
What it is not: XLA's buffer assignment. XLA fuses elementwise ops (their results are never stored) and may
schedule ops in another order; a collective's own scratch is not counted, nor a reshard reused by a later
reader past its first, nor the reshards of a loop's or a branch's own operands (the loop is no point of its
own: its body's ops are). explain()
reports this peak beside memory_analysis()'s temp_size (tests/test_liveness.py compares them), and the
automatic sharding bounds it under a memory budget.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Optional

import numpy as np

from .program import Eqn, Program, Value


@dataclasses.dataclass
class Lifetimes:
    """The program's points (its ops, bodies nested) and each temporary's first and last point."""
    ops: list[Eqn]  # per point, the op running there
    values: list[Value]  # the temporaries: values ops make that are not the program's outputs
    start: np.ndarray  # per value, the point its op makes it at
    end: np.ndarray  # per value, the last point that reads it (or its first, where none does)

    def bytes_at(self, sizes: np.ndarray) -> np.ndarray:
        """Per point, the bytes of the values alive there (sizes: per value)."""
        delta = np.zeros(len(self.ops) + 1)
        np.add.at(delta, self.start, sizes)
        np.add.at(delta, self.end + 1, -sizes)
        return np.cumsum(delta[:-1])

    def alive(self, point: int) -> np.ndarray:
        """The indices of the values alive at a point."""
        return np.flatnonzero((self.start <= point) & (self.end >= point))


def lifetimes(program: Program) -> Lifetimes:
    """Every temporary's lifetime over the program's points (see the module docstring)."""
    ops: list[Eqn] = []
    start: dict = {}
    end: dict = {}

    def read(x, point: int) -> None:
        if isinstance(x, Value) and x in start:
            end[x] = max(end[x], point)

    def walk(eqns) -> None:
        for e in eqns:
            if e.name == "remat2":  # a checkpointed region: its body's values are the caller's
                walk(e.subs["body"].eqns)
                continue
            first = len(ops)
            for sub in e.subs.values():
                walk(sub.eqns)
                for x in sub.outvars:  # a body's results are read as it ends (a loop's next carry)
                    read(x, len(ops) - 1)
            if len(ops) == first:
                ops.append(e)
            last = len(ops) - 1
            for x in e.invars:
                read(x, last)
            for v in e.outvars:  # a loop's results are written as it runs: alive from its first point
                start[v], end[v] = first, last

    walk(program.eqns)
    outputs = {id(v) for v in program.outvars if isinstance(v, Value)}
    values = [v for v in start if id(v) not in outputs and getattr(v.aval, "shape", None) is not None]
    return Lifetimes(ops, values, np.array([start[v] for v in values], int),
                     np.array([end[v] for v in values], int))


def nbytes(v: Value, local_shape: tuple) -> int:
    """Bytes of a value's local shard (a typed PRNG key's: its key data's)."""
    return math.prod(local_shape) * v.aval.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Peak:
    """The most bytes per device the temporaries hold at once, where, and the largest of them there."""
    bytes: int
    op: str  # the op running at the peak, and where the user wrote it
    largest: tuple = ()  # ((what made it, bytes), ...) the largest values alive there, largest first

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "op": self.op, "largest": [list(x) for x in self.largest]}


def peak(program: Program, local_bytes: Callable[[Value], int], lt: Optional[Lifetimes] = None,
         named: int = 3, resharded: Mapping[Eqn, int] = {}) -> Peak:
    """The temporaries' peak with each value at local_bytes(value) per device, and at each op the bytes of the
    operands it reshards (resharded: op -> bytes, the copies in the sharding it needs); named: how many to name."""
    lt = lt or lifetimes(program)
    if not lt.ops:
        return Peak(0, "")
    sizes = np.array([local_bytes(v) for v in lt.values], float)
    at = lt.bytes_at(sizes) + np.array([resharded.get(op, 0) for op in lt.ops], float)
    p = int(np.argmax(at))
    made = {id(v): e for e in program.all_eqns() for v in e.outvars}
    here = sorted(lt.alive(p), key=lambda i: -sizes[i])[:named]
    largest = tuple((f"{made[id(lt.values[i])].name} at {made[id(lt.values[i])].source}", int(sizes[i]))
                    for i in here)
    return Peak(int(at[p]), f"{lt.ops[p].name} at {lt.ops[p].source}", largest)
