"""Where XLA's buffers are not the program's values: what its fusions never store, its sinks run early, and
the values a fresh output's buffer holds in place (fusion_aware, applied to lifetimes.py's Lifetimes by
liveness.peak and the automatic sharding's memory rows alike; measured against memory_analysis() on
benchmarks/memory_grid.py)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..representation.program import Eqn, Program, Value
from ..rules.factor_rules import POINTWISE
from .lifetimes import RELAYOUT, Lifetimes, _users

# ops XLA fuses into a reader that fuses too (a loop fusion), besides the pointwise ones
FUSED = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "iota",
                   "sharding_annotation"})


def _readers(program: Program) -> dict:
    """id() of every value -> the ops that read it, bodies included (lifetimes._users without positions)."""
    return {k: [e for e, _ in users] for k, users in _users(program).items()}


def _fuses(e: Eqn) -> bool:
    """An op XLA computes inside its reader's loop fusion (pointwise, broadcast, reshape, transpose)."""
    return not e.subs and (e.name in FUSED or e.name in POINTWISE)


def fused(program: Program) -> set:
    """The values XLA never stores: made by a top-level pointwise (or broadcast, reshape, transpose) op and
    read once, by such an op, so each is computed inside its reader's loop fusion (an optimizer's update,
    tree_map by tree_map over every parameter, is a few such chains per parameter ending in its new state).
    A value read twice is stored (XLA duplicates only cheap producers into several consumers), and so are a
    body's values and results, the program's outputs and what a loop, a reduction, a matmul or a collective
    reads."""
    readers = _readers(program)
    stored: set = {id(v) for v in program.outvars}
    for e in program.all_eqns():
        for sub in e.subs.values():
            stored.update(id(v) for v in sub.outvars)
    top = {id(e) for e in program.eqns}
    return {id(v) for e in program.eqns if _fuses(e) for v in e.outvars
            if id(v) not in stored and (len(readers.get(id(v), ())) == 1 or _outer(e)) and readers.get(id(v))
            and all(id(r) in top and _fuses(r) for r in readers[id(v)])}


def _outer(e: Eqn) -> bool:
    """A product of operands each broadcast to its shape (an RMSNorm's rsqrt times its scale): XLA's fusion
    duplicates the multiply into each of its readers, which read the broadcasts (liveness.broadcast_copies)."""
    n = math.prod(e.outvars[0].shape) if len(e.outvars) == 1 else 0
    return e.name == "mul" and all(not isinstance(x, Value) or math.prod(x.shape) < n for x in e.invars)


def _sinks_early(program: Program, lt: Lifetimes, gone: set) -> tuple[np.ndarray, dict]:
    """(The temporaries' last points, id() of each sink -> its point) with the program's sinks run as early as
    their operands allow, as XLA's
    memory-minimising scheduler runs them: a sink is a top-level op of those `fused` fuses whose results are
    outputs or fused values only sinks read (a parameter's optimizer update, run as soon as its gradient is made
    rather than after every gradient, as optax's tree_maps are written). The other readers keep their points."""
    top = {id(e) for e in program.eqns}
    readers = _readers(program)
    made_at = {id(v): int(a) for v, a in zip(lt.values, lt.start)}
    maker = {id(v): e for e in program.all_eqns() for v in e.outvars}
    fusing = lambda e: id(e) in top and _fuses(e)
    sinks = _sinks(program, gone, readers)
    ready: dict = {}  # id(op) -> the point its operands are all made at (fused ones: where their makers may run)

    def made(x) -> int:  # the first point x may be read at
        m = maker.get(id(x))
        if id(x) in made_at or m is None:
            return made_at.get(id(x), 0)  # a temporary where its op makes it; an argument or constant at once
        if fusing(m) and (id(x) in gone or id(m) in sinks):  # computed in its readers, or a sink run early
            return ready[id(m)]
        return lt.spans.get(m, (0, 0))[1]

    for e in program.eqns:  # in program order: an operand's maker's point is known before its reader's
        ready[id(e)] = max((made(x) for x in e.invars), default=0)
    end = lt.end.copy()
    for k, v in enumerate(lt.values):
        rs = readers.get(id(v), ())
        if not rs or any(id(r) not in top or r not in lt.spans for r in rs):
            continue
        points = [ready[id(r)] if id(r) in sinks else lt.spans[r][1] for r in rs]
        end[k] = min(end[k], max(int(lt.start[k]), *points))
    return end, {k: ready[k] for k in sinks if k in ready}


