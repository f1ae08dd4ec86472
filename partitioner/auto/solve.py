"""The integer program of automatic sharding (auto/graph.py's Graph), solved by scipy.optimize.milp (HiGHS).

Variables: x[n, s] in {0, 1}, node n runs option s, one per node; y[e, p, q] in [0, 1] per edge e and pair of
classes of its two nodes' options (options whose reshard costs on the edge are alike are one class), with
sum_q y[e, p, q] = sum_{s in p} x[src, s] and sum_p y[e, p, q] = sum_{t in q} x[dst, t] (the joint of two 0/1
choices is their product: exact). Minimised: the options' seconds plus the edges' reshard seconds. Under a
budget, memory rows (auto/memory.py) keep the arguments' and outputs' bytes per device, with the temporaries
alive at a point of the step, within it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from . import memory as RW
from .graph import Graph
from .memory import Temporaries

SLACK = 0.02  # a memory row may overstate a point's bytes by this share of the budget (auto_memory.row)
MIP_GAP = 1e-3  # HiGHS stops within 0.1% of the optimum's bound: a choice at most that far from the best


@dataclasses.dataclass
class Solution:
    picks: list[int]  # per node, its option
    seconds: float  # the objective: predicted seconds of the step under the model
    memory: int  # the arguments' and outputs' bytes per device
    proven: bool = True  # within MIP_GAP of the optimum (False: the best found within a time limit)
    temporaries: Optional[int] = None  # the peak of the temporaries' bytes per device (when they were given)
    points: list = dataclasses.field(default_factory=list)  # the program points whose memory rows it was solved with


class Infeasible(Exception):
    """No choice fits the budget."""


class Unsolved(Exception):
    """No choice found within the time limit."""


def memory_of(g: Graph) -> list[np.ndarray]:
    """Per node, per option: bytes per device held for the step (an argument's, an output's)."""
    return [np.array([o.memory for o in n.options], float) for n in g.nodes]


def _presolved(g: Graph) -> tuple[list[np.ndarray], dict]:
    """(per node its options' seconds, the edges left as {(a, b): seconds [options of a, options of b]}, a < b):
    an edge from or to a node of one option is a cost on the other node's options, edges between the same two
    nodes are one (their costs summed), and an edge that costs nothing is none."""
    unary = [np.array([o.seconds for o in node.options], float) for node in g.nodes]
    joined: dict = {}
    for e in g.edges:
        ns, nt = e.seconds.shape
        if ns == 1:
            unary[e.dst] += e.seconds[0]
        elif nt == 1:
            unary[e.src] += e.seconds[:, 0]
        elif e.src != e.dst:
            key, cost = ((e.src, e.dst), e.seconds) if e.src < e.dst else ((e.dst, e.src), e.seconds.T)
            joined[key] = joined[key] + cost if key in joined else cost
        else:
            unary[e.src] += np.diag(e.seconds)
    return unary, {k: c for k, c in joined.items() if c.any()}


def _eliminate(unary: list, edges: dict, keep: set) -> list:
    """Nodes of at most two neighbours, solved for every choice of their neighbours (the min-sum elimination
    of a chain: exact): a leaf's best cost per neighbour option becomes that neighbour's, a node between two
    its best cost per pair of their options an edge between them. Mutates unary and edges; returns, in the
    order eliminated, (node, its neighbours, its best option per choice of theirs)."""
    around: dict = {}
    for a, b in edges:
        around.setdefault(a, set()).add(b)
        around.setdefault(b, set()).add(a)

    def cost(i: int, j: int) -> np.ndarray:  # the edge's seconds as [options of i, options of j]
        return edges[i, j] if i < j else edges[j, i].T

    order, gone = [], set()
    queue = [i for i in range(len(unary)) if i not in keep and len(around.get(i, ())) <= 2]
    while queue:
        i = queue.pop()
        near = sorted(around.get(i, ()))
        if i in keep or i in gone or len(near) > 2:
            continue
        u = unary[i]
        if not near:
            order.append((i, (), np.argmin(u)))
        elif len(near) == 1:
            (j,) = near
            total = u[:, None] + cost(i, j)  # [i, j]
            order.append((i, (j,), np.argmin(total, axis=0)))
            unary[j] = unary[j] + total.min(axis=0)
        else:
            j, k = near
            total = u[:, None, None] + cost(i, j)[:, :, None] + cost(i, k)[:, None, :]  # [i, j, k]
            order.append((i, (j, k), np.argmin(total, axis=0)))
            edges[j, k] = edges[j, k] + total.min(axis=0) if (j, k) in edges else total.min(axis=0)
            around[j].add(k)
            around[k].add(j)
        for j in near:
            edges.pop((min(i, j), max(i, j)))
            around[j].discard(i)
            if len(around[j]) <= 2:
                queue.append(j)
        gone.add(i)
        around.pop(i, None)
    return order


def solve(g: Graph, mesh_shape: dict, budget: Optional[float] = None, exclude: Sequence[tuple[int, int]] = (),
          objective: str = "time", time_limit: Optional[float] = None, temps: Optional[Temporaries] = None,
          points: Sequence[int] = (), slack: float = SLACK) -> Solution:
    """The cheapest choice of one option per node (exclude: (node, option) pairs forbidden). objective="memory":
    the least memory instead (what a budget no choice meets is measured against). time_limit: seconds the
    solver may take; past them the best choice found is returned, marked not proven. temps: the step's
    temporaries, kept within the budget with the arguments and outputs at every point (auto/memory.py: a row
    per point where a choice's peak was over the budget, added until none is; points: rows to start from,
    a solve's own `points` for a solve of the same graph; slack: the share of the budget a row may overstate
    by, row()'s)."""
    memory = memory_of(g)
    limited = temps is not None and (budget is not None or objective == "memory")
    points = list(dict.fromkeys(list(points) + temps.first_points())) if limited else []
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    strict: set = set()  # the points whose rows count the outputs made after them (Temporaries.row)
    while True:
        over = slack * budget if budget is not None and objective == "time" else 0.0
        rows = [temps.row(p, memory, over, p in strict) for p in points]
        if not points or temps.outputs:  # (the arguments and outputs alone: what the later outputs bound)
            rows.append(RW.row(dict(enumerate(memory))))
        left = None if deadline is None else max(deadline - time.perf_counter(), 0.1)
        sol = _solve_rows(g, memory, rows, budget, exclude, objective, left)
        sol.points = points
        if temps is None:
            return sol
        at = temps.at(sol.picks)
        worst = int(np.argmax(at)) if len(at) else 0
        sol.temporaries = int(at[worst]) if len(at) else 0
        if not limited:
            return sol
        limit = budget if objective == "time" else max(r.at(sol.picks) for r in rows)
        if sol.memory + sol.temporaries <= limit * (1 + 1e-6):
            return sol
        if worst in points and worst not in strict and temps.outputs:  # the later outputs' buffers hold less
            strict.add(worst)
            continue
        if worst in points:  # its row holds, yet the choice is over it: the solver's tolerance, not a choice
            raise Unsolved(f"the solver's choice holds {sol.memory + sol.temporaries:.0f} bytes at a point whose "
                           f"row it was given, over {limit:.0f}")
        if deadline is not None and time.perf_counter() >= deadline:  # over the budget at a point no row holds yet
            raise Unsolved(f"no choice within the budget at every point found in {time_limit:.0f} s")
        points.append(worst)
        if temps.outputs and temps.row(worst, memory, over).at(sol.picks) <= limit * (1 + 1e-6):
            strict.add(worst)  # its row with the later outputs left out holds this choice: only strict cuts it off


def _solve_rows(g: Graph, memory: list, rows: list, budget: Optional[float], exclude: Sequence[tuple[int, int]],
                objective: str, time_limit: Optional[float]) -> Solution:
    """The choice with each memory row within the budget (objective="memory": the least of the rows' largest)."""
    if objective == "time":
        unary, edges = _presolved(g)
    else:
        unary, edges = [np.zeros(len(n.options)) for n in g.nodes], {}
    for node, s in exclude:
        unary[node] = unary[node].copy()
        unary[node][s] = np.inf
    limited = budget is not None or objective == "memory"
    keep = {i for r in rows for i in [*r.per_node, *(j for c in r.copies for j in (c.maker, *(d.node for d in
                                                                                              c.readers)))]} \
        if limited else set()  # in a memory row
    order = _eliminate(unary, edges, keep)
    gone = {i for i, _, _ in order}
    alive = [i for i in range(len(g.nodes)) if i not in gone]
    picks = [0] * len(g.nodes)
    proven = True
    if alive:
        proven = _integer_program(unary, edges, alive, rows if limited else [], budget, time_limit, picks,
                                  minimax=objective == "memory")
    for i, near, best in reversed(order):
        picks[i] = int(best if not near else best[tuple(picks[j] for j in near)])
    stuck = [g.nodes[i].what for i in gone if not np.isfinite(unary[i][picks[i]])]
    if stuck:
        raise Infeasible(f"no option of {stuck[0]} is left")
    held = int(sum(mem[p] for mem, p in zip(memory, picks)))
    seconds = float(sum(node.options[p].seconds for node, p in zip(g.nodes, picks))
                    + sum(e.seconds[picks[e.src], picks[e.dst]] for e in g.edges))
    return Solution(picks, seconds, held, proven=proven)


@dataclasses.dataclass
class _Rows:
    """The integer program's constraints as they are added: low <= sum coef * x[at] <= high, one per row."""
    rows: list = dataclasses.field(default_factory=list)
    cols: list = dataclasses.field(default_factory=list)
    vals: list = dataclasses.field(default_factory=list)
    lo: list = dataclasses.field(default_factory=list)
    hi: list = dataclasses.field(default_factory=list)

    def add(self, at: list, coef: list, low: float, high: float) -> None:
        self.rows.extend([len(self.lo)] * len(at))
        self.cols.extend(at)
        self.vals.extend(coef)
        self.lo.append(low)
        self.hi.append(high)


def _choice_variables(unary: list, edges: dict, alive: list, rows: _Rows) -> tuple:
    """The choice's variables and their costs: x per node and allowed option, y per edge and pair of its
    classes (options that cost alike on the edge), one option per node and each edge's joint with the two
    nodes' choices as its marginals. Returns (allowed, offsets, n: the x's, m: all, costs)."""
    allowed = {i: np.flatnonzero(np.isfinite(unary[i])) for i in alive}  # an excluded option has no variable
    offsets, n = {}, 0
    for i in alive:
        offsets[i] = n
        n += len(allowed[i])
    edge_at, m, classes = [], n, []
    for (a, b), seconds in edges.items():  # an edge's options that cost alike are one class: its joint is over
        seconds = seconds[np.ix_(allowed[a], allowed[b])]
        alike, row_of = np.unique(seconds, axis=0, return_inverse=True)  # classes
        cols, col_of = np.unique(alike, axis=1, return_inverse=True)
        classes.append((a, b, row_of.ravel(), col_of.ravel(), cols))
        edge_at.append(m)
        m += cols.size
    c = np.zeros(m)
    for i in alive:
        c[offsets[i]: offsets[i] + len(allowed[i])] = unary[i][allowed[i]] * 1e6  # in microseconds
    for (_, _, _, _, cost), at in zip(classes, edge_at):
        c[at: at + cost.size] = np.where(np.isfinite(cost), cost, 1e12).ravel() * 1e6
    c[np.abs(c) < 1e-6] = 0.0  # below a picosecond: noise to the solver
    for i in alive:  # one option per node
        rows.add(list(range(offsets[i], offsets[i] + len(allowed[i]))), [1.0] * len(allowed[i]), 1.0, 1.0)
    for (a, b, row_of, col_of, cost), at in zip(classes, edge_at):  # each edge's joint has the two nodes'
        ns, nt = cost.shape  # choices (summed over a class) as its marginals
        for p in range(ns):
            members = [offsets[a] + s for s in np.flatnonzero(row_of == p)]
            rows.add([at + p * nt + q for q in range(nt)] + members, [1.0] * nt + [-1.0] * len(members), 0.0, 0.0)
        for q in range(nt):
            members = [offsets[b] + t for t in np.flatnonzero(col_of == q)]
            rows.add([at + p * nt + q for p in range(ns)] + members, [1.0] * ns + [-1.0] * len(members), 0.0, 0.0)
    return allowed, offsets, n, m, c


def _copy_variables(mem_rows: list, allowed: dict, offsets: dict, first: int, rows: _Rows) -> tuple[dict, int]:
    """Each copy alive at a row's point: z in [0, 1], at least c_j = x[reader j, an option needing it] -
    x[maker, an option making it so] for a reader running there, and at least B + A - 1 with B >= c_j over the
    readers before the point, A >= c_j over those after (the copy is kept from the first reader to the last).
    Returns ({(id(copy), point): z}, how many variables were added from `first`)."""
    added = [0]

    def var() -> int:
        added[0] += 1
        return first + added[0] - 1

    def needed(z: int, rd, cp) -> None:  # z >= c_j
        on = [offsets[rd.node] + o for o in np.flatnonzero(rd.needs[allowed[rd.node]])]
        off = [offsets[cp.maker] + s for s in np.flatnonzero(cp.made[allowed[cp.maker]])]
        rows.add([z] + on + off, [1.0] + [-1.0] * len(on) + [1.0] * len(off), 0.0, np.inf)

    copy_at = {}
    for r in mem_rows:
        for cp in r.copies:
            z = copy_at[id(cp), r.point] = var()
            before, after = [], []
            for rd in cp.readers:
                if rd.first <= r.point <= rd.last:
                    needed(z, rd, cp)
                elif rd.last < r.point:
                    before.append(rd)
                else:
                    after.append(rd)
            if before and after:
                b, a = var(), var()
                for rd in before:
                    needed(b, rd, cp)
                for rd in after:
                    needed(a, rd, cp)
                rows.add([z, b, a], [1.0, -1.0, -1.0], -1.0, np.inf)
    return copy_at, added[0]


def _integer_program(unary: list, edges: dict, alive: list, mem_rows: list, budget: Optional[float],
                     time_limit: Optional[float], picks: list, minimax: bool = False) -> bool:
    """Solve the nodes left after elimination (setting their picks), each memory row (auto_memory.Row, its
    nodes alive) within the budget, or with minimax the largest row least; returns whether the optimum is
    proven."""
    rows = _Rows()
    allowed, offsets, n, m, c = _choice_variables(unary, edges, alive, rows)
    # then, with minimax, the largest row in MiB; then the copies' bytes
    copy_at, extra = _copy_variables(mem_rows, allowed, offsets, m + minimax, rows)
    c = np.concatenate([c, np.zeros(int(minimax) + extra)])
    upper = np.concatenate([np.ones(m), np.full(int(minimax), np.inf), np.ones(extra)])

    def terms(r, scale: float) -> tuple[list, list]:
        at = [offsets[i] + k for i in r.per_node for k in range(len(allowed[i]))]
        return (at + [copy_at[id(cp), r.point] for cp in r.copies],
                [x / scale for i, b in r.per_node.items() for x in b[allowed[i]]]
                + [cp.bytes / scale for cp in r.copies])

    if minimax:
        c[m] = 1.0
        for r in mem_rows:  # each row's bytes, in MiB, at most the largest
            at, coef = terms(r, 2**20)
            rows.add(at + [m], coef + [-1.0], -np.inf, -r.const / 2**20)
    elif budget is not None:  # the memory rows, in budgets so each reads <= 1 (the nodes holding memory are alive)
        for r in mem_rows:
            at, coef = terms(r, budget)
            rows.add(at, coef, -np.inf, 1.0 - r.const / budget)
    m += minimax + extra
    a = sparse.csr_array((rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lo), m))
    integrality = np.zeros(m)
    integrality[:n] = 1
    # the least memory (what "no sharding fits" is measured against) to the byte; the cheapest within MIP_GAP
    options = {"mip_rel_gap": 0.0 if minimax else MIP_GAP, **({"time_limit": time_limit} if time_limit else {})}
    res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(m), upper),
               constraints=LinearConstraint(a, np.array(rows.lo), np.array(rows.hi)), options=options)
    if res.x is None and res.status == 1:
        raise Unsolved(res.message)
    if res.status == 2 or res.x is None:
        raise Infeasible(res.message)
    if not res.success and res.status != 1:  # 1: the time limit, with a choice found
        raise RuntimeError(f"the automatic sharding's integer program was not solved: {res.message}")
    for i in alive:
        picks[i] = int(allowed[i][np.argmax(res.x[offsets[i]: offsets[i] + len(allowed[i])])])
    return res.status == 0
