"""The step's temporaries: which values an op makes are alive at each point of the program (their peak per
device: liveness.py).

A value is alive from the op that makes it to its last reader, in program order (the order the per-device
program is emitted in). The points are the ops, with a body's ops (a scan's, a while loop's, a branch's) as
points of their own nested in the op that runs them: a value of the caller read by the loop is alive through
all of them, a body's values only within it, one trip's at a time (its buffers are reused from trip to
trip). A checkpointed region's ops are the caller's. Arguments and outputs are not temporaries (the report's
arguments and outputs count them, as memory_analysis() does). An operand resharded to what its reader
needs is a copy (`Copy`, from what the lowering did), alive from its first reader's first point to its last
reader's last: a loop's operand copied at its entry through all of the loop's points, a copy a later op
reuses until that op runs.

Where XLA's buffers are known to differ from the program's values, this follows XLA (measured against
memory_analysis() on benchmarks/memory_grid.py, tests/test_liveness_grid.py): a loop's carry is one buffer
(its first value, the loop's result and each trip's new value, where the old one is read no more), as a
branch's result is its op's; XLA:CPU schedules an op as early as its operands allow, so an unrolled
checkpointed region's recomputation (what the rest of the region reads and XLA does not fuse into it) is
made where its operands are, as if there were no remat (in a loop's body, within the trip), and a constant
an update writes into is made at its body's start; a manual region (shard_map) holds its body's
temporaries (_manual_peak); a scan pipelined by prefetch.py, where the caller names it (lifetimes' `ahead`),
holds the weights it gathers a trip ahead and its peeled trip's recomputation through the loop (the lowering
names the scans it pipelined; the automatic sharding's rows, auto/memory.py, name every scan it may); a
constant loops alone read unchanged is sunk into their bodies, made where read (`sink`); a relayout of
a value loops read is made where the value is, hoisted out of a loop whose every trip makes it
(`_relaid_early`). A scan's stacked results are buffers made where the body it runs in starts (constants
its trips write into), each trip's result written into them as it is made; a stacked result that is a
stacked input, unchanged or annotated with its own sharding, is that input (`identities.forwarded`); and where the
plan's shardings are known, an annotation asking for the sharding its operand has is that operand's buffer
(`liveness.merge_identities`).

What this is: the program's own values, each in the sharding the plan gives it, at their per-device size.
What it is not: XLA's buffer assignment. XLA fuses elementwise ops (their results are never stored) and may
schedule ops in another order; a collective's own scratch is not counted. explain() reports this peak
beside memory_analysis()'s temp_size (tests/test_liveness.py compares them), and the automatic sharding
bounds it under a memory budget.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

import numpy as np
from jax import lax
from jax.extend import core

from ..representation.jax_compat import scan_counts
from ..representation.program import Eqn, Program, Value, from_jaxpr
from ..rules.factor_rules import POINTWISE
from .identities import forwarded


@dataclasses.dataclass
class Lifetimes:
    """The program's points (its ops, bodies nested) and each temporary's first and last point."""
    ops: list[Eqn]  # per point, the op running there
    values: list[Value]  # the temporaries: values ops make that are not the program's outputs
    start: np.ndarray  # per value, the point its op makes it at
    end: np.ndarray  # per value, the last point that reads it (or its first, where none does)
    spans: dict = dataclasses.field(default_factory=dict)  # op -> (its first point, its last): a loop's its body's
    scratch: list = dataclasses.field(default_factory=list)  # (first point, last, bytes, what): no value's (a
    # manual region's own temporaries)
    early: list = dataclasses.field(default_factory=list)  # the values made at the program's start
    twins: list = dataclasses.field(default_factory=list)  # (value, first point, last): a second copy of it
    fresh: list = dataclasses.field(default_factory=list)  # (an output not in a donated buffer, the point its
    # buffer is taken from): buffer_reuse.py's
    ready: dict = dataclasses.field(default_factory=dict)  # an op of a checkpointed region's recomputation ->
    # the point it runs at (its operands' latest, as XLA schedules it): the operands copied for it are made there

    def span(self, readers) -> tuple[int, int]:
        """The points from the first of some ops' first points (or where a recomputation runs) to the last of
        their last."""
        known = [e for e in readers if e in self.spans]
        if not known:
            return (0, -1)
        return min(min(self.ready.get(e, self.spans[e][0]), self.spans[e][0]) for e in known), \
            max(self.spans[e][1] for e in known)

    def bytes_at(self, sizes: np.ndarray) -> np.ndarray:
        """Per point, the bytes of the values alive there (sizes: per value)."""
        delta = np.zeros(len(self.ops) + 1)
        np.add.at(delta, self.start, sizes)
        np.add.at(delta, self.end + 1, -sizes)
        for a, b, n, _ in self.scratch:
            delta[a] += n
            delta[b + 1] -= n
        index = {id(v): k for k, v in enumerate(self.values)} if self.twins else {}
        for v, a, b in self.twins:
            if id(v) in index:
                delta[a] += sizes[index[id(v)]]
                delta[b + 1] -= sizes[index[id(v)]]
        return np.cumsum(delta[:-1])

    def alive(self, point: int) -> np.ndarray:
        """The indices of the values alive at a point."""
        return np.flatnonzero((self.start <= point) & (self.end >= point))


def _carries(e: Eqn) -> tuple[list, list]:
    """(the operands that start a loop's carries, (a body's value before the trip or None, the body's result
    XLA writes into that one buffer with the op's result)): a scan's or while loop's carries, a branch's
    results."""
    if e.name == "scan":
        nc, nk = scan_counts(e.params)
        body = e.subs["body"]
        return list(e.invars[nc:nc + nk]), list(zip(body.invars[nc:nc + nk], body.outvars[:nk]))
    if e.name == "while":
        bn, body = e.params["body_nconsts"], e.subs["body"]
        return list(e.invars[e.params["cond_nconsts"] + bn:]), list(zip(body.invars[bn:], body.outvars))
    if e.name == "cond":
        return [], [(None, x) for sub in e.subs.values() for x in sub.outvars]
    return [], []


def lifetimes(program: Program, ahead: Mapping[Eqn, int] = {},
              sharding: Optional[Callable[[Value], Any]] = None) -> Lifetimes:
    """Every temporary's lifetime over the program's points (see the module docstring). ahead: the scans the
    lowering pipelined (prefetch.py) -> the bytes of the weights they gather a trip ahead, held through the
    loop; their last trip, peeled off, runs after the loop, its recomputation made before it (_hoist).
    sharding: each value's in the plan, where known (an annotation keeping it is then the identity, and a
    stacked result that is a stacked input so annotated is that input: `identities.forwarded`)."""
    w = _Walk(program, ahead, sharding)
    w.walk(program.eqns, 0)
    return w.finish()


class _Walk:
    """The walk over the program's ops in order: each op's points, and each value's first and last."""

    def __init__(self, program: Program, ahead: Mapping[Eqn, int], sharding: Optional[Callable[[Value], Any]]):
        self.program, self.ahead, self.sharding = program, ahead, sharding
        self.ops: list[Eqn] = []
        self.start: dict = {}
        self.end: dict = {}
        self.spans: dict = {}
        self.last_read: dict = {}  # every value's last reader's point (a body's inputs' too)
        self.in_place: list = []  # (the value before the trip or None, the body's result) of _carries
        self.inits: list = []  # (loop, the operand starting a carry)
        self.regions: list = []  # per checkpointed region: (it, the first point of the body it runs in, a peeled scan)
        self.scratch: list = []  # Lifetimes.scratch
        self.free: set = set()  # the values of ops that read none (a broadcast constant)
        self.early: list = []  # (a value XLA makes as early as it can, the first point of the body it is made in)
        self.users = _users(program)
        self.sunk: dict = {}  # a body's input that is a constant XLA sinks into the loop -> that constant
        self.constants: set = set()  # the constants sunk (made where read)
        self.passed: set = set()  # (id() of a loop, id() of a constant it sinks): the loop does not read it
        self.forwarded: dict = {}  # a scan's stacked result that is its stacked input -> that input (no buffer)
        self.outputs = {id(v) for v in program.outvars if isinstance(v, Value)}

    def read(self, x, point: int) -> None:
        if isinstance(x, Value):
            self.last_read[x] = max(self.last_read.get(x, -1), point)
            x = self.forwarded.get(x, x)
            x = self.sunk.get(x, x)
            if x in self.start:
                self.end[x] = max(self.end[x], point)
            elif x in self.constants:
                self.start[x] = self.end[x] = point

    def sink(self, e: Eqn) -> None:
        """A loop's invariant operands that are constants (made from no operand) read by loops alone: XLA
        sinks them into the bodies (while-loop constant sinking), where they are made as they are read."""
        for k, name, j in _invariants(e):
            x = e.invars[k]
            if (isinstance(x, Value) and (x in self.free or x in self.sunk) and id(x) not in self.outputs
                    and all(k2 in {a for a, _, _ in _invariants(r)} for r, k2 in self.users[id(x)])):
                constant = self.sunk.get(x, x)
                if constant not in self.constants:  # made where a body first reads it
                    self.constants.add(constant)
                    self.start.pop(constant, None)
                    self.end.pop(constant, None)
                self.sunk[e.subs[name].invars[j]] = constant
                self.passed.add((id(e), id(x)))

    def walk(self, eqns, base: int, peeled: Optional[Eqn] = None) -> None:
        """base: the first point of the body the ops run in (0: the program's own); peeled: the pipelined scan
        whose body it is."""
        for e in eqns:
            first = len(self.ops)
            if e.name == "remat2":  # a checkpointed region: its body's values are the caller's
                self.walk(e.subs["body"].eqns, base, peeled)
                self.spans[e] = (first, len(self.ops) - 1)
                self.regions.append((e, base, peeled))
                continue
            self.sink(e)
            for sub in e.subs.values():
                self.walk(sub.eqns, first, e if e in self.ahead else None)
                ys = set(sub.outvars[scan_counts(e.params)[1]:]) if e.name == "scan" else set()
                for x in sub.outvars:  # a body's results are read as it ends (a loop's next carry); a scan's
                    # per-trip results are written into its stacked results as they are made (in place)
                    self.read(x, self.start[x] if x in ys and x in self.start else len(self.ops) - 1)
            if len(self.ops) == first:
                self.ops.append(e)
                if e.name == "shard_map":
                    self.manual(e, first, base)
            self.op(e, first, base)

    def manual(self, e: Eqn, first: int, base: int) -> None:
        """A manual region's own temporaries at its point, and the buffers it makes early before it."""
        inside, early_bytes = _manual_peak(e, {k for k, x in enumerate(e.invars) if x in self.sunk})
        self.scratch.append((first, first, inside, f"the temporaries of {e.name} at {e.source}"))
        if early_bytes and first > base:
            self.scratch.append((base, first - 1, early_bytes, f"buffers {e.name} at {e.source} makes early"))

    def op(self, e: Eqn, first: int, base: int) -> None:
        """An op's operands read at its last point, and its results alive from its first."""
        last = len(self.ops) - 1
        self.spans[e] = (first, last)
        for x in e.invars:  # (a sunk constant a manual region reads is the region's own)
            if not (e.name == "shard_map" and x in self.sunk) and (id(e), id(x)) not in self.passed:
                self.read(x, last)
        if self.sharding is not None and e.name == "scan":
            self.forwarded.update(forwarded(e, self.sharding))
        for v in e.outvars:  # a loop's results are written as it runs: alive from its first point
            if v not in self.forwarded:
                self.start[v], self.end[v] = first, last
        if not e.subs and not any(isinstance(x, Value) for x in e.invars):
            self.free.update(e.outvars)
        if e in self.ahead:
            self.scratch.append((first, last, self.ahead[e], f"the weights {e.name} at {e.source} gathers a trip "
                                                               f"ahead"))
        init, into = _carries(e)
        self.in_place.extend((a, b) for a, b in into if isinstance(b, Value))
        self.inits.extend((e, x) for x in init if isinstance(x, Value) and e.invars.count(x) == 1)
        targets = init + (e.invars[:1] if e.name.startswith("scatter") or e.name == "dynamic_update_slice" else [])
        self.early.extend((x, base) for x in targets if isinstance(x, Value) and x in self.free)
        if e.name == "scan":  # its stacked results' buffers: constants each trip writes its results into
            self.early.extend((v, base) for v in e.outvars[scan_counts(e.params)[1]:] if v not in self.forwarded)

    def finish(self) -> Lifetimes:
        """The lifetimes, as XLA schedules what the walk's program order does not say."""
        start, end, spans = self.start, self.end, self.spans
        for x, base in self.early:  # a constant's copy an update writes into: XLA schedules it first (no operands)
            start[x] = min(start[x], base)
        twins = []
        ready_ops: dict = {}
        for e, base, peeled in self.regions:
            stored = _hoist(e, base, spans[e], start, end, ready_ops)
            twins += [(v, *spans[peeled]) for v in dict.fromkeys(stored)] if peeled is not None else []
        _relaid_early(self.program, start, end, spans, self.users)
        for e, x in self.inits:  # a carry's first value the loop reads last: its buffer becomes the loop's result's
            first, last = spans[e]
            if x in start and end[x] == last:
                end[x] = max(start[x], first - 1)
        # a body's result takes its carry's buffer where the trip's value before it is no longer read
        outputs = self.outputs | {id(b) for a, b in self.in_place
                                  if b in start and (a is None or self.last_read.get(a, -1) <= start[b])}
        values = [v for v in start if id(v) not in outputs and getattr(v.aval, "shape", None) is not None]
        return Lifetimes(self.ops, values, np.array([start[v] for v in values], int),
                         np.array([end[v] for v in values], int), spans, self.scratch,
                         [x for x, base in self.early if base == 0 and x in values], twins, ready=ready_ops)