def _sinks(program: Program, gone: set, readers: dict) -> set:
    """id() of the sinks (_sinks_early), found from the last op back (a sink's readers come after it)."""
    top = {id(e) for e in program.eqns}
    outputs = {id(v) for v in program.outvars}
    fusing = lambda e: id(e) in top and _fuses(e)
    sinks: set = set()
    for e in reversed(program.eqns):
        if fusing(e) and all(id(v) in outputs or (id(v) in gone and all(id(r) in sinks for r in readers.get(
                id(v), ()))) for v in e.outvars):
            sinks.add(id(e))
    return sinks


def _hosted(program: Program, values: list, gone: set, fresh: set) -> dict:
    """id() of the stored values a fresh output's buffer holds until the output is written -> that output
    (fresh: id() of the outputs not written into a donated argument's buffer): a value only sinks read, of the
    shape and item size of an output their fused chain writes. XLA's loop fusion writes an elementwise result
    over an operand it reads last, so a parameter's gradient lives in its new value's buffer (one per output)."""
    readers = _readers(program)
    sinks = _sinks(program, gone, readers)
    taken: set = set()
    hosted: dict = {}
    for x in reversed(values):  # (a reader's result first)
        rs = readers.get(id(x), ())
        if id(x) in gone or not rs:
            continue
        if len(rs) == 1 and rs[0].name in RELAYOUT and len(rs[0].outvars) == 1 and id(rs[0].outvars[0]) in hosted:
            hosted[id(x)] = hosted[id(rs[0].outvars[0])]  # laid out as its reader's (hosted) result: one buffer
            continue  # (a dot writes it transposed)
        if not all(id(r) in sinks for r in rs):
            continue
        chain, seen, outs = list(rs), set(), []
        while chain:  # the sinks x's readers feed, through the values they fuse away
            e = chain.pop()
            if id(e) not in seen:
                seen.add(id(e))
                outs += [v for v in e.outvars if id(v) in fresh]
                chain += [r for v in e.outvars if id(v) in gone for r in readers.get(id(v), ())]
        host = next((o for o in outs if id(o) not in taken and tuple(o.shape) == tuple(x.shape)
                     and o.aval.dtype.itemsize == x.aval.dtype.itemsize), None)
        if host is not None:
            taken.add(id(host))
            hosted[id(x)] = host
    return hosted


def fusion_aware(program: Program, lt: Lifetimes, fresh: set = frozenset()) -> Lifetimes:
    """lt less the values XLA fuses away (`fused`) and those fresh outputs' buffers hold (`_hosted`; fresh: id()
    of the outputs not in a donated argument's buffer), with the sinks run early (`_sinks_early`), and the fresh
    outputs each with the point its buffer is taken from (Lifetimes.fresh: its op's, or a hosted value's)."""
    gone = fused(program)
    hosted = _hosted(program, lt.values, gone, fresh) if fresh and gone else {}
    taken: dict = {}  # id() of an output -> the first point its buffer holds a value it hosts
    for k, v in enumerate(lt.values):
        if id(v) in hosted:
            o = hosted[id(v)]
            taken[id(o)] = min(taken.get(id(o), len(lt.ops)), int(lt.start[k]))
    runs: dict = {}
    if gone:
        keep = [k for k, v in enumerate(lt.values) if id(v) not in gone and id(v) not in hosted]
        lt = dataclasses.replace(lt, values=[lt.values[k] for k in keep], start=lt.start[keep], end=lt.end[keep])
        lt.early = [v for v in lt.early if id(v) not in gone]
        lt.end, runs = _sinks_early(program, lt, gone)
    made = {id(v): e for e in program.eqns for v in e.outvars}
    outs = {id(o): o for o in program.outvars if id(o) in fresh and made.get(id(o)) in lt.spans}
    return dataclasses.replace(lt, fresh=[  # (made where its op runs: a sink as early as it may)
        (o, min(lt.spans[made[i]][0], runs.get(id(made[i]), len(lt.ops)), taken.get(i, len(lt.ops))))
        for i, o in outs.items()])
