"""Which compute each collective overlaps, and the communication time a step leaves exposed.

With asynchronous collectives (XLA's GPU and TPU runtimes, the latency-hiding scheduler) the per-device
program runs on two streams: compute on one, collectives on the other, each op as soon as its operands
are ready and its stream is free, the earliest in program order first when several are ready. So a
collective overlaps exactly the compute that neither feeds it nor waits for it: the weight-gradient
matmul beside a tensor-parallel input-gradient all-reduce, the next projection beside the previous one's
all-reduce, a layer's compute beside the next layer's prefetched weight gather. Without asynchronous
collectives (XLA:CPU, or a profile with ``overlap=False``) everything runs on one stream in program
order, and every collective is exposed.

This module list-schedules a report's rows (each with the values it reads and writes, and which of its
collectives run before its compute and which wait for its result) region by region: a loop body is one
region, run once per trip; its loop row is a barrier in the region around it that takes the body's span
times its trips. A scan body that runs once per call of the region around it is no region of its own: XLA
inlines a loop of one trip (WhileLoopSimplifier), so its rows (the report's `one_trip` ranges) join the
region around it, reading the values their inputs stand for (the report's `links`). A collective's
exposed time is the part of its span in which the compute stream is idle.
Nothing is assumed of the hardware but the durations the caller gives.
"""
from __future__ import annotations

import bisect
import dataclasses
import heapq
from typing import Callable, Optional, Sequence

INLINE = ("checkpoint/", "ring/")  # prefixes that are not regions of their own: they run where they sit
COMPUTE, COMM = 0, 1  # the streams


@dataclasses.dataclass
class Overlap:
    """A row's collectives per call of their region: seconds on the wire, seconds exposed, and the op whose
    compute hides most of the rest (its report row index), with the seconds it hides."""
    comm: float = 0.0
    exposed: float = 0.0
    behind: Optional[int] = None  # index into the report's rows
    hidden_by_it: float = 0.0
    calls: int = 1  # calls of the row's region per step


def region(primitive: str, joined: frozenset | set = frozenset()) -> str:
    """The loop body a row runs in: its primitive's prefix without the inline ones ("scan/checkpoint/dot"
    runs in "scan/") and without the levels `joined` (bodies of one trip a call: "scan/scan/dot" with level 2
    joined runs in "scan/")."""
    head = primitive.rpartition("/")[0]
    parts = [p for level, p in enumerate(head.split("/"), 1) if p and p + "/" not in INLINE and level not in joined
             ] if head else []
    return "".join(p + "/" for p in parts)


@dataclasses.dataclass
class _Node:
    row: int
    stream: int
    seconds: float
    deps: list
    order: int
    start: float = 0.0
    end: float = 0.0


class _Region:
    """One loop body's (or the program's) ops as nodes, scheduled when the region ends."""

    def __init__(self, calls: Optional[int]):
        self.calls = calls
        self.nodes: list[_Node] = []
        self.segments: list[list[_Node]] = [[]]  # split at loop rows (barriers)
        self.last: dict = {}  # value -> the node that makes it
        self.pending = 0.0  # seconds a step of the loop bodies met since the last row (the next loop row's)

    def add(self, row: int, stream: int, seconds: float, deps: list) -> _Node:
        n = _Node(row, stream, seconds, [d for d in deps if d is not None], len(self.nodes))
        self.nodes.append(n)
        self.segments[-1].append(n)
        return n

    def barrier(self) -> None:
        self.segments.append([])

    def schedule(self, overlaps: bool) -> float:
        """Start and end of every node; the region's span."""
        t = 0.0
        for seg in self.segments:
            t = _list_schedule(seg, t, overlaps)
        return t


def _list_schedule(nodes: list[_Node], t0: float, overlaps: bool) -> float:
    """Greedy list scheduling on two streams (one without overlap): the op that can start first runs first;
    among those ready when its stream frees, the one with the longest path to the region's end (the critical
    path first, as a latency-hiding scheduler orders them), then the earliest in program order."""
    if not nodes:
        return t0
    if not overlaps:
        t = t0
        for n in nodes:
            n.start, t = t, t + n.seconds
            n.end = t
        return t
    ids = {id(n) for n in nodes}
    waiting = {id(n): sum(1 for d in n.deps if id(d) in ids) for n in nodes}
    users: dict = {}
    for n in nodes:
        for d in n.deps:
            if id(d) in ids:
                users.setdefault(id(d), []).append(n)
    tail: dict = {}  # the longest path from a node to the end, itself included
    for n in reversed(nodes):
        tail[id(n)] = n.seconds + max([tail[id(u)] for u in users.get(id(n), ())], default=0.0)
    free = [t0, t0]
    pending: list[list] = [[], []]  # per stream: heap of (earliest start, priority, node) not yet startable
    avail: list[list] = [[], []]  # per stream: heap of (priority, node) startable when the stream frees

    def release(n: _Node) -> None:
        est = max([t0] + [d.end for d in n.deps])
        heapq.heappush(pending[n.stream], (est, (-tail[id(n)], n.order), n))

    for n in nodes:
        if not waiting[id(n)]:
            release(n)
    done, end = 0, t0
    while done < len(nodes):
        best = None
        for s in (COMPUTE, COMM):
            while pending[s] and pending[s][0][0] <= free[s]:
                _, order, n = heapq.heappop(pending[s])
                heapq.heappush(avail[s], (order, n))
            if avail[s]:
                cand = (free[s], avail[s][0][0], s)
            elif pending[s]:
                cand = (pending[s][0][0], pending[s][0][1], s)
            else:
                continue
            if best is None or cand < best:
                best = cand
        start, _, s = best
        n = heapq.heappop(avail[s])[1] if avail[s] else heapq.heappop(pending[s])[2]
        n.start, n.end = start, start + n.seconds
        free[s] = n.end
        end = max(end, n.end)
        done += 1
        for u in users.get(id(n), ()):
            waiting[id(u)] -= 1
            if not waiting[id(u)]:
                release(u)
    return end