def _users(program: Program) -> dict:
    """id() of every value -> (an op reading it, the operand's position), bodies included."""
    users: dict = {}
    for e in program.all_eqns():
        for k, x in enumerate(e.invars):
            users.setdefault(id(x), []).append((e, k))
    return users


def _invariants(e: Eqn) -> list[tuple[int, str, int]]:
    """A loop's operands every trip reads unchanged: (operand position, body name, the body's input)."""
    if e.name == "scan":
        return [(k, "body", k) for k in range(scan_counts(e.params)[0])]
    if e.name == "while":
        cn, bn = e.params["cond_nconsts"], e.params["body_nconsts"]
        return [(k, "cond", k) for k in range(cn)] + [(cn + k, "body", k) for k in range(bn)]
    return []


def _made_inside(body: Program, constants: set, where) -> Program:
    """The region's body with its inputs at positions `constants` made inside it by an operand-free
    broadcast, each just before the first op that reads it (a constant the loop around the region sank)."""
    made = {id(body.invars[k]): body.invars[k] for k in constants}
    eqns: list = []
    for e in body.eqns:
        inner = [x for sub in e.subs.values() for q in sub.all_eqns() for x in q.invars]
        for x in [*e.invars, *inner]:
            if id(x) in made:
                eqns.append(Eqn(lax.broadcast_in_dim_p, [], [made.pop(id(x))], {}, where))
        eqns.append(e)
    return dataclasses.replace(body, invars=[v for k, v in enumerate(body.invars) if k not in constants],
                               eqns=eqns)


