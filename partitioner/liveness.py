"""The step's temporaries: which values an op makes are alive at each point of the program, and their peak.

A value is alive from the op that makes it to its last reader, in program order (the order the per-device
program is emitted in). The points are the ops, with a body's ops (a scan's, a while loop's, a branch's) as
points of their own nested in the op that runs them: a value of the caller read by the loop is alive through
all of them, a body's values only within it, one trip's at a time (its buffers are reused from trip to
trip). A checkpointed region's ops are the caller's. Arguments and outputs are not temporaries (the report's
arguments and outputs count them, as memory_analysis() does). An operand resharded to what its reader
needs is a copy (`Copy`, from what the lowering did), alive from its first reader's first point to its last
reader's last: a loop's operand copied at its entry through all of the loop's points, a copy a later op
reuses until that op runs.

What this is: the program's own values, each in the sharding the plan gives it, at their per-device size.
What it is not: XLA's buffer assignment. XLA fuses elementwise ops (their results are never stored) and may
schedule ops in another order; a collective's own scratch is not counted. explain() reports this peak
beside memory_analysis()'s temp_size (tests/test_liveness.py compares them), and the automatic sharding
bounds it under a memory budget.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from .program import Eqn, Program, Value


@dataclasses.dataclass
class Lifetimes:
    """The program's points (its ops, bodies nested) and each temporary's first and last point."""
    ops: list[Eqn]  # per point, the op running there
    values: list[Value]  # the temporaries: values ops make that are not the program's outputs
    start: np.ndarray  # per value, the point its op makes it at
    end: np.ndarray  # per value, the last point that reads it (or its first, where none does)
    spans: dict = dataclasses.field(default_factory=dict)  # op -> (its first point, its last): a loop's its body's

    def span(self, readers) -> tuple[int, int]:
        """The points from the first of some ops' first points to the last of their last."""
        points = [self.spans[e] for e in readers if e in self.spans]
        return (min(p for p, _ in points), max(q for _, q in points)) if points else (0, -1)

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
    spans: dict = {}

    def read(x, point: int) -> None:
        if isinstance(x, Value) and x in start:
            end[x] = max(end[x], point)

    def walk(eqns) -> None:
        for e in eqns:
            if e.name == "remat2":  # a checkpointed region: its body's values are the caller's
                first = len(ops)
                walk(e.subs["body"].eqns)
                spans[e] = (first, len(ops) - 1)
                continue
            first = len(ops)
            for sub in e.subs.values():
                walk(sub.eqns)
                for x in sub.outvars:  # a body's results are read as it ends (a loop's next carry)
                    read(x, len(ops) - 1)
            if len(ops) == first:
                ops.append(e)
            last = len(ops) - 1
            spans[e] = (first, last)
            for x in e.invars:
                read(x, last)
            for v in e.outvars:  # a loop's results are written as it runs: alive from its first point
                start[v], end[v] = first, last

    walk(program.eqns)
    outputs = {id(v) for v in program.outvars if isinstance(v, Value)}
    values = [v for v in start if id(v) not in outputs and getattr(v.aval, "shape", None) is not None]
    return Lifetimes(ops, values, np.array([start[v] for v in values], int),
                     np.array([end[v] for v in values], int), spans)


def nbytes(v: Value, local_shape: tuple) -> int:
    """Bytes of a value's local shard (a typed PRNG key's: its key data's)."""
    return math.prod(local_shape) * v.aval.dtype.itemsize


@dataclasses.dataclass(eq=False)
class Copy:
    """An operand's local copy in the sharding its readers need, as the lowering made it."""
    local: object  # the local array (or a walk's token): what the ops that reuse the copy read
    value: Value  # the value it copies
    bytes: int  # per device
    readers: list = dataclasses.field(default_factory=list)  # the ops that read it, the first the one it was made for


@dataclasses.dataclass(frozen=True)
class Peak:
    """The most bytes per device the temporaries hold at once, where, and the largest of them there."""
    bytes: int
    op: str  # the op running at the peak, and where the user wrote it
    largest: tuple = ()  # ((what made it, bytes), ...) the largest values alive there, largest first

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "op": self.op, "largest": [list(x) for x in self.largest]}


def peak(program: Program, local_bytes: Callable[[Value], int], lt: Optional[Lifetimes] = None,
         named: int = 3, copies: Sequence[Copy] = (), names: Mapping[Value, str] = {}) -> Peak:
    """The temporaries' peak with each value at local_bytes(value) per device, and the operands' copies
    (each alive from its first reader's first point to its last reader's last); named: how many to name,
    names: what to call the program's inputs."""
    lt = lt or lifetimes(program)
    if not lt.ops:
        return Peak(0, "")
    sizes = np.array([local_bytes(v) for v in lt.values], float)
    at = lt.bytes_at(sizes)
    spans = [lt.span(c.readers) for c in copies]
    for c, (a, b) in zip(copies, spans):
        at[a: b + 1] += c.bytes
    p = int(np.argmax(at))
    made = {id(v): e for e in program.all_eqns() for v in e.outvars}

    def made_by(v: Value) -> str:
        e = made.get(id(v))
        return f"the result of {e.name}" if e is not None else str(v)

    held = [(int(sizes[i]), f"{made[id(lt.values[i])].name} at {made[id(lt.values[i])].source}")
            for i in lt.alive(p)]
    held += [(c.bytes, f"{names.get(c.value) or made_by(c.value)} resharded for {c.readers[0].name} at "
                       f"{c.readers[0].source}") for c, (a, b) in zip(copies, spans) if a <= p <= b]
    largest = tuple((what, n) for n, what in sorted(held, key=lambda t: -t[0])[:named])
    return Peak(int(at[p]), f"{lt.ops[p].name} at {lt.ops[p].source}", largest)