def analyse(rows: Sequence, comm_time: Callable, compute_time: Callable, overlaps: bool,
            links: tuple[dict, dict] = ({}, {}), joined: Sequence[tuple[int, int, int]] = ()) -> list[Overlap]:
    """Per row, its collectives' time and exposed time per call of its region (see the module docstring).

    rows: report rows in program order (`reads`, `writes`, `issue`, `collectives`, `trips`, `calls`,
    `primitive`). comm_time(collective) and compute_time(row): seconds, as the caller's machine takes them.
    links: (a body's input -> the value it stands for, a loop's result -> the body's value it stands for),
    by value id, for the bodies that join the region around them. joined: (first row, end row, level) of each
    body run once per call of the code around it (level: its place in the rows' primitive paths, from 1)."""
    out = [Overlap() for _ in rows]
    comms: list[list[_Node]] = [[] for _ in rows]
    computes: list[Optional[_Node]] = [None] * len(rows)
    regions: list[_Region] = []  # every region, to read its compute spans afterwards
    stack: list[tuple[str, _Region]] = [("", _Region(1))]
    levels: list[set] = [set() for _ in rows]
    for start, end, level in joined:
        for i in range(start, min(end, len(rows))):
            levels[i].add(level)

    def close() -> None:
        _, done = stack.pop()
        span = done.schedule(overlaps)
        stack[-1][1].pending += span * (done.calls or 1)  # seconds a step: the next loop row's
        regions.append(done)

    for i, r in enumerate(rows):
        key, calls = region(r.primitive, levels[i]), getattr(r, "calls", r.trips)
        while len(stack) > 1 and not key.startswith(stack[-1][0]):
            close()
        while key != stack[-1][0]:  # into a body (and the bodies around it, whose rows come later)
            inner = key[len(stack[-1][0]):].split("/")[0] + "/"
            stack.append((stack[-1][0] + inner, _Region(None)))
        g = stack[-1][1]
        g.calls = g.calls or calls
        per_call = r.trips / max(calls, 1)  # a ring's row stands for n - 1 permutes a call
        loop, g.pending = g.pending / max(calls, 1), 0.0
        if loop:
            g.barrier()
        prev = _deps(g, r, links)
        issue = len(r.collectives) if getattr(r, "issue", None) is None else r.issue
        for c in r.collectives[:issue]:
            node = g.add(i, COMM, comm_time(c) * per_call, prev)
            comms[i].append(node)
            prev = [node]
        node = computes[i] = g.add(i, COMPUTE, compute_time(r) * per_call + loop, prev)
        prev = [node]
        if loop:
            g.barrier()
        for c in r.collectives[issue:]:
            node = g.add(i, COMM, comm_time(c) * per_call, prev)
            comms[i].append(node)
            prev = [node]
        for v in getattr(r, "writes", ()):
            g.last[v] = prev[0]
        out[i].calls = calls
    while len(stack) > 1:
        close()
    stack[0][1].schedule(overlaps)
    regions.append(stack[0][1])
    busy = {id(g): sorted((n.start, n.end, n.row) for n in g.nodes if n.stream == COMPUTE and n.seconds > 0)
            for g in regions}
    where = {id(n): id(g) for g in regions for n in g.nodes}
    for i, nodes in enumerate(comms):
        o = out[i]
        for n in nodes:
            spans = busy[where[id(n)]]
            hidden = _hidden(spans, n.start, n.end) if overlaps else {}
            o.comm += n.seconds
            o.exposed += max(n.seconds - sum(hidden.values()), 0.0)
            for row, s in hidden.items():
                if s > o.hidden_by_it:
                    o.behind, o.hidden_by_it = row, s
    return out


def _deps(g: _Region, r, links: tuple[dict, dict]) -> list:
    """The nodes row r waits for in region g: the makers of the values it reads (or of the values they stand
    for, a joined body's inputs), and of the values those it writes stand for (a joined body's input waits
    for its operand, a loop's result for the body's)."""
    ins, outs = links
    deps = []
    for v in getattr(r, "reads", ()):
        n = g.last.get(v)
        while n is None and v in ins:
            v = ins[v]
            n = g.last.get(v)
        deps.append(n)
    for w in getattr(r, "writes", ()):
        for t in (ins.get(w), outs.get(w)):
            if t is not None:
                deps.append(g.last.get(t))
    return deps


def _hidden(spans: list, start: float, end: float) -> dict[int, float]:
    """Seconds of [start, end) in which the compute stream is busy, per row computing then (spans: sorted,
    disjoint (start, end, row) of one region)."""
    out: dict[int, float] = {}
    i = max(bisect.bisect_right(spans, (start, float("inf"), 0)) - 1, 0)
    while i < len(spans) and spans[i][0] < end:
        s, e, row = spans[i]
        got = min(e, end) - max(s, start)
        if got > 0:
            out[row] = out.get(row, 0.0) + got
        i += 1
    return out


def exposed_per_step(timing: Sequence[Overlap]) -> float:
    """Seconds of communication a step leaves exposed: each row's per call of its region, times the calls."""
    return sum(o.exposed * o.calls for o in timing)