def _manual_peak(e: Eqn, constants: set = frozenset()) -> tuple[int, int]:
    """(the peak of a manual region's (shard_map's) own temporaries, the bytes of those XLA makes before the
    region runs: Lifetimes.early): its body's values, in the per-device shapes the body is written in (a
    partial-manual body's automatic axes not divided out: over, never under), those XLA fuses left out, and the
    inputs at positions `constants` (constants sunk into the loop the region runs in) made inside it. The
    per-device program inlines the body, so XLA schedules its ops among the caller's."""
    jaxpr = e.params.get("jaxpr")
    if jaxpr is None:
        return 0, 0
    body = from_jaxpr(jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else core.ClosedJaxpr(jaxpr, []))
    if constants:
        body = _made_inside(body, constants, e.where)
    lt = lifetimes(body)
    fusing = lambda e: e.name in _FUSED or e.name in POINTWISE
    stored = {id(x) for e in body.all_eqns() if not fusing(e) for x in e.invars}  # what an unfused op reads
    stored |= {id(v) for e in body.all_eqns() if not fusing(e) for v in e.outvars}
    stored |= {id(x) for x in lt.early}  # (an update's constant buffer)
    # what XLA fuses (a pointwise op's value only pointwise ops read) is never stored
    sizes = {id(v): math.prod(v.shape) * v.aval.dtype.itemsize if id(v) in stored else 0 for v in lt.values}
    at = lt.bytes_at(np.array([sizes[id(v)] for v in lt.values], float))
    return int(at.max(initial=0)), sum(sizes[id(v)] for v in lt.early)


