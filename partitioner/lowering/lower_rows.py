"""The lowering's report rows: one per equation, and rows of their own for the reshards of inputs on entry
and outputs on exit, a body's edge reshards, a prefetch and a collective matmul's ring.

A mixin of Lowering (lower.py): rows are added only when the lowering collects a report (explain(), or a
planner's Lowering.cost()); their collectives are counted as the backend sends them (cost.on_the_wire).
"""
from __future__ import annotations

import math
from typing import Any, Optional

from ..costs.cost import on_the_wire
from ..reporting.report import Operand, Result, Row
from ..representation.program import Eqn, Value
from ..representation.sharding import Sharding


class ReportRows:
    """The rows the lowering adds to its report (a mixin of Lowering)."""

    def _boundary_row(self, kind: str, name: str, v: Value, src: Sharding, dst: Sharding, log: list) -> None:
        """A report row for the reshard of an input on entry (placement, padding) or an output on exit (cut)."""
        if self.report is None:
            return
        why = ("placed as the argument arrives, resharded to the plan" if kind == "input" else
               "resharded from the plan to how the output leaves")
        if dst.padded != src.padded:
            why += "; uneven dims padded on entry" if kind == "input" else "; uneven dims gathered and cut on exit"
        shape, dtype = tuple(v.shape), str(v.aval.dtype)
        reads, writes = ((), (id(v),)) if kind == "input" else ((id(v),), ())
        self._add_row(-1, name, kind, [Operand(shape, dtype, src, dst)],
                      [Result(shape, dtype, dst, dst, self.plan.origins.get(v, ""))], why, log, None, 0.0, 1,
                      reads, writes)

    def _add_row(self, index: int, source: str, name: str, ops: list, res: list, strategy: str, log: list,
                 fallback: Optional[str], compute: float, trips: int, reads: tuple = (), writes: tuple = (),
                 issue: Optional[int] = None) -> None:
        """Append a report row whose collectives are as the backend sends them (see cost.on_the_wire)."""
        sent = [on_the_wire(c, self.platform) for c in log]
        self.report.rows.append(Row(index, source, name, ops, res, strategy, sent, fallback, compute,
                                    sum(c.time(self.profile) for c in sent), trips, reads, writes,
                                    len(sent) if issue is None else issue, self._trips))

    def _edge_row(self, name: str, what: str, log: list, reads, writes) -> None:
        """A row for a body's own reshards of its inputs or results (run every trip, so counted with its trips)."""
        if log and self.report is not None:
            self._add_row(-1, f"{name} body", f"{self._prefix}{'results' if reads else 'inputs'}", [], [], what,
                          log, None, 0.0, self._trips, tuple(id(v) for v in reads if isinstance(v, Value)),
                          tuple(id(v) for v in writes if isinstance(v, Value)))

    def _record(self, eqn: Eqn, operands: list[tuple[Any, Sharding, Sharding]], made: list[Sharding],
                strategy: str, log: list, fallback: Optional[str] = None, compute: float = 0.0,
                issue: Optional[int] = None, values: bool = True) -> None:
        """One report row for an equation (when explain() is collecting one): (value, have, need) per operand.
        issue: how many of log's collectives run before the op computes (the rest wait for its result; None:
        all). values=False: the row reads and writes nothing for overlap.py (a region whose rows did)."""
        if self.report is None:
            return
        ops = [Operand(tuple(x.shape), str(x.aval.dtype), h, n) for x, h, n in operands if len(x.shape)]
        res = [Result(tuple(v.shape), str(v.aval.dtype), m, self.plan.sharding(v), self.plan.origins.get(v, ""))
               for v, m in zip(eqn.outvars, made)]
        reads = tuple(id(x) for x in eqn.invars if isinstance(x, Value)) if values else ()
        writes = tuple(id(v) for v in eqn.outvars) if values else ()
        self._add_row(eqn.index, eqn.source, self._prefix + eqn.name, ops, res, strategy, log, fallback, compute,
                      self._trips, reads, writes, issue)
        self.report.rows[-1].host_moves = self._host_moves(eqn, made)

    def _host_moves(self, eqn: Eqn, made: list[Sharding]) -> dict:
        """Bytes per device of the results that land in another memory space than their operand (a move
        between device and host memory, which the op does to each operand on its own)."""
        moves: dict = {}
        if len(eqn.invars) != len(eqn.outvars):
            return moves
        for x, v, m in zip(eqn.invars, eqn.outvars, made):
            before = getattr(getattr(x, "aval", None), "memory_space", None)
            after = getattr(v.aval, "memory_space", None)
            if before is None or after is None or before == after or tuple(x.shape) != tuple(v.shape):
                continue
            way = "to_host" if "host" in str(after).lower() else "to_device"
            local = math.prod(m.local_shape(tuple(v.shape), self.mesh_shape))
            moves[way] = moves.get(way, 0) + local * v.aval.dtype.itemsize
        return moves