_FUSED = frozenset({"broadcast_in_dim", "sharding_annotation", "reshape", "iota"})  # besides the pointwise ops


def _flat(eqns):
    """A checkpointed region's ops, nested regions' inlined (a loop is one op)."""
    for e in eqns:
        yield from (_flat(e.subs["body"].eqns) if e.name == "remat2" else (e,))


def _hoist(region: Eqn, base: int, span: tuple, start: dict, end: dict, ops_at: dict) -> list:
    """Make a checkpointed region's recomputation as early as its operands allow, as XLA schedules it: the
    region's ops that do not wait for its latest operand (the cotangent it transposes against) run where
    their operands are made (ops_at: each such op -> that point, filled in), and what they make that the rest
    reads is alive from there (base: the first point of the body the region runs in, where the values no op
    makes are)."""
    first, last = span
    made_at = lambda x: start[x] if x in start else base
    outside = [made_at(x) for x in region.invars if isinstance(x, Value) and made_at(x) < first]
    latest = max(outside, default=base)
    ready: dict = {}  # value -> the point its hoisted maker's operands are all made at
    ops = list(_flat(region.subs["body"].eqns))
    for e in ops:
        points = [ready.get(x, made_at(x) if made_at(x) < first else None) for x in e.invars if isinstance(x, Value)]
        if None not in points and max(points, default=base) < latest:
            ready.update((v, max(points, default=base)) for v in e.outvars)
            ops_at[e] = max(points, default=base) + 1
    fused = lambda e: e.name in _FUSED or e.name in POINTWISE
    # (value, whether the reader that needs it fuses): what the rest of the region and the caller read
    held = [(x, fused(e)) for e in ops if not all(v in ready for v in e.outvars) for x in e.invars if x in ready]
    held += [(v, False) for v in ready if v in start and end[v] > last]
    maker = {v: e for e in ops for v in e.outvars}
    seen: set = set()
    stored: list = []  # (returned: what it stores early)
    while held:  # a pointwise value a fusing reader needs, XLA recomputes there from its operands
        v, into = held.pop()
        if (v, into) in seen:
            continue
        seen.add((v, into))
        if into and fused(maker[v]):
            held += [(x, True) for x in maker[v].invars if x in ready]
        elif v in start:
            start[v] = min(start[v], ready[v] + 1)
            stored.append(v)
    return stored


RELAYOUT = frozenset({"transpose", "reshape", "squeeze", "expand_dims"})  # a value's layout, not its values


def _relaid_early(program: Program, start: dict, end: dict, spans: dict, users: dict) -> None:
    """Relayouts (transpose, squeeze, reshape) of a value loops read, made where the value is made, as XLA
    makes them: a loop body's relayout of an input every trip reads unchanged is hoisted out of the loop
    (loop-invariant code motion) and alive through it, and it and a top-level relayout of a value a loop
    reads run with the loop's own copy of the value, where the value is made (the value is read in the layout
    it is made in once, by every reader that changes that layout). A relayout of the program's input that
    only such relayouts read is alive no longer than its other readers need: XLA composes the relayouts."""
    maker = {id(v): e for e in program.all_eqns() for v in e.outvars}

    def root(x):  # the value a chain of relayouts starts from
        while isinstance(x, Value) and id(x) in maker and maker[id(x)].name in RELAYOUT:
            x = maker[id(x)].invars[0]
        return x

    def last_of_chain(v) -> bool:  # read by something other than a relayout
        return any(r.name not in RELAYOUT for r, _ in users.get(id(v), ()))

    loops = [e for e in program.all_eqns() if e.name in ("scan", "while") and e in spans]
    done: dict = {}  # id() of a value -> the ops that read it no more (they read its relayouts, made early)
    for e in loops:
        for k, name, j in _invariants(e):
            inside, x = e.subs[name].invars[j], e.invars[k]
            made = start.get(x, spans[e][0])
            for q in e.subs[name].eqns:
                v = q.outvars[0] if q.name in RELAYOUT and len(q.outvars) == 1 else None
                if v is not None and v in start and root(q.invars[0]) is inside and last_of_chain(v):
                    start[v], end[v] = min(start[v], made), max(end[v], spans[e][1])
            if all(q.name in RELAYOUT for q, _ in users.get(id(inside), ())):  # the loop reads the relayouts
                done.setdefault(id(x), set()).add(id(e))
    read_by_loops = {id(x) for e in loops if e in program.eqns for x in e.invars}
    for e in program.eqns:
        v = e.outvars[0] if e.name in RELAYOUT and len(e.outvars) == 1 else None
        x = root(e.invars[0]) if v is not None else None
        if isinstance(x, Value) and x in start and id(x) in read_by_loops and v in start:
            start[v] = min(start[v], start[x])
            done.setdefault(id(x), set()).add(id(e))
    inputs = {id(v) for v in program.invars}

    def relaid_input(x) -> bool:  # a relayout of the program's input: XLA composes the relayouts reading it
        seen = 0
        while isinstance(x, Value) and id(x) in maker and maker[id(x)].name in RELAYOUT | {"sharding_annotation"}:
            x, seen = maker[id(x)].invars[0], seen + (maker[id(x)].name in RELAYOUT)
        return seen > 0 and id(x) in inputs

    for x in [x for x in start if id(x) in done and relaid_input(x)]:  # read by the rest alone
        rest = [spans[r][1] for r, _ in users.get(id(x), ()) if id(r) not in done[id(x)] and r in spans]
        end[x] = max([start[x], *rest])
